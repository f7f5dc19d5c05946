"""PyTorch CPU models under mpiexec: the torch user's loop against serial torch.optim.

The loop is the one torch users write: ``model.zero_grad()``, ``with dp.step():
loss.backward()``, ``opt.step()``, under ``Join([dp, opt])``, with uneven numbers of batches.
The reference replays the same global steps serially with torch.optim on one model: at step t
the gradient is the sum of the active ranks' batch gradients divided by the world size.
"""

import numpy as np
import pytest
from helpers import UNEVEN, gathered_equal
from mpi4py import MPI

from tensorplay_mpi import (SGD, Adam, AdamW, DataParallel, Join, JoinableComm,
                            ZeroRedundancyOptimizer)
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

torch = pytest.importorskip("torch")

OPTIMIZERS = {  # ours, torch's, hyperparameters
    "sgd_momentum": (SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (Adam, torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
    "adamw": (AdamW, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
}


class Net(torch.nn.Module):
    """A small conv + linear model (float64, so that only the summation order differs)."""

    def __init__(self, batch_norm=False):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(1, 3, 3)
        self.norm = torch.nn.BatchNorm1d(3) if batch_norm else torch.nn.Identity()
        self.linear = torch.nn.Linear(3 * 6, 2)
        self.double()

    def forward(self, x):
        return self.linear(torch.tanh(self.norm(self.conv(x))).flatten(1))


def batch(rank, t):
    """Rank `rank`'s batch number `t`: the same everywhere it is computed."""
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(4, 1, 8, generator=g, dtype=torch.float64), \
        torch.randn(4, 2, generator=g, dtype=torch.float64)


def loss_of(model, rank, t):
    x, y = batch(rank, t)
    return torch.nn.functional.mse_loss(model(x), y)


def reference(kind, inputs):
    """The global steps serially, with torch.optim: parameters as NumPy arrays."""
    model = Net()
    opt = OPTIMIZERS[kind][1](model.parameters(), **OPTIMIZERS[kind][2])
    for t in range(max(inputs, default=0)):
        opt.zero_grad()
        for rank in (r for r in range(len(inputs)) if inputs[r] > t):
            loss_of(model, rank, t).backward()
        for p in model.parameters():
            p.grad /= len(inputs)
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def train(comm, make_opt, inputs, zero_grad="before", overlap=True, model=None):
    """The torch user's loop; `zero_grad`: where model.zero_grad() is called."""
    model = Net() if model is None else model
    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers(), overlap=overlap,
                      bucket_cap_mb=1e-4)  # several buckets: mark_ready starts them early
    opt = make_opt(model, dp)
    with Join([dp, opt]):
        for t in range(inputs[comm.rank]):
            if zero_grad == "before":
                model.zero_grad()
            with dp.step():
                if zero_grad == "inside":
                    model.zero_grad()
                loss_of(model, comm.rank, t).backward()
            opt.step()
    return model, dp


def local(kind):
    ours, _, hyper = OPTIMIZERS[kind]
    return lambda model, dp: ours(model.parameters(), dp.grads, **hyper)


def close_to(model, expected):
    return all(np.allclose(p.detach().numpy(), e, rtol=1e-12, atol=1e-13)
               for p, e in zip(model.parameters(), expected))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pattern", UNEVEN + ["even"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_the_torch_loop_matches_serial_torch_optim(comm, kind, pattern):
    inputs = inputs_of(pattern, comm.size)
    model, _ = train(comm, local(kind), inputs)
    params = [p.detach().numpy() for p in model.parameters()]
    assert_all(gathered_equal(params, comm), "parameters differ between ranks")
    assert_all(close_to(model, reference(kind, inputs)), "not torch.optim's result")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("zero_grad", ["before", "inside", "never"])
def test_zero_grad_anywhere_keeps_the_gradients_bound(comm, zero_grad, overlap):
    """set_to_none unbinds p.grad; the library re-binds it, so nothing diverges silently.

    Without zero_grad, gradients accumulate over steps, as in torch: the reference then
    never zeroes either (with even inputs: a joined rank's hook contributes zeros, not its
    accumulated gradient, as DDP's does)."""
    inputs = inputs_of("even" if zero_grad == "never" else "three_plus_rank", comm.size)
    model, dp = train(comm, local("adam"), inputs, zero_grad, overlap)
    if zero_grad == "never":
        expected = reference_accumulating(inputs)
    else:
        expected = reference("adam", inputs)
    assert_all(close_to(model, expected), "not torch.optim's result")
    assert_all(all(p.grad is g for p, g in zip(model.parameters(), dp.grads)),
               "p.grad is not bound to dp.grads after the Join")


def reference_accumulating(inputs):
    """As :func:`reference` for Adam, never zeroing: each step's average adds to the last."""
    model = Net()
    opt = torch.optim.Adam(model.parameters(), **OPTIMIZERS["adam"][2])
    total = [torch.zeros_like(p) for p in model.parameters()]
    for t in range(max(inputs)):
        opt.zero_grad()
        for rank in (r for r in range(len(inputs)) if inputs[r] > t):
            loss_of(model, rank, t).backward()
        for p, s in zip(model.parameters(), total):
            s += p.grad / len(inputs)
            p.grad.copy_(s)
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pattern", UNEVEN)
def test_zero_with_torch_parameters_matches_serial_torch_adam(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    model, _ = train(comm, lambda model, dp: ZeroRedundancyOptimizer(
        model.parameters(), dp.grads, Adam, **OPTIMIZERS["adam"][2]), inputs)
    assert_all(close_to(model, reference("adam", inputs)), "not torch.optim's result")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pattern", UNEVEN + ["even"])
def test_batch_norm_statistics_are_broadcast_like_ddp(comm, pattern):
    """Buffers come from the highest active rank at each step and from the highest last
    joiner at the end: every rank ends with the running statistics of the rank with the most
    steps, whose counter is that number of steps."""
    inputs = inputs_of(pattern, comm.size)
    model, _ = train(comm, local("sgd_momentum"), inputs, model=Net(batch_norm=True))
    buffers = [b.numpy() for b in model.buffers()]
    assert_all(gathered_equal(buffers, comm), "buffers differ between ranks")
    assert_all(int(model.norm.num_batches_tracked) == max(inputs),
               f"{int(model.norm.num_batches_tracked)} batches tracked, not {max(inputs)}")


@pytest.mark.mpi(min_size=1)
def test_two_backward_passes_in_one_step_raise_on_every_rank(comm):
    model = Net()
    dp = DataParallel(model.parameters(), comm=comm)

    with raises_everywhere(RuntimeError, match="more gradients in one dp.step.*micro_batches=K"):
        with dp.step():
            loss_of(model, comm.rank, 0).backward()
            loss_of(model, comm.rank, 1).backward()
    with dp.no_sync():  # without averaging, two backward passes accumulate
        with dp.step():
            loss_of(model, comm.rank, 0).backward()
            loss_of(model, comm.rank, 1).backward()
    with dp.step():  # and the communicator is still usable
        loss_of(model, comm.rank, 2).backward()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pattern", UNEVEN)
def test_joinable_comm_takes_torch_tensors_and_returns_them(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    jc = JoinableComm(comm)
    ok = True
    with Join([jc]):
        for t in range(inputs[comm.rank]):
            jc.begin_iteration()
            active = [r for r in range(comm.size) if inputs[r] > t]
            total = jc.allreduce(torch.full((3,), float(comm.rank + 1)))
            small = jc.allreduce(torch.tensor([comm.rank]), op=MPI.MAX)
            rows = jc.allgather(torch.full((comm.rank + 1, 2), comm.rank))
            root = jc.bcast(torch.arange(100) + comm.rank)
            ok &= isinstance(total, torch.Tensor) and isinstance(rows, torch.Tensor)
            ok &= total.tolist() == [float(sum(r + 1 for r in active))] * 3
            ok &= small.item() == max(active)
            ok &= rows[:, 0].tolist() == [r for r in active for _ in range(r + 1)]
            ok &= root.tolist() == (torch.arange(100) + max(active)).tolist()
    assert_all(ok, "a JoinableComm result on torch tensors is wrong")
