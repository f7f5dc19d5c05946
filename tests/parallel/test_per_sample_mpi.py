"""dp.step(samples=n): the gradient of the mean loss over the union of the active ranks'
batches, whatever their sizes, against serial torch on the concatenated batch."""

import pytest

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.errors import PeerFailureError
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

torch = pytest.importorskip("torch")
from torch_reference import Branchy, arrays, close, same_everywhere  # noqa: E402


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
