"""SyncBatchNorm under mpiexec: training on uneven inputs equals serial BatchNorm.

The reference replays every step serially with ``torch.nn.BatchNorm1d`` on the concatenation
of the active ranks' batches (float64): loss the sum of squared errors over that batch,
gradient divided by the world size, ``torch.optim.SGD``.  Batches include empty ones and single
samples.  Ranks that joined early hold the state they had then; a broadcast from a rank that
ran every step after the Join makes every rank equal to the reference.
"""

import contextlib

import numpy as np
import pytest

from tensorplay_mpi import DataParallel, Join, JoinableComm
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

torch = pytest.importorskip("torch")
from tensorplay_mpi.evaluation._sync_batchnorm import SyncBatchNorm  # noqa: E402  (needs torch)

PATTERNS = ["three_plus_rank", "rank0_zero", "last_zero", "even"]


class Net(torch.nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(1, 3, 3)
        self.norm = torch.nn.BatchNorm1d(3, momentum=momentum)
        self.linear = torch.nn.Linear(3 * 6, 2)
        self.norm2 = torch.nn.BatchNorm1d(2, momentum=momentum)
        self.double()

    def forward(self, x):
        return self.norm2(self.linear(torch.tanh(self.norm(self.conv(x))).flatten(1)))


def batch_sizes(inputs):
    """sizes[t][r]: rank r's batch size at step t (0 and 1 included; every step's total > 1)."""
    sizes = []
    for t in range(max(inputs, default=0)):
        active = [r for r in range(len(inputs)) if inputs[r] > t]
        row = {r: [0, 1, 3, 2][(r + t) % 4] if len(inputs) > 1 else 2 + t % 3 for r in active}
        if sum(row.values()) <= 1:
            row[active[-1]] = 3
        sizes.append(row)
    return sizes


def batch(rank, t, n):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return (torch.randn(n, 1, 8, generator=g, dtype=torch.float64) * 2 + 1,
            torch.randn(n, 2, generator=g, dtype=torch.float64))


def sse(model, x, y):
    return ((model(x) - y) ** 2).sum()


def reference(inputs, momentum):
    model = Net(momentum)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for t, row in enumerate(batch_sizes(inputs)):
        xs, ys = zip(*(batch(r, t, n) for r, n in row.items()))
        opt.zero_grad()
        sse(model, torch.cat(xs), torch.cat(ys)).backward()
        for p in model.parameters():
            p.grad /= len(inputs)
        opt.step()
    return model.state_dict()


@pytest.mark.mpi
@pytest.mark.parametrize("group", ["jc", "none"])  # none: the running Join's JoinableComm
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_training_on_uneven_inputs_equals_serial_batchnorm(comm, pattern, momentum, group):
    inputs = inputs_of(pattern, comm.size)
    sizes = batch_sizes(inputs)
    jc = JoinableComm(comm)
    model = SyncBatchNorm.convert_sync_batchnorm(Net(momentum), jc if group == "jc" else None)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    with Join([jc]):
        for t in range(inputs[comm.rank]):
            jc.begin_iteration()
            x, y = batch(comm.rank, t, sizes[t][comm.rank])
            opt.zero_grad()
            sse(model, x, y).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            jc.allreduce(flat, out=flat)
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.reshape(p.shape) / comm.size)
            opt.step()
    expected = reference(inputs, momentum)

    def differences():
        state = model.state_dict()
        return {k: float((state[k].double() - v.double()).abs().max()) for k, v in
                expected.items() if not torch.allclose(state[k].double(), v.double(),
                                                       rtol=1e-9, atol=1e-11)}

    last = max(inputs)
    if inputs[comm.rank] == last:  # ran every step: equal to the serial replay already
        assert_all(not differences(), f"after the Join: {differences()}")
    else:
        assert_all(True)
    root = max(r for r in range(comm.size) if inputs[r] == last)
    for tensor in model.state_dict().values():
        jc.bcast(tensor, root=root, out=tensor)
    assert_all(not differences(), f"after the broadcast: {differences()}")
    assert_all(type(model.norm) is SyncBatchNorm and int(model.norm.num_batches_tracked) == last)


@pytest.mark.mpi
def test_eval_mode_issues_no_collective_and_uses_running_stats(comm):
    model = SyncBatchNorm.convert_sync_batchnorm(Net(), comm).eval()
    reference = Net().eval()
    x = batch(comm.rank, 0, 1 + comm.rank)[0]  # ranks differ in size and none waits
    assert_all(torch.allclose(model(x), reference(x), rtol=1e-12, atol=0))


@pytest.mark.mpi
def test_a_global_batch_of_one_sample_raises_on_every_rank(comm):
    layer = SyncBatchNorm(3, process_group=comm).double()
    x = torch.ones(1 if comm.rank == 0 else 0, 3, dtype=torch.float64)
    with raises_everywhere(ValueError, match="more than 1 value per channel"):
        layer(x)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("through", ["communicator", "joinable_comm"])
