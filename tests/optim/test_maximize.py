"""``maximize=True`` against torch.optim (serial torch is the reference): the local optimizers,
their state dicts and checkpoints; under mpiexec, ZeRO under an uneven Join."""

import numpy as np
import pytest
from helpers import UNEVEN, gathered_equal
from linear import gradient, initial_params, make_problem, rank_batches
from mpi4py import MPI

from tensorplay_mpi import (SGD, Adam, AdamW, DataParallel, Join, ZeroRedundancyOptimizer,
                            checkpoint)
from tensorplay_mpi.testing import assert_all, inputs_of

torch = pytest.importorskip("torch")

CASES = {  # name: (library class, torch class, hyperparameters of both)
    "sgd": (SGD, "SGD", {"lr": 0.1}),
    "sgd_decay": (SGD, "SGD", {"lr": 0.1, "weight_decay": 0.05}),
    "sgd_momentum": (SGD, "SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "sgd_nesterov": (SGD, "SGD", {"lr": 0.05, "momentum": 0.5, "nesterov": True}),
    "adam": (Adam, "Adam", {"lr": 0.05, "betas": (0.8, 0.99)}),
    "adam_l2": (Adam, "Adam", {"lr": 0.01, "eps": 1e-6, "weight_decay": 0.1}),
    "adamw": (AdamW, "AdamW", {"lr": 0.01, "weight_decay": 0.1}),
}
STEPS = 5


def shapes():
    return [(3, 2), (4,), ()]


def start(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape) for shape in shapes()]


def grads_at(t):
    return [np.cos(np.arange(np.prod(s, dtype=int)) + 3 * t + i).reshape(s)
            for i, s in enumerate(shapes())]


def torch_optimizer(case, tensors, **overrides):
    _, name, hyper = CASES[case]
    return getattr(torch.optim, name)(tensors, **{"maximize": True, **hyper, **overrides})


def torch_steps(opt, tensors, grads_per_step):
    for grads in grads_per_step:
        for t, g in zip(tensors, grads):
            t.grad = torch.from_numpy(np.array(g))
        opt.step()


def library_steps(opt, grads, first, last):
    for t in range(first, last):
        for g, new in zip(grads, grads_at(t)):
            g[...] = new
        opt.step()


def close(actual, expected):
    return all(np.allclose(a, np.asarray(e), rtol=1e-12, atol=1e-14)
               for a, e in zip(actual, expected))


@pytest.mark.parametrize("case", CASES)
def test_maximize_equals_torch_optim(case):
    cls, _, hyper = CASES[case]
    params = start()
    grads = [np.zeros_like(p) for p in params]
    library_steps(cls(params, grads, maximize=True, **hyper), grads, 0, STEPS)
    tensors = [torch.tensor(p, requires_grad=True) for p in start()]
    torch_steps(torch_optimizer(case, tensors), tensors, map(grads_at, range(STEPS)))
    assert close(params, [t.detach() for t in tensors])
    assert not close(params, start())  # it moved


@pytest.mark.parametrize("case", ["sgd_momentum", "adam", "adamw"])
def test_a_state_dict_carries_maximize_as_torch_param_groups_do(case):
    """Loading a maximize=True state into a maximize=False optimizer makes it maximize, as
    torch's load_state_dict takes the saved group's hyperparameters."""
    cls, _, hyper = CASES[case]
    params = start()
    grads = [np.zeros_like(p) for p in params]
    first = cls(params, grads, maximize=True, **hyper)
    library_steps(first, grads, 0, 2)
    state = first.state_dict()
    second = cls(params, grads, **hyper)
    second.load_state_dict(state)
    library_steps(second, grads, 2, STEPS)

    tensors = [torch.tensor(p, requires_grad=True) for p in start()]
    saved = torch_optimizer(case, tensors)
    torch_steps(saved, tensors, map(grads_at, range(2)))
    resumed = torch_optimizer(case, tensors, maximize=False)
    resumed.load_state_dict(saved.state_dict())
    torch_steps(resumed, tensors, map(grads_at, range(2, STEPS)))
    assert state["param_groups"][0]["maximize"] is True
    assert second.param_groups[0]["maximize"] is resumed.param_groups[0]["maximize"] is True
    assert close(params, [t.detach() for t in tensors])


