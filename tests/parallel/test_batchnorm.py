"""Models with BatchNorm under DataParallel and a Join, against serial torch.

Two references, neither using the library:

- SyncBatchNorm: every global step replays serially on one ``torch.nn.BatchNorm1d`` model fed
  the concatenation of the batches of the ranks active at that step (each micro-batch its own
  concatenation); the loss is the sum of squared errors, the gradient is divided by the world
  size, then the same update (torch AdamW with clipping and a scheduler, or torch Adam against
  the library's Adam).
- Plain BatchNorm with ``buffers=model.buffers()``: each active rank's gradient comes from its
  own batch (its own batch statistics) on a copy of the current state; the running statistics
  after a step are those of the highest active rank's batch (DataParallel broadcasts them from
  there at the step's end); the summed gradients divided by the world size step torch SGD.

Replicas are compared bitwise across ranks; references to float64 rounding.
"""

import contextlib
import os

import numpy as np
import pytest
from helpers import PROGRAMS, results

from tensorplay_mpi import (SGD, Adam, DataParallel, Join, JoinableComm,
                            ZeroRedundancyOptimizer, checkpoint, request_save, request_stop)
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere, run_mpi

torch = pytest.importorskip("torch")
from tensorplay_mpi.evaluation._sync_batchnorm import SyncBatchNorm  # noqa: E402  (needs torch)

PATTERNS = ["three_plus_rank", "rank0_zero", "last_zero", "even"]
TOL = 1e-9
PROGRAM_OUTSIDE = str(PROGRAMS / "sbn_outside_step.py")


class Net(torch.nn.Module):
    """Linear - BatchNorm1d - tanh - Linear, float64."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 5, bias=False)  # a bias before BatchNorm: no gradient
        self.norm = torch.nn.BatchNorm1d(5)
        self.head = torch.nn.Linear(5, 3)
        self.double()

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.first(x))))


def sizes(inputs, t, m=0):
    """{rank: size of its micro-batch `m` at step `t`} over the ranks active at `t`: 0 to 3
    samples, at least 2 in all (BatchNorm needs 2 values per channel)."""
    row = {r: [0, 1, 3, 2][(r + t + m) % 4] for r in range(len(inputs)) if inputs[r] > t}
    if sum(row.values()) <= 1:
        row[max(row)] = 3
    return row


def batch(rank, t, m=0, n=0):
    g = torch.Generator().manual_seed(10_000 * rank + 100 * t + m)
    return (torch.randn(n, 6, generator=g, dtype=torch.float64) * 2 + 1,
            torch.randn(n, 3, generator=g, dtype=torch.float64))


def sse(model, x, y):
    return ((model(x) - y) ** 2).sum()


def global_batch(inputs, t, m):
    """The concatenated micro-batch `m` of the ranks active at `t` (at least 2 samples)."""
    xs, ys = zip(*(batch(r, t, m, n) for r, n in sizes(inputs, t, m).items()))
    return torch.cat(xs), torch.cat(ys)


def torch_update(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
    return update, opt


def serial_sync_batchnorm(inputs, micro, make_update):
    model = Net()
    update, opt = make_update(model)
    losses = []
    for t in range(max(inputs)):
        opt.zero_grad()
        total = 0.0
        for m in range(micro):
            loss = sse(model, *global_batch(inputs, t, m))
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        for p in model.parameters():
            p.grad /= len(inputs)
        update()
    return model, opt, losses


def sync_model(comm):
    """A JoinableComm, the Net converted to SyncBatchNorm over it, a DataParallel over it."""
    jc = JoinableComm(comm)
    model = SyncBatchNorm.convert_sync_batchnorm(Net(), jc)
    return jc, model, DataParallel(model.parameters(), comm=comm, buffers=model.buffers())


def state(model, opt):
    """Every array of the model (parameters, running statistics) and the optimizer's moments
    (torch's or the library's state dict: the same layout)."""
    arrays = [v.detach().numpy().copy() for v in model.state_dict().values()]
    for per_param in ({} if opt is None else opt.state_dict()["state"]).values():
        arrays += [np.asarray(per_param[k]).copy() for k in ("exp_avg", "exp_avg_sq")]
    return arrays


def differences(got, expected):
    return [i for i, (g, e) in enumerate(zip(got, expected))
            if g.shape != e.shape or not np.allclose(g, e, rtol=TOL, atol=TOL)]


def same_everywhere(arrays, comm):
    every = comm.allgather([np.ascontiguousarray(a).tobytes() for a in arrays])
    return all(e == every[0] for e in every)


class LibraryAdam:
    """The library's Adam, in the Join, beside torch Adam as the serial reference."""

    @staticmethod
    def serial(model):
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
        return opt.step, opt


