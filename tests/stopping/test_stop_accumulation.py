"""A stop or a periodic save requested during ``dp.no_sync()`` accumulation lands at the next
synchronising step by itself: the natural loop (``join.stopped`` checked every iteration)
resumes bitwise to the run never stopped, both equal a serial torch.optim replay of the same
groups, and a periodic save never holds half a group."""

import copy

import pytest

from tensorplay_mpi import DataParallel, Join, clear_stop, request_save, request_stop
from tensorplay_mpi.testing import assert_all, inputs_of

torch = pytest.importorskip("torch")
from torch_reference import Branchy, arrays, close, loss_of, same_everywhere  # noqa: E402

GROUP = 2  # micro-steps per synchronising step: GROUP - 1 under no_sync(), then one that syncs


def serial(inputs):
    """One model: each group sums the micro-batches of every rank active in it, divided by the
    world size, then AdamW steps (what no_sync accumulation and the synchronising step do)."""
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    for t in range(max(inputs)):
        model.zero_grad(set_to_none=True)
        for rank in range(len(inputs)):
            if inputs[rank] > t:
                for m in range(GROUP):
                    loss_of(model, rank, GROUP * t + m).backward()
        for p in model.parameters():
            p.grad /= len(inputs)
        opt.step()
    return model


def make(comm, state=None):
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    if state is not None:
        model.load_state_dict(state[0])
        opt.load_state_dict(state[1])
    return model, opt, DataParallel(model.parameters(), comm=comm, update=opt.step)


def train(comm, inputs, model, dp, start=0, stop_at=None, save_at=None, on_save=None,
          joins=None):
    """Micro-steps `start`.. of this rank (`inputs[rank]` groups of GROUP); returns the cursor
    where the loop left and the Join (also appended to `joins` once entered)."""
    cursor = start
    with Join([dp], on_save=on_save) as join:
        if joins is not None:
            joins.append(join)
        for i in range(start, GROUP * inputs[comm.rank]):
            if join.stopped:
                break
            if i % GROUP == 0:
                model.zero_grad()
            sync = i % GROUP == GROUP - 1
            with dp.step() if sync else _no_sync_step(dp):
                loss_of(model, comm.rank, i).backward()
            cursor = i + 1
            if i == stop_at and comm.rank == comm.size - 1:
                request_stop("test")
            if i == save_at and comm.rank == comm.size - 1:
                request_save("test")
    return cursor, join


class _no_sync_step:
    def __init__(self, dp):
        self.outer, self.inner = dp.no_sync(), None
        self.dp = dp

    def __enter__(self):
        self.outer.__enter__()
        self.inner = self.dp.step()
        return self.inner.__enter__()

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        return self.outer.__exit__(*exc)


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["even", "three_plus_rank"])
def test_a_stop_during_accumulation_lands_at_the_next_synchronising_step(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    model, opt, dp = make(comm)
    train(comm, inputs, model, dp)
    reference = arrays(model)
    expected = arrays(serial(inputs))
    assert_all(not close(reference, expected), f"never stopped: {close(reference, expected)}")

    model, opt, dp = make(comm)
    cursor, join = train(comm, inputs, model, dp, stop_at=GROUP - 1)  # rides a no_sync step
    assert_all(join.stopped, "the Join did not stop")
    assert_all(cursor % GROUP == 0, f"stopped inside a group, at micro-step {cursor}")
    state = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    del dp
    clear_stop()  # served: a stopped job exits, and the resumed one starts without it
    model, opt, dp = make(comm, state)
    cursor, join = train(comm, inputs, model, dp, start=cursor)
    assert_all(not join.stopped and cursor == GROUP * inputs[comm.rank])
    assert_all(all((a == b).all() for a, b in zip(arrays(model), reference)),
               "the resumed run differs from the run never stopped")
    assert_all(same_everywhere(arrays(model), comm), "the ranks differ")


@pytest.mark.mpi
def test_a_periodic_save_during_accumulation_waits_for_the_synchronising_step(comm):
    inputs = inputs_of("three_plus_rank", comm.size)
    model, opt, dp = make(comm)
    joins, seen = [], []

    def on_save():
        seen.append((joins[0].iterations, dp.defers_requests()))

    train(comm, inputs, model, dp, save_at=GROUP - 1, on_save=on_save, joins=joins)
    assert_all(len(seen) == 1 and seen[0][0] % GROUP == 0 and not seen[0][1],
               f"saves at (micro-step, accumulating): {seen}")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["three_plus_rank", "rank0_zero"])
def test_dp_steps_is_the_same_on_every_rank_in_on_save_and_across_joins(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    model, opt, dp = make(comm)
    dp.steps = 100  # as after a resume
    seen, joins = [], []
    for _ in range(2):
        with Join([dp], on_save=lambda: seen.append((dp.steps, joins[-1].iterations))) as join:
            joins.append(join)
            for i in range(inputs[comm.rank]):
                with dp.step():
                    loss_of(model, comm.rank, i).backward()
                if i == 1 and comm.rank == comm.size - 1:
                    request_save("test")
    every = comm.allgather(seen)
    bases = [100, 100 + max(inputs)]
    assert_all(all(s == every[0] for s in every) and len(seen) == 2 * (inputs[-1] >= 2)
               and all(steps == base + iterations
                       for (steps, iterations), base in zip(seen, bases))
               and dp.steps == 100 + 2 * max(inputs),
               f"(steps, iterations) in on_save by rank: {every}")
