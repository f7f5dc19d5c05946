"""Gradient accumulation inside a Join: K micro-batches in one ``dp.step(micro_batches=K)``.

The one accumulation path that works with any optimizer and a rank joined: each step takes K
backward passes (K may differ per rank and step, a short last group say), autograd sums them
in ``p.grad``, and the bucket of a parameter starts after its K-th gradient (overlap on) or at
the step's end.  A stop requested between micro-batches lands at the step's end, which
synchronises, so nothing accumulated is lost.  Compared with a serial torch replay.
"""

import contextlib

import numpy as np
import pytest

from tensorplay_mpi import AdamW, DataParallel, Join, clear_stop, request_stop
from tensorplay_mpi.testing import assert_all, inputs_of

torch = pytest.importorskip("torch")

from torch_reference import Branchy, arrays, close, loss_of, same_everywhere, serial  # noqa: E402

K = 3


def short_last(inputs):
    """K micro-batches per step, but a rank's last step has only ``1 + rank % K``."""
    return lambda rank, t: 1 + rank % K if t == inputs[rank] - 1 else K


def torch_adamw(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    return opt.step


def accumulate(comm, model, dp, inputs, micro, steps=None, stop_at=None, after=None):
    """The loop: K backward passes inside each step; returns the steps done (a stop may end
    it early: `stop_at` = (rank, step, micro-batch) where that rank requests it)."""
    done = 0
    first = 0 if steps is None else steps
    with Join([dp] if after is None else [dp, after]) as join:
        for t in range(first, inputs[comm.rank]):
            if join.stopped:
                break
            model.zero_grad()
            k = micro(comm.rank, t)
            with dp.step(micro_batches=k):
                for m in range(k):
                    if stop_at == (comm.rank, t, m):
                        request_stop("test")
                    loss_of(model, comm.rank, t, m).backward()
            if after is not None:
                after.step()
            done = t + 1
    return done, join.stopped


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("optimizer", ["torch_update", "library_in_join"])
@pytest.mark.parametrize("pattern", ["three_plus_rank", "rank0_zero"])
def test_micro_batches_inside_one_step_match_serial_torch(comm, optimizer, overlap, pattern):
    inputs = inputs_of(pattern, comm.size)
    micro = short_last(inputs)
    model = Branchy()
    if optimizer == "torch_update":
        dp = DataParallel(model.parameters(), comm=comm, bucket_cap_mb=1e-4, overlap=overlap,
                          update=torch_adamw(model))
        opt = None
    else:
        dp = DataParallel(model.parameters(), comm=comm, bucket_cap_mb=1e-4, overlap=overlap)
        opt = AdamW(model.parameters(), dp.grads, lr=0.02, weight_decay=0.1)
    accumulate(comm, model, dp, inputs, micro, after=opt)
    expected = serial(torch_adamw, inputs, micro=micro)
    got = arrays(model)
    assert_all(same_everywhere(got, comm), "parameters differ between ranks")
    assert_all(not close(got, arrays(expected)), close(got, arrays(expected)))


@pytest.mark.mpi(min_size=1)
def test_a_stop_between_micro_batches_lands_at_the_step_end_and_resumes_bitwise(comm):
    """Rank 0 requests a stop in the middle of its step 1: the request rides in the next
    heartbeat (step 2's), so every rank finishes step 2 (averaged, updated) and leaves the
    Join at the top of step 3; a second Join from step 3 ends bitwise where a run never
    stopped ends."""
    inputs = inputs_of("three_plus_rank", comm.size)
    micro = short_last(inputs)

    def run(stop_at):
        model = Branchy()
        update = torch_adamw(model)
        dp = DataParallel(model.parameters(), comm=comm, update=update)
        done, stopped = accumulate(comm, model, dp, inputs, micro, stop_at=stop_at)
        clear_stop()
        if stopped:
            accumulate(comm, model, dp, inputs, micro, steps=done)
        return done, stopped, arrays(model)

    _, _, never_stopped = run(None)
    done, stopped, resumed = run((0, 1, 1))
    assert_all(stopped and done == 3, f"stopped={stopped} after {done} steps, expected 3")
    assert_all(all(np.array_equal(a, b) for a, b in zip(resumed, never_stopped)),
               "the resumed run differs from the run never stopped")
    assert_all(same_everywhere(resumed, comm), "parameters differ between ranks")


@pytest.mark.mpi(min_size=1)
def test_no_sync_over_steps_with_update_works_with_a_rank_joined(comm):
    """DDP's accumulation, K - 1 steps inside ``dp.no_sync()`` then one that synchronises:
    ``update`` runs on synchronising steps only, on joined ranks too."""
    inputs = inputs_of("three_plus_rank", comm.size)
    model = Branchy()
    dp = DataParallel(model.parameters(), comm=comm, update=torch_adamw(model))
    with Join([dp]):
        for t in range(inputs[comm.rank]):
            model.zero_grad()
            for m in range(K):
                with dp.no_sync() if m < K - 1 else contextlib.nullcontext():
                    with dp.step():
                        loss_of(model, comm.rank, t, m).backward()
    expected = serial(torch_adamw, inputs, micro=K)
    got = arrays(model)
    assert_all(same_everywhere(got, comm), "parameters differ between ranks")
    assert_all(not close(got, arrays(expected)), close(got, arrays(expected)))