FORMS = {  # how the model is converted and what the Join lists besides dp and an optimizer
    "natural": (False, False),  # convert_sync_batchnorm(model); Join([dp]): dp brings a stream
    "natural_logged": (False, True),  # the same, and a JoinableComm of the caller's, Join([dp,
    # jc]), that logs the loss: the layers reduce through it
    "explicit": (True, True),  # convert_sync_batchnorm(model, jc); Join([dp, jc])
}


@pytest.mark.mpi
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("variant", ["update", "library", "zero", "micro"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_sync_batchnorm_trains_with_data_parallel_in_one_join_as_serial(comm, pattern, variant,
                                                                        form):
    """SyncBatchNorm's statistics (forward and backward), DataParallel's buckets, an optimizer
    step and a loss logged through a JoinableComm share one Join on uneven inputs."""
    explicit, logs = FORMS[form]
    inputs = inputs_of(pattern, comm.size)
    micro = 2 if variant == "micro" else 1
    jc = JoinableComm(comm) if logs else None
    model = SyncBatchNorm.convert_sync_batchnorm(Net(), jc if explicit else None)
    library = variant in ("library", "zero")
    if library:
        dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers())
        opt = (Adam(list(model.parameters()), dp.grads, lr=0.02) if variant == "library" else
               ZeroRedundancyOptimizer(list(model.parameters()), dp.grads, Adam, lr=0.02))
        joinables = [dp, opt]
    else:
        update, opt = torch_update(model)
        dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers(), update=update)
        joinables = [dp]
    logged = []
    with Join(joinables + ([jc] if logs else [])):
        for t in range(inputs[comm.rank]):
            model.zero_grad()
            with dp.step(micro_batches=micro):
                total = 0.0
                for m in range(micro):
                    loss = sse(model, *batch(comm.rank, t, m, sizes(inputs, t, m)[comm.rank]))
                    if logs:  # logged, mid-step
                        total += float(jc.allreduce(loss.detach().reshape(1)))
                    loss.backward()
            if library:
                opt.step()
            logged.append(total)
    reference, ref_opt, losses = serial_sync_batchnorm(
        inputs, micro, LibraryAdam.serial if library else torch_update)
    if variant == "zero":  # the state is sharded: the model's arrays only
        mine, expected = state(model, None), state(reference, None)
    else:
        mine, expected = state(model, opt), state(reference, ref_opt)
    assert_all(not differences(mine, expected),
               f"state entries off the serial replay: {differences(mine, expected)}")
    assert_all(same_everywhere(mine, comm), "the ranks hold different model or optimizer state")
    if logs:
        assert_all(np.allclose(logged, losses[:len(logged)], rtol=TOL, atol=TOL),
                   f"logged losses {logged} against {losses}")


def nothing_pending(comm):
    """Every rank can still run a collective on `comm`: nothing started, nothing pending."""
    total = JoinableComm(comm).allreduce(np.ones(1))
    assert_all(total[0] == comm.size)


@pytest.mark.mpi
def test_a_plain_communicator_names_the_working_forms_on_every_rank_before_anything(comm):
    """convert_sync_batchnorm(model, comm), then Join([dp]): a clear error on every rank when
    the Join is made, never a cross-matched collective."""
    model = SyncBatchNorm.convert_sync_batchnorm(Net(), comm)
    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers())
    with raises_everywhere(ValueError, match=r"plain communicator.*convert_sync_batchnorm\("
                                             r"model\)`.*Join\(\[dp\]\).*JoinableComm"):
        Join([dp])
    nothing_pending(comm)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["no_data_parallel", "converted_after_data_parallel",
                                  "joinable_comm_elsewhere"])
