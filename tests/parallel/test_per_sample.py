"""dp.step(samples=n): the gradient of the mean loss over the union of the active ranks'
batches, whatever their sizes, against serial torch on the concatenated batch (with
SyncBatchNorm: serial torch BatchNorm1d on it)."""

import pytest

from tensorplay_mpi import DataParallel, Join, JoinableComm
from tensorplay_mpi.errors import PeerFailureError
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

torch = pytest.importorskip("torch")
from torch_reference import Branchy, arrays, close, same_everywhere  # noqa: E402

from tensorplay_mpi.evaluation._sync_batchnorm import SyncBatchNorm  # noqa: E402  (needs torch)


def batch(rank, t):
    """Rank `rank`'s batch at step `t`: 1 to 5 samples, or none."""
    n = (3 * rank + t) % 6
    g = torch.Generator().manual_seed(100 * rank + t)
    return (torch.randn(n, 6, generator=g, dtype=torch.float64),
            torch.randn(n, 3, generator=g, dtype=torch.float64))


def mean_loss(model, x, y):
    return ((model(x) - y) ** 2).sum(dim=1).mean() if len(x) else model(x).sum() * 0


def serial(inputs):
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(max(inputs)):
        xs, ys = zip(*(batch(r, t) for r in range(len(inputs)) if inputs[r] > t))
        x, y = torch.cat(xs), torch.cat(ys)
        opt.zero_grad()
        if len(x):
            mean_loss(model, x, y).backward()
            opt.step()
    return model


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["three_plus_rank", "rank0_zero", "even"])
def test_a_per_sample_mean_equals_the_serial_mean_over_the_union(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    dp = DataParallel(model.parameters(), comm=comm, update=lambda: (opt.step(),
                                                                    seen.append(dp.samples)))
    with Join([dp]):
        for t in range(inputs[comm.rank]):
            x, y = batch(comm.rank, t)
            model.zero_grad()
            with dp.step(samples=len(x)):
                mean_loss(model, x, y).backward()
    union = [sum(len(batch(r, t)[0]) for r in range(comm.size) if inputs[r] > t)
             for t in range(max(inputs))]
    assert_all(seen == union, f"dp.samples {seen}, the union's sizes {union}")
    expected = arrays(serial(inputs))
    assert_all(not close(arrays(model), expected), close(arrays(model), expected))
    assert_all(same_everywhere(arrays(model), comm), "the ranks differ")


@pytest.mark.mpi(min_size=2)
def test_samples_on_some_ranks_only_raise_on_every_rank(comm):
    model = Branchy()
    dp = DataParallel(model.parameters(), comm=comm)
    x, y = batch(1, 1)
    with raises_everywhere((RuntimeError, PeerFailureError), match="samples="):
        with Join([dp]):
            with dp.step(samples=len(x) if comm.rank == 0 else None):
                mean_loss(model, x, y).backward()


# -- with SyncBatchNorm: its backward mixes the ranks' gradients ------------------------------

class Normed(torch.nn.Module):
    """Linear - BatchNorm1d - tanh - Linear, float64 (converted to SyncBatchNorm on ranks)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 5)
        self.norm = torch.nn.BatchNorm1d(5)
        self.head = torch.nn.Linear(5, 3)
        self.double()

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.first(x))))


def normed_sizes(inputs, t, m):
    """{rank: its micro-batch `m` at step `t`} over the ranks active at `t`: 3 and 7 at two
    ranks first (the reported case), empty ones too, at least 2 samples in all."""
    row = {r: [3, 7, 0, 5, 2][(r + t + 2 * m) % 5] for r in range(len(inputs)) if inputs[r] > t}
    if sum(row.values()) <= 1:
        row[max(row)] = 3
    return row


def normed_batch(rank, t, m, n):
    g = torch.Generator().manual_seed(10_000 * rank + 100 * t + m)
    return (torch.randn(n, 6, generator=g, dtype=torch.float64) * 2 + 1,
            torch.randn(n, 3, generator=g, dtype=torch.float64))


def sse(model, x, y):
    return ((model(x) - y) ** 2).sum()


def serial_normed(inputs, micro):
    """Every step's gradient of the mean loss over the union of the active ranks' samples
    (serial torch BatchNorm1d on each micro-batch's concatenation), then SGD."""
    model = Normed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for t in range(max(inputs)):
        rows = [normed_sizes(inputs, t, m) for m in range(micro)]
        union = sum(sum(row.values()) for row in rows)
        opt.zero_grad()
        for m, row in enumerate(rows):
            xs, ys = zip(*(normed_batch(r, t, m, n) for r, n in row.items()))
            (sse(model, torch.cat(xs), torch.cat(ys)) / union).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


@pytest.mark.mpi
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("pattern", ["even", "three_plus_rank", "rank0_zero"])
def test_a_per_sample_mean_through_sync_batchnorm_equals_serial_batchnorm(comm, pattern, micro):
    """Issue 47: batches of 3 and 7 at 2 ranks gave a gradient 0.4-0.5 off, silently."""
    inputs = inputs_of(pattern, comm.size)
    jc = JoinableComm(comm)
    model = SyncBatchNorm.convert_sync_batchnorm(Normed(), jc)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []

    def update():
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()

    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers(), update=update)
    with Join([dp, jc]):
        for t in range(inputs[comm.rank]):
            sizes = [normed_sizes(inputs, t, m)[comm.rank] for m in range(micro)]
            model.zero_grad()
            with dp.step(samples=sum(sizes), micro_batches=micro):
                for m, n in enumerate(sizes):
                    (sse(model, *normed_batch(comm.rank, t, m, n)) / max(sum(sizes), 1)
                     ).backward()
    expected = serial_normed(inputs, micro)
    off = [(t, float(max((g - e).abs().max() for g, e in zip(mine, theirs))))
           for t, (mine, theirs) in enumerate(zip(grads, expected))
           if not all(torch.allclose(g, e, rtol=1e-10, atol=1e-10) for g, e in zip(mine, theirs))]
    assert_all(len(grads) == len(expected) and not off,
               f"{len(grads)} steps of {len(expected)}; (step, largest difference): {off}")
    assert_all(same_everywhere(arrays(model), comm), "the ranks differ")


@pytest.mark.mpi(min_size=2)
def test_samples_zero_with_a_non_empty_sync_batchnorm_batch_raise_on_every_rank(comm):
    """That rank's inputs move the union's statistics, but its gradient is weighted by zero:
    no per-sample weighting can be exact, so it is refused, never a wrong gradient."""
    jc = JoinableComm(comm)
    model = SyncBatchNorm.convert_sync_batchnorm(Normed(), jc)
    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers())
    x, y = normed_batch(comm.rank, 0, 0, 3)
    with raises_everywhere(ValueError, match=r"samples=0.*non-empty batch"):
        with Join([dp, jc]):
            with dp.step(samples=0 if comm.rank == 0 else 3):
                sse(model, x, y).backward()
    total = JoinableComm(comm).allreduce(torch.ones(1, dtype=torch.float64))
    assert_all(float(total[0]) == comm.size)
