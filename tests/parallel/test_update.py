"""``DataParallel(..., update=fn)``: any optimizer, scheduler and clipping, exact under a Join;
and an exception inside ``fn`` on one rank ends every rank, fast.

``fn`` runs on every rank once per synchronising step, on a joined rank in its shadow, so
torch.optim optimizers and schedulers advance on every rank with the same averaged gradients:
parameters, optimizer state and scheduler state stay bitwise identical on every rank and
equal a serial replay of the global batches (the tests under mpiexec, below).

tests/programs/update_failure.py makes rank 0 raise in its update while active, or while
joined (in its shadow of a step); under mpiexec with a hard timeout, rank 0 reports its own
ValueError and every other rank a PeerFailureError naming it, never a hang (the serial tests,
which launch it).
"""

import re
import time

import numpy as np
import pytest
from helpers import PROGRAMS

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere, run_mpi

torch = pytest.importorskip("torch")  # every test here: the program too

from torch_reference import (Branchy, adamw_onecycle_clip, arrays, close, loss_of,  # noqa: E402
                             same_everywhere, serial)

PROGRAM = str(PROGRAMS / "update_failure.py")


@pytest.mark.parametrize("where", ["active", "joined"])
@pytest.mark.parametrize("nprocs", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_an_exception_in_update_raises_on_every_rank(nprocs, where):
    start = time.monotonic()
    result = run_mpi(nprocs, [PROGRAM, where], timeout=60)
    elapsed = time.monotonic() - start
    outcomes = dict(re.findall(r"RESULT rank=(\d+) (.*)", result.stdout))
    context = (elapsed, result.stdout, result.stderr[-3000:])
    assert result.returncode != 0 and elapsed < 30, context
    assert outcomes.get("0") == f"ValueError: update failed on purpose ({where})", context
    for rank in range(1, nprocs):
        assert outcomes.get(str(rank), "").startswith(
            f"PeerFailureError: rank {rank}: rank 0 failed with ValueError"), context


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------

STEPS = 8  # the most steps of any rank in these tests (OneCycleLR's total)


def rmsprop_lambda(model):
    opt = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    def update():
        opt.step()
        sched.step()
    return update, opt, sched


def adagrad(model):
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    return opt.step, opt, None


RECIPES = {"adamw_onecycle_clip": lambda model: adamw_onecycle_clip(model, STEPS),
           "rmsprop_lambda": rmsprop_lambda,
           "adagrad": adagrad}


def state_arrays(opt, sched):
    """The optimizer's and scheduler's state as arrays, for the cross-rank comparison."""
    out = [t.detach().numpy().reshape(-1) for s in opt.state.values() for t in s.values()
           if torch.is_tensor(t)]
    out.append(np.array([g["lr"] for g in opt.param_groups]))
    if sched is not None:
        out.append(np.array([sched.last_epoch], dtype=np.float64))
    return out


def patterns(size):
    """Uneven inputs of at most STEPS steps, a rank with none included."""
    return [[min(STEPS, n) for n in inputs_of(p, size)]
            for p in ("three_plus_rank", "rank0_zero", "last_zero")] + [[STEPS] * size]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_any_torch_optimizer_scheduler_and_clip_through_update_is_exact(comm, recipe, overlap):
    for inputs in patterns(comm.size):
        model = Branchy()
        update, opt, sched = RECIPES[recipe](model)
        dp = DataParallel(model.parameters(), comm=comm, bucket_cap_mb=1e-4, overlap=overlap,
                          update=update)
        with Join([dp]):
            for t in range(inputs[comm.rank]):
                model.zero_grad()
                with dp.step():
                    loss_of(model, comm.rank, t).backward()
        expected = serial(lambda m: RECIPES[recipe](m)[0], inputs)
        got = arrays(model)
        assert_all(same_everywhere(got + state_arrays(opt, sched), comm),
                   f"{inputs}: parameters or optimizer/scheduler state differ between ranks")
        assert_all(not close(got, arrays(expected)), f"{inputs}: {close(got, arrays(expected))}")


@pytest.mark.mpi(min_size=1)
def test_numpy_update_code_runs_once_per_step_on_every_rank(comm):
    """Plain NumPy SGD with a step counter in ``update``: the closed form of the global steps."""
    inputs = inputs_of("three_plus_rank", comm.size)
    params = [np.zeros(3), np.ones((2, 2))]
    calls = []

    def update():
        calls.append(1)
        for p, g in zip(params, dp.grads):
            p -= 0.5 * g

    dp = DataParallel(params, comm=comm, update=update)
    with Join([dp]):
        for t in range(inputs[comm.rank]):
            with dp.step():
                for g in dp.grads:
                    g[...] = comm.rank + t
    expected = [np.zeros(3), np.ones((2, 2))]
    for t in range(max(inputs)):
        mean = sum(r + t for r in range(comm.size) if inputs[r] > t) / comm.size
        for e in expected:
            e -= 0.5 * mean
    assert_all(len(calls) == max(inputs), f"update ran {len(calls)} times, not {max(inputs)}")
    assert_all(all(np.allclose(p, e, rtol=1e-14, atol=0) for p, e in zip(params, expected)),
               f"got {params}, expected {expected}")


@pytest.mark.mpi(min_size=1)
def test_update_must_be_callable(comm):
    with raises_everywhere(TypeError, match="update must be a callable"):
        DataParallel([np.zeros(2)], comm=comm, update=3)