def test_different_channel_counts_raise_on_every_rank(comm, affine, through):
    """Unchecked, the statistics of 3 channels were summed with those of 4: wrong numbers.
    Through a JoinableComm in a Join its announcement compares the lengths."""
    channels = 4 if comm.rank == comm.size - 1 else 3
    jc = JoinableComm(comm) if through == "joinable_comm" else None
    layer = SyncBatchNorm(channels, affine=affine, process_group=jc or comm).double()
    with raises_everywhere(ValueError, match="different numbers of channels"):
        with Join([jc]) if jc is not None else contextlib.nullcontext():
            if jc is not None:
                jc.begin_iteration()
            layer(torch.ones(4, channels, dtype=torch.float64))


OFFSETS = [0.01, -2.0]
"""The means of channels 1 and 2; channel 0's is the test's (far from zero: a variance from
the sums of the values and of their squares would lose digits)."""


def offset_batches(size, far, channels=3, length=5):
    """Every rank's batch (float64, sizes 2, 3, 4, ...: std 1 about the channels' means), and
    the same less the means: the batch that BatchNorm normalises the same way, mathematically,
    but that float64 holds without the means' rounding (the exact reference's)."""
    g = torch.Generator().manual_seed(7)
    offsets = torch.tensor([far, *OFFSETS], dtype=torch.float64)[:channels, None]
    centred = [torch.randn(2 + r, channels, length, generator=g, dtype=torch.float64)
               for r in range(size)]
    shifted = [x + offsets for x in centred]
    return shifted, [x - offsets for x in shifted]  # exact: x and the offset are close


def batchnorm_grads(xs, dtype, layer=None, first=0):
    """The output, the inputs' gradients and the weight's and bias's for the loss
    ``sum(y * (arange % 7))`` over the concatenated batch, with serial ``torch.nn.BatchNorm1d``
    in `dtype` (or `layer` on this rank's batch, whose `first` sample is the concatenation's:
    each rank's own part of the same loss)."""
    channels = xs[0].shape[1]
    serial = layer is None
    layer = torch.nn.BatchNorm1d(channels).to(dtype) if serial else layer
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 2.0, channels))
        layer.bias.copy_(torch.linspace(-1.0, 1.0, channels))
    xs = [x.detach().to(dtype).clone().requires_grad_() for x in xs]
    x = torch.cat(xs) if serial else xs[0]
    y = layer(x)
    start = first * y[0].numel()
    (y * torch.arange(start, start + y.numel()).reshape(y.shape).remainder(7)).sum().backward()
    return [t.detach().double() for t in (y, *(x.grad for x in xs), layer.weight.grad,
                                          layer.bias.grad)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("far", [300.0, 3e5])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_batchnorm_is_as_exact_as_serial_with_a_mean_far_from_zero(comm, dtype, far):
    """A layer in `dtype`, every rank's batch, a channel whose mean is `far` times its std: the
    output, the input gradient and the weight's and bias's (summed over the ranks, as
    DataParallel does) are within a few times serial BatchNorm's own error in that dtype of
    the float64 replay of the centred batch (BatchNorm's result does not change with a shift
    of a channel; float64 holds the centred batch without the mean's rounding)."""
    dtype = getattr(torch, dtype)
    xs, centred = offset_batches(comm.size, far)
    exact = batchnorm_grads(centred, torch.float64)
    serial = batchnorm_grads(xs, dtype)
    layer = SyncBatchNorm(3, process_group=comm).to(dtype)
    rows = [sum(len(x) for x in xs[:comm.rank]), sum(len(x) for x in xs[:comm.rank + 1])]
    mine = batchnorm_grads([xs[comm.rank]], dtype, layer, rows[0])
    summed = [torch.from_numpy(comm.allreduce(t.numpy())) for t in mine[2:]]
    ours = [mine[0], mine[1], *summed]
    theirs = [serial[0][rows[0]:rows[1]], serial[1 + comm.rank], *serial[-2:]]
    reference = [exact[0][rows[0]:rows[1]], exact[1 + comm.rank], *exact[-2:]]
    ulp = torch.finfo(dtype).eps
    worse = [(name, float((o - r).abs().max()), float((t - r).abs().max()))
             for name, o, t, r in zip(("output", "input grad", "weight grad", "bias grad"),
                                      ours, theirs, reference)
             if (o - r).abs().max() > 4 * (t - r).abs().max() + 4 * ulp * r.abs().max()]
    assert_all(not worse, f"(name, our error, serial {dtype}'s error): {worse}")


def test_convert_shares_parameters_and_state_and_keeps_the_rest():
    net = Net()
    net.norm.running_mean += 1
    net.eval()
    weight, running = net.norm.weight, net.norm.running_mean
    converted = SyncBatchNorm.convert_sync_batchnorm(net)
    assert converted is net and type(net.norm) is SyncBatchNorm and type(net.norm2) is SyncBatchNorm
    assert net.norm.weight is weight and net.norm.running_mean is running
    assert not net.norm.training and isinstance(net.conv, torch.nn.Conv1d)
    with pytest.raises(ValueError, match="at least 2D"):
        net.norm(torch.ones(3, dtype=torch.float64))
    assert np.isclose(float(net.norm.running_mean[0]), 1.0)


# -- micro-batches: dp.step(micro_batches=K) ---------------------------------------------------

def train_micro_batches(comm, steps, real, size_of, micro_batches, natural=False):
    """Train the Net with DataParallel in one Join: rank r runs `steps[r]` steps, in step t
    `real(r, t)` micro-batches of `size_of(r, m)` samples, entered as
    ``dp.step(micro_batches=micro_batches(r, t))`` (any more of them empty).  `natural`: the
    model converted without a group, ``Join([dp])``; else with a JoinableComm, ``Join([dp,
    jc])``."""
    jc = None if natural else JoinableComm(comm)
    model = SyncBatchNorm.convert_sync_batchnorm(Net(), jc)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers(), update=opt.step)
    with Join([dp] if natural else [dp, jc]):
        for t in range(steps[comm.rank]):
            k = micro_batches(comm.rank, t)
            model.zero_grad()
            with dp.step(micro_batches=k):
                for m in range(k):
                    n = size_of(comm.rank, m) if m < real(comm.rank, t) else 0
                    sse(model, *batch(comm.rank, 100 * t + m, n)).backward()
    return model