def test_a_layer_that_a_join_cannot_shadow_raises_on_every_rank_before_reducing(comm, case):
    """The model's DataParallel is not in the Join (a ZeRO optimizer of other arrays leads
    it), or was built before the model was converted (it saw no layer), or the layers reduce
    through a JoinableComm outside the Join: the forward pass raises, naming the forms."""
    other = JoinableComm(comm)
    model = Net()
    after = case == "converted_after_data_parallel"
    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers()) if after else None
    model = SyncBatchNorm.convert_sync_batchnorm(
        model, other if case == "joinable_comm_elsewhere" else None)
    if not after:  # a DataParallel over the model that stays out of the Join
        DataParallel(model.parameters(), comm=comm, buffers=model.buffers())
    zero = ZeroRedundancyOptimizer([np.zeros(2)], [np.ones(2)], SGD, comm=comm, lr=0.1)
    match = {"joinable_comm_elsewhere": "JoinableComm that is not in the running Join"}.get(
        case, r"without a group.*this Join has none.*Join\(\[dp\]\)")
    with raises_everywhere(RuntimeError, match=match):
        with Join([dp if dp is not None else zero]):
            with dp.step() if dp is not None else contextlib.nullcontext():
                if dp is None:
                    zero.step()
                model(batch(comm.rank, 0, n=3)[0])
    nothing_pending(comm)


@pytest.mark.mpi
def test_two_data_parallels_in_one_join_raise_on_every_rank(comm):
    first, second = Net(), SyncBatchNorm.convert_sync_batchnorm(Net())
    dps = [DataParallel(m.parameters(), comm=comm, buffers=m.buffers()) for m in (first, second)]
    for joinables in (dps, dps[::-1]):
        with raises_everywhere(ValueError, match="at most one DataParallel, got 2"):
            Join(joinables)
    nothing_pending(comm)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_convert_with_and_without_a_group_raise_on_every_rank(comm):
    jc = JoinableComm(comm)  # collective: made on every rank
    model = SyncBatchNorm.convert_sync_batchnorm(Net(), jc if comm.rank else None)
    with raises_everywhere(ValueError, match="SyncBatchNorm layers without a group"):
        DataParallel(model.parameters(), comm=comm, buffers=model.buffers())
    nothing_pending(comm)


@pytest.mark.mpi
def test_a_layer_over_a_plain_communicator_refuses_to_train_inside_a_join(comm):
    layer = SyncBatchNorm(3, process_group=comm).double()
    jc = JoinableComm(comm)
    with raises_everywhere(RuntimeError, match="plain communicator inside a running Join"):
        with Join([jc]):
            jc.begin_iteration()
            layer(torch.ones(4, 3, dtype=torch.float64))


@pytest.mark.mpi(min_size=2)  # one rank: the layer reduces nothing (no collective to order)
def test_the_forward_pass_before_the_first_step_is_refused_with_the_remedy(comm):
    jc, model, dp = sync_model(comm)
    with raises_everywhere(RuntimeError, match=r"inside `with dp.step\(\):`"):
        with Join([dp, jc]):
            model(batch(comm.rank, 0, n=3)[0])


@pytest.mark.parametrize("outside", ["before_the_step", "no_sync"])
def test_a_later_forward_pass_outside_the_step_is_refused_not_hung(outside):
    """tests/programs/sbn_outside_step.py: a forward pass before dp.step() (or under no_sync)
    in a later iteration, as rank 0 runs out of inputs: its statistics belong to no iteration
    and rank 0 would never shadow them (it hung until the timeout).  RuntimeError where it
    runs, a PeerFailureError naming it on rank 0, within 60 s."""
    result = run_mpi(2, [PROGRAM_OUTSIDE, outside], timeout=60)
    outcomes = results(result.stdout)
    assert set(outcomes) == {0, 1}, result.stdout + result.stderr[-2000:]
    assert outcomes[1].startswith("RuntimeError: ") and "inside `with dp.step():`" in \
        outcomes[1], outcomes
    assert outcomes[0].startswith("PeerFailureError: ") and "inside `with dp.step():`" in \
        outcomes[0], outcomes


