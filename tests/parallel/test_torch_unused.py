"""Parameters without a gradient follow torch.optim, under a Join with uneven inputs.

Frozen parameters (``requires_grad=False`` when DataParallel is built) get no bucket and no
step; a parameter that no rank's autograd reached in a step ends it with ``p.grad is None`` on
every rank, joined ranks included, and the library's optimizers (ZeRO included) skip it: no
weight decay, no momentum, no step count.  NumPy users say the same with
``dp.step(unused=...)``.  Every result is compared with a serial torch.optim replay.
"""

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import (SGD, Adam, AdamW, DataParallel, Join, ZeroRedundancyOptimizer)
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

torch = pytest.importorskip("torch")

from torch_reference import Branchy, arrays, close, loss_of, same_everywhere, serial  # noqa: E402

OPTIMIZERS = {  # ours, torch's, hyperparameters
    "sgd_momentum": (SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
    "adam": (Adam, torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.05}),
    "adamw": (AdamW, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def sometimes(rank, t):
    """The branch: never used at steps 2 and 5, used by some ranks only at the others."""
    return t % 3 != 2 and (t + rank) % 2 == 0


def freeze_first(model):
    model.first.requires_grad_(False)


def torch_update(kind, record):
    """The serial step with torch.optim, noting which ``p.grad`` are None before it."""
    def make(model):
        opt = OPTIMIZERS[kind][1](model.parameters(), **OPTIMIZERS[kind][2])

        def update():
            record.append([p.grad is None for p in model.parameters()])
            opt.step()
        return update
    return make


def train(comm, kind, inputs, uses, prepare=lambda model: None, zero=False):
    """The torch loop with the library's optimizer stepped through ``update=`` (so that every
    rank, joined or not, notes its ``p.grad`` in every step), or in ``Join([dp, opt])``."""
    ours, _, hyper = OPTIMIZERS[kind]
    model = Branchy()
    prepare(model)
    record = []
    opt = None

    def update():
        record.append([p.grad is None for p in model.parameters()])
        opt.step()

    dp = DataParallel(model.parameters(), comm=comm, bucket_cap_mb=1e-4, update=update)
    if zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), dp.grads, ours, **hyper)
    else:
        opt = ours(model.parameters(), dp.grads, **hyper)
    with Join([dp]):
        for t in range(inputs[comm.rank]):
            model.zero_grad()
            with dp.step():
                loss_of(model, comm.rank, t, uses=uses).backward()
    return model, dp, record


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_frozen_layers_stay_put_and_the_rest_is_torch_optim(comm, kind):
    inputs = inputs_of("three_plus_rank", comm.size)
    initial = arrays(Branchy())
    model, dp, _ = train(comm, kind, inputs, sometimes, prepare=freeze_first)
    expected = serial(torch_update(kind, []), inputs, sometimes, prepare=freeze_first)
    got = arrays(model)
    assert_all(all(np.array_equal(got[i], initial[i]) for i in (0, 1)),
               "a frozen parameter moved")
    assert_all(model.first.weight.grad is None and model.first.bias.grad is None,
               "a frozen parameter has a gradient")
    assert_all(not dp.used[:2].any(), f"dp.used of frozen parameters: {dp.used[:2]}")
    assert_all(same_everywhere(got, comm), "parameters differ between ranks")
    assert_all(not close(got, arrays(expected)), close(got, arrays(expected)))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("zero", [False, True], ids=["local", "zero"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("pattern", ["three_plus_rank", "rank0_zero", "even"])
def test_an_unused_branch_is_skipped_as_torch_optim_skips_it(comm, kind, pattern, zero):
    inputs = inputs_of(pattern, comm.size)
    model, dp, record = train(comm, kind, inputs, sometimes, zero=zero)
    expected_record = []
    expected = serial(torch_update(kind, expected_record), inputs, sometimes)
    got = arrays(model)
    assert_all(same_everywhere(got, comm), "parameters differ between ranks")
    assert_all(record == expected_record,
               f"p.grad is None per step: {record}, torch: {expected_record}")
    assert_all(not close(got, arrays(expected)), close(got, arrays(expected)))


@pytest.mark.mpi(min_size=1)
def test_the_library_optimizer_in_the_join_skips_unused_parameters(comm):
    """The other loop, ``Join([dp, opt])``: the optimizer's hook reads ``dp.used`` too."""
    inputs = inputs_of("three_plus_rank", comm.size)
    model = Branchy()
    dp = DataParallel(model.parameters(), comm=comm)
    opt = AdamW(model.parameters(), dp.grads, **OPTIMIZERS["adamw"][2])
    with Join([dp, opt]):
        for t in range(inputs[comm.rank]):
            model.zero_grad()
            with dp.step():
                loss_of(model, comm.rank, t, uses=sometimes).backward()
            opt.step()
    expected = serial(torch_update("adamw", []), inputs, sometimes)
    got = arrays(model)
    assert_all(same_everywhere(got + [opt.param_steps], comm), "state differs between ranks")
    assert_all(not close(got, arrays(expected)), close(got, arrays(expected)))
    branch_steps = sum(any(sometimes(r, t) for r in range(comm.size) if inputs[r] > t)
                       for t in range(max(inputs)))
    assert_all(opt.param_steps.tolist()[-2:] == [branch_steps] * 2,
               f"branch stepped {opt.param_steps.tolist()[-2:]} times, used {branch_steps}")


def numpy_grad(rank, t, i, shape):
    return np.cos(np.arange(np.prod(shape)) * (t + 1) + 7 * rank + i).reshape(shape)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_numpy_users_say_unused_and_get_torch_optim(comm, kind):
    """Arrays: ``dp.step(unused=...)``; an unused gradient is ignored whatever it holds."""
    inputs = inputs_of("three_plus_rank", comm.size)
    shapes = [(3, 2), (4,), ()]
    start = [np.linspace(-1, 1, int(np.prod(s))).reshape(s) for s in shapes]

    def uses(rank, t, i):
        return i != 1 or sometimes(rank, t)

    ours, theirs, hyper = OPTIMIZERS[kind]
    params = [a.copy() for a in start]
    dp = DataParallel(params, comm=comm)
    opt = ours(params, dp.grads, **hyper)
    with Join([dp, opt]):
        for t in range(inputs[comm.rank]):
            unused = [i for i in range(3) if not uses(comm.rank, t, i)]
            with dp.step(unused=unused):
                for i, shape in enumerate(shapes):
                    dp.grads[i][...] = 1e6 if i in unused else numpy_grad(comm.rank, t, i, shape)
            opt.step()

    tensors = [torch.tensor(a) for a in start]
    reference = theirs(tensors, **hyper)
    for t in range(max(inputs)):
        for i, p in enumerate(tensors):
            grads = [numpy_grad(r, t, i, shapes[i]) for r in range(comm.size)
                     if inputs[r] > t and uses(r, t, i)]
            p.grad = torch.tensor(sum(grads) / comm.size) if grads else None
        reference.step()
    expected = [p.numpy() for p in tensors]
    assert_all(same_everywhere(params, comm), "parameters differ between ranks")
    assert_all(not close(params, expected), close(params, expected))


@pytest.mark.mpi(min_size=1)
def test_freezing_after_construction_raises_on_every_rank(comm):
    model = Branchy()
    dp = DataParallel(model.parameters(), comm=comm)
    model.head.weight.requires_grad_(False)
    with raises_everywhere(RuntimeError, match=r"params\[2\] was frozen .*new DataParallel"):
        with dp.join():
            with dp.step():
                pass
    model.head.weight.requires_grad_(True)
    with dp.step():  # and the communicator is still usable
        loss_of(model, comm.rank, 0).backward()


@pytest.mark.mpi(min_size=1)
def test_unused_refuses_torch_parameters_and_bad_indices(comm):
    model = Branchy()
    dp = DataParallel(model.parameters(), comm=comm)
    with raises_everywhere(ValueError, match="read from autograd"):
        dp.step(unused=[0])
    with raises_everywhere(IndexError, match="out of range"):
        dp.step(unused=[9])
    with raises_everywhere(ValueError, match="micro_batches must be an int >= 1"):
        dp.step(micro_batches=0)
    for kind in (1.5, True, "2"):
        with raises_everywhere(TypeError, match="micro_batches must be an int >= 1"):
            dp.step(micro_batches=kind)


@pytest.mark.mpi(min_size=2)
def test_ranks_freezing_different_parameters_are_refused_everywhere(comm):
    model = Branchy()
    if comm.rank == 0:
        model.first.requires_grad_(False)
    with raises_everywhere(ValueError, match="frozen"):
        DataParallel(model.parameters(), comm=comm)
    assert_all(MPI.Is_initialized())