def micro_batch_mismatch(comm, steps, natural):
    """Every rank's step 1 with 2 micro-batches, but the last rank's with 3."""
    last = comm.size - 1
    return train_micro_batches(comm, steps, lambda r, t: 3 if (r, t) == (last, 1) else 2,
                               lambda r, m: 2, lambda r, t: 3 if (r, t) == (last, 1) else 2,
                               natural)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("natural", [False, True])
def test_micro_batches_that_differ_between_ranks_raise_on_every_rank(comm, natural):
    """Issue 47: the short rank's gradient buckets were matched against the other's third
    statistics ("different numbers of channels"), and the job aborted at exit."""
    with raises_everywhere(ValueError, match="different numbers of micro-batches"):
        micro_batch_mismatch(comm, [2] * comm.size, natural)
    total = JoinableComm(comm).allreduce(np.ones(1))  # nothing started, nothing pending
    assert_all(total[0] == comm.size)


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("natural", [False, True])
def test_micro_batches_that_differ_with_a_rank_joined_raise_on_every_rank(comm, natural):
    """Rank 0 has joined: it learns the active ranks' refusal from their announcement."""
    with raises_everywhere(ValueError, match="different numbers of micro-batches|ValueError"):
        micro_batch_mismatch(comm, [1] + [2] * (comm.size - 1), natural)
    total = JoinableComm(comm).allreduce(np.ones(1))
    assert_all(total[0] == comm.size)


def real_micro_batches(r, t):
    return 1 + (r + t) % 2


def micro_sizes(r, m):
    return 2 + (r + m) % 3


@pytest.mark.mpi
@pytest.mark.parametrize("natural", [False, True])
@pytest.mark.parametrize("pattern", ["even", "three_plus_rank"])
def test_a_rank_with_fewer_micro_batches_runs_empty_ones_as_serial_batchnorm(comm, pattern,
                                                                             natural):
    """The documented remedy: K is the largest number of micro-batches of the step, and a rank
    with fewer runs empty ones; equal to serial BatchNorm on each micro-batch's union."""
    inputs = inputs_of(pattern, comm.size)

    def most(t):
        return max(real_micro_batches(r, t) for r in range(comm.size) if inputs[r] > t)

    model = train_micro_batches(comm, inputs, real_micro_batches, micro_sizes,
                                lambda r, t: most(t), natural)
    reference = Net()
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for t in range(max(inputs)):
        opt.zero_grad()
        for m in range(most(t)):
            xs, ys = zip(*(batch(r, 100 * t + m, micro_sizes(r, m)) for r in range(comm.size)
                           if inputs[r] > t and real_micro_batches(r, t) > m))
            sse(reference, torch.cat(xs), torch.cat(ys)).backward()
        for p in reference.parameters():
            p.grad /= comm.size
        opt.step()
    expected, state = reference.state_dict(), model.state_dict()
    off = {k: float((state[k].double() - v.double()).abs().max()) for k, v in expected.items()
           if not torch.allclose(state[k].double(), v.double(), rtol=1e-9, atol=1e-11)}
    assert_all(not off, f"off the serial replay: {off}")