@pytest.mark.mpi
@pytest.mark.parametrize("dims", [2, 3])
def test_a_batch_empty_on_every_rank_behaves_as_serial_batchnorm(comm, dims):
    shape = (0, 3) if dims == 2 else (0, 3, 4)
    layer = SyncBatchNorm(3, process_group=comm).double()
    serial = torch.nn.BatchNorm1d(3).double()
    outputs = []
    for norm in (layer, serial):
        x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
        y = norm(x)
        y.sum().backward()
        outputs.append((y.shape, norm.weight.grad.clone(), norm.bias.grad.clone(),
                        norm.running_mean.clone(), norm.running_var.clone(),
                        int(norm.num_batches_tracked)))
    (shape_a, *rest_a), (shape_b, *rest_b) = outputs
    assert_all(shape_a == shape_b and all(
        (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
        for a, b in zip(rest_a, rest_b)), f"{outputs}")


# -- plain BatchNorm: the buffers in every save ------------------------------------------------

def serial_plain(inputs, steps):
    """Model state after `steps` global steps (see the module's docstring)."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for t in range(steps):
        active = [r for r in range(len(inputs)) if inputs[r] > t]
        grads = [torch.zeros_like(p) for p in model.parameters()]
        start = {k: v.clone() for k, v in model.state_dict().items()}
        buffers_after = None
        for r in active:
            model.load_state_dict(start)
            model.zero_grad()
            sse(model, *batch(r, t, n=2 + (r + t) % 3)).backward()
            grads = [g + p.grad for g, p in zip(grads, model.parameters())]
            if r == active[-1]:
                buffers_after = {k: v.clone() for k, v in model.named_buffers()}
        model.load_state_dict(start)
        for p, g in zip(model.parameters(), grads):
            p.grad = g / len(inputs)
        opt.step()
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers_after[name])
    return model


def buffers_of(model):
    return [b.detach().numpy().copy() for b in model.buffers()]


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["rank0_short", "three_plus_rank", "even"])
@pytest.mark.parametrize("when", ["periodic", "stop"])
def test_every_save_holds_the_buffers_the_active_ranks_hold(comm, tmp_path, pattern, when):
    """A periodic save (on_save) while a rank has joined, or a save after a stop, and the
    state after the Join, against the serial replay; the checkpoint loads the same buffers."""
    if pattern == "rank0_short":  # rank 0 has joined when the save runs
        inputs = [2 if r == 0 and comm.size > 1 else 6 for r in range(comm.size)]
    else:
        inputs = inputs_of(pattern, comm.size)
    directory = comm.bcast(str(tmp_path))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers(), update=opt.step)
    saves = []

    def save():
        path = os.path.join(directory, f"save-{len(saves)}")
        checkpoint.save(path, model.parameters(), buffers=model.buffers(), comm=comm)
        saves.append((join.iterations, path, buffers_of(model)))

    with Join([dp], on_save=save if when == "periodic" else None) as join:
        for t in range(inputs[comm.rank]):
            if join.stopped:
                break
            model.zero_grad()
            with dp.step():
                sse(model, *batch(comm.rank, t, n=2 + (comm.rank + t) % 3)).backward()
            if t == 2 and comm.rank == comm.size - 1:
                (request_save if when == "periodic" else request_stop)("test")
    if when == "stop":
        assert_all(join.stopped, "the Join did not stop")
        save()
        inputs = [min(n, join.iterations) for n in inputs]
    assert_all(len(saves) == 1, f"{len(saves)} saves")
    step, path, held = saves[0]
    expected = buffers_of(serial_plain(inputs, step))
    assert_all(not differences(held, expected), f"buffers held at the save at step {step}")
    loaded = Net()
    checkpoint.load(path, loaded.parameters(), buffers=loaded.buffers(), comm=comm)
    assert_all(not differences(buffers_of(loaded), expected), "buffers in the checkpoint")
    final = serial_plain(inputs, max(inputs))
    mine = [v.detach().numpy().copy() for v in model.state_dict().values()]
    assert_all(not differences(mine, [v.numpy() for v in final.state_dict().values()]),
               "the state after the Join")
    assert_all(same_everywhere(mine, comm), "the ranks hold different state after the Join")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["buffers", "optimizer"])
def test_a_save_refuses_buffers_or_optimizer_state_that_differ_between_ranks(comm, tmp_path,
                                                                              what):
    """The save's cross-rank digest covers buffers and the replicated optimizer state."""
    directory = comm.bcast(str(tmp_path))
    params, buffers = [np.zeros(3)], [np.full(2, float(comm.rank if what == "buffers" else 0))]
    dp = DataParallel(params, comm=comm)
    opt = Adam(params, dp.grads)
    if what == "optimizer":
        opt.state[0]["exp_avg"][...] = comm.rank
    with raises_everywhere(ValueError, match="different parameters, buffers or optimizer state"):
        checkpoint.save(directory, params, buffers=buffers, optimizer=opt, comm=comm)


# -- what a skeptical user tried ---------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["three_plus_rank", "rank0_zero"])
def test_joinable_comm_operations_in_update_and_on_save_are_collectives_of_every_rank(comm,
                                                                                     pattern):
    inputs = inputs_of(pattern, comm.size)
    jc = JoinableComm(comm)
    model = SyncBatchNorm.convert_sync_batchnorm(Net(), jc)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sums = []

    def update():
        opt.step()
        sums.append(float(jc.allreduce(np.ones(1))[0]))  # every rank runs update= here

    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers(), update=update)
    with Join([dp, jc], on_save=lambda: sums.append(float(jc.allreduce(np.ones(1))[0]))):
        for t in range(inputs[comm.rank]):
            model.zero_grad()
            with dp.step():
                sse(model, *batch(comm.rank, t, 0, sizes(inputs, t)[comm.rank])).backward()
            if t == 1 and comm.rank == comm.size - 1:
                request_save("test")
    saves = int(inputs[comm.size - 1] >= 2)  # the last rank asked after its second step
    assert_all(len(sums) == max(inputs) + saves and all(s == comm.size for s in sums),
               f"sums {sums}")