def test_a_checkpoint_carries_maximize(tmp_path):
    cls, _, hyper = CASES["adamw"]
    params = start()
    grads = [np.zeros_like(p) for p in params]
    opt = cls(params, grads, maximize=True, **hyper)
    library_steps(opt, grads, 0, 2)
    checkpoint.save(tmp_path, params, optimizer=opt, comm=MPI.COMM_SELF)
    fresh = start(seed=1)
    resumed = cls(fresh, grads, **hyper)
    checkpoint.load(tmp_path, fresh, optimizer=resumed, comm=MPI.COMM_SELF)
    library_steps(resumed, grads, 2, STEPS)
    tensors = [torch.tensor(p, requires_grad=True) for p in start()]
    torch_steps(torch_optimizer("adamw", tensors), tensors, map(grads_at, range(STEPS)))
    assert resumed.param_groups[0]["maximize"] is True
    assert close(fresh, [t.detach() for t in tensors])


def test_maximize_must_be_a_bool():
    with pytest.raises(TypeError, match="maximize must be a bool, got 'yes'"):
        SGD([np.ones(2)], [np.ones(2)], lr=0.1, maximize="yes")


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------

def torch_replay(case, inputs):
    """Serial torch: per global iteration, the gradients of the active ranks' batches summed
    and divided by the world size (the Join's default), then torch's step."""
    x, y = make_problem()
    tensors = [torch.tensor(p, requires_grad=True) for p in initial_params()]
    opt = torch_optimizer(case, tensors)
    batches = [rank_batches(inputs, r) for r in range(len(inputs))]
    for t in range(max(inputs)):
        params = [p.detach().numpy() for p in tensors]
        every = [gradient(params, x[b[t]], y[b[t]]) for b in batches if len(b) > t]
        torch_steps(opt, tensors, [[sum(g[i] for g in every) / len(inputs)
                                    for i in range(len(tensors))]])
    return [t.detach() for t in tensors]


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
@pytest.mark.parametrize("case", ["sgd_momentum", "adam_l2", "adamw"])
def test_zero_with_maximize_equals_torch_optim_under_uneven_inputs(comm, pattern, case):
    cls, _, hyper = CASES[case]
    inputs = inputs_of(pattern, comm.size)
    x, y = make_problem()
    params = initial_params()
    dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-6)
    zero = ZeroRedundancyOptimizer(params, dp.grads, cls, comm=comm, maximize=True, **hyper)
    with Join([dp, zero]):
        for idx in rank_batches(inputs, comm.rank):
            with dp.step():
                for i, g in enumerate(gradient(params, x[idx], y[idx])):
                    dp.grads[i] = g
            zero.step()
    assert_all(close(params, torch_replay(case, inputs)), "ZeRO left serial torch")
    assert_all(gathered_equal(params, comm), "parameters differ across ranks at exit")


@pytest.mark.mpi
def test_a_consolidated_zero_state_carries_maximize_set_in_param_groups(comm):
    """Set after construction, as torch's ``opt.param_groups[0]["maximize"] = True``: the
    consolidated state carries the groups, not only the constructor's defaults."""
    cls, _, hyper = CASES["adam"]
    params = start()
    grads = [np.zeros_like(p) for p in params]
    zero = ZeroRedundancyOptimizer(params, grads, cls, comm=comm, **hyper)
    zero.param_groups[0]["maximize"] = True
    library_steps(zero, grads, 0, 2)
    zero.consolidate_state_dict(to=0)
    state = comm.bcast(zero.state_dict() if comm.rank == 0 else None, root=0)
    resumed = ZeroRedundancyOptimizer(params, grads, cls, comm=comm, **hyper)
    resumed.load_state_dict(state)
    library_steps(resumed, grads, 2, STEPS)
    tensors = [torch.tensor(p, requires_grad=True) for p in start()]
    torch_steps(torch_optimizer("adam", tensors), tensors, map(grads_at, range(STEPS)))
    assert_all(resumed.param_groups[0]["maximize"] is True and
               close(params, [t.detach() for t in tensors]), "the resumed ZeRO left torch")