@pytest.mark.mpi(min_size=2)
def test_a_one_sample_batch_with_a_rank_joined_ends_the_join_with_its_error_everywhere(comm):
    jc, model, dp = sync_model(comm)
    with raises_everywhere(ValueError, match="more than 1 value per channel|ValueError"):
        with Join([dp, jc]):
            for t in range(1 if comm.rank == 0 else 2):
                model.zero_grad()
                with dp.step():
                    n = 3 if t == 0 else (1 if comm.rank == comm.size - 1 else 0)
                    sse(model, *batch(comm.rank, t, 0, n)).backward()


@pytest.mark.mpi
def test_converting_again_with_the_joinable_comm_sets_it_and_the_model_pickles(comm):
    import io

    jc = JoinableComm(comm)
    model = SyncBatchNorm.convert_sync_batchnorm(Net())  # as torch users write it first
    SyncBatchNorm.convert_sync_batchnorm(model, jc)
    assert_all(model.norm.process_group is jc)
    saved = io.BytesIO()
    torch.save(model, saved)  # a communicator is not pickled
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert_all(model.norm.process_group is jc and loaded.norm.process_group is None)
    SyncBatchNorm.convert_sync_batchnorm(loaded, jc)
    dp = DataParallel(loaded.parameters(), comm=comm, buffers=loaded.buffers())
    with Join([dp, jc]):
        with dp.step():
            sse(loaded, *batch(comm.rank, 0, 0, 3)).backward()
    assert_all(int(loaded.norm.num_batches_tracked) == 1)


@pytest.mark.mpi
def test_data_parallel_after_the_joinable_comm_names_the_order(comm):
    jc, model, dp = sync_model(comm)
    with raises_everywhere(RuntimeError, match="must be the first joinable"):
        with Join([jc, dp]):
            jc.begin_iteration()
            with dp.step():
                pass


@pytest.mark.mpi(min_size=2)
def test_a_layer_over_a_sub_communicator_inside_a_join_raises_instead_of_hanging(comm):
    sub = comm.Split(comm.rank % 2, comm.rank)
    layer = SyncBatchNorm(3, affine=False, process_group=sub).double()
    jc = JoinableComm(comm)
    with raises_everywhere(RuntimeError, match="plain communicator inside a running Join"):
        with Join([jc]):
            jc.begin_iteration()
            layer(torch.ones(4, 3, dtype=torch.float64))
    sub.Free()
