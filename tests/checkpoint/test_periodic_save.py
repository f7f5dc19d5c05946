"""Periodic checkpoints inside a Join under mpiexec: every rank, joined or not, saves at one
iteration; the saved state is the closed form's; a resume from any save is bitwise the run
never stopped; a save or load where it cannot work raises on every rank before any collective.
And a periodic save done wrong in a program launched under mpiexec (the serial tests): errors on
every rank, never a hang, and the previous checkpoint whole."""

import os
import re

import numpy as np
import pytest
from helpers import PROGRAMS

from tensorplay_mpi import (SGD, DataParallel, Join, JoinableComm, checkpoint, clear_save,
                            request_save, request_stop, save_requested)
from tensorplay_mpi.testing import assert_all, raises_everywhere, run_mpi

MISUSE = str(PROGRAMS / "misuse.py")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_save_inside_a_join_with_a_joined_rank_fails_on_every_rank(tmp_path, nprocs):
    directory = str(tmp_path)
    checkpoint.save(directory, [np.arange(4.0)])  # the previous checkpoint (one rank)
    before = (tmp_path / checkpoint.MANIFEST).read_bytes()
    result = run_mpi(nprocs, [MISUSE, "save_inside", directory], timeout=90,
                     TENSORPLAY_MPI_GRACE="3")
    outcomes = dict(re.findall(r"RESULT rank=(\d+) (.*?)(?=RESULT rank=|$)", result.stdout,
                               re.M))
    assert result.returncode != 0 and len(outcomes) == nprocs, (result.stdout, result.stderr)
    assert outcomes["0"].startswith("PeerFailureError: rank 0: rank "), outcomes
    for rank in range(1, nprocs):
        assert outcomes[str(rank)].startswith(f"RuntimeError: rank {rank}: checkpoint.save was "
                                              "called inside a running Join"), outcomes
    assert (tmp_path / checkpoint.MANIFEST).read_bytes() == before
    assert sorted(os.listdir(directory)) == [checkpoint.MANIFEST]


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------

LR, MOMENTUM = 0.1, 0.5
SHAPES = [(3,), (2,)]
INPUTS = {
    "growing": lambda r, size: 5 + 3 * r,
    "rank0_none": lambda r, size: 0 if r == 0 < size - 1 else 5 + 3 * r,
}


def grads_at(rank, i):
    """Rank `rank`'s gradients at its input `i`: a closed form."""
    return [np.full(shape, float(rank + i + k)) for k, shape in enumerate(SHAPES)]


def serial(inputs, steps):
    """The parameters after `steps` iterations, serially: SGD with momentum on the gradients
    summed over the ranks active in each iteration, divided by the world size."""
    size = len(inputs)
    params = [np.zeros(shape) for shape in SHAPES]
    buffers = [np.zeros(shape) for shape in SHAPES]
    for i in range(steps):
        active = [r for r in range(size) if inputs[r] > i]
        for k in range(len(SHAPES)):
            g = sum(grads_at(r, i)[k] for r in active) / size
            buffers[k] = MOMENTUM * buffers[k] + g
            params[k] = params[k] - LR * buffers[k]
    return params


def train(comm, inputs, directory=None, resume_from=None, every=0):
    """The uneven loop; with `every`, the longest rank asks for a save after each `every` of
    its iterations and the Join's on_save writes ``directory/save-N``.  Returns the parameters
    and the saves as (iterations, cursor, parameters at the save)."""
    params = [np.zeros(shape) for shape in SHAPES]
    dp = DataParallel(params, comm=comm, bucket_cap_mb=16 / 2**20)
    opt = SGD(params, dp.grads, lr=LR, momentum=MOMENTUM)
    done, base = 0, 0
    if resume_from is not None:
        resumed = checkpoint.load(resume_from, params, optimizer=opt, comm=comm)
        done, base = resumed.cursor, resumed.step
    saves = []
    requester = int(np.argmax(inputs))

    def on_save():
        step = base + join.iterations
        checkpoint.save(os.path.join(directory, f"save-{len(saves)}"), params, optimizer=opt,
                        step=step, cursor=done, comm=comm)
        saves.append((step, done, [p.copy() for p in params]))

    with Join([dp, opt], on_save=on_save if every else None) as join:
        for i in range(done, inputs[comm.rank]):
            with dp.step():
                for grad, value in zip(dp.grads, grads_at(comm.rank, i)):
                    grad[...] = value
            opt.step()
            done += 1
            if every and comm.rank == requester and done % every == 0:
                request_save(f"every {every}")
    assert join.saves == len(saves)
    return params, saves


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", sorted(INPUTS))
def test_periodic_saves_hold_the_closed_form_and_resume_bitwise(comm, tmp_path, pattern):
    directory = comm.bcast(str(tmp_path))
    inputs = [INPUTS[pattern](r, comm.size) for r in range(comm.size)]
    final, saves = train(comm, inputs, directory, every=2)
    every_saves = comm.allgather([(step, done) for step, done, _ in saves])
    steps = [step for step, _ in every_saves[0]]
    assert_all(len(saves) >= 2, f"only {len(saves)} saves with inputs {inputs}")
    # every rank saved at the same iterations; its cursor is what it consumed by then
    assert_all(all(s == [(step, min(inputs[r], step)) for step in steps]
                    for r, s in enumerate(every_saves)), f"saves by rank: {every_saves}")
    for step, _, params in saves:
        expected = serial(inputs, step)
        assert_all(all(np.allclose(p, e, rtol=0, atol=1e-12) for p, e in zip(params, expected)),
                   f"the state saved at iteration {step} is not the closed form's")
    expected = serial(inputs, max(inputs))
    assert_all(all(np.allclose(p, e, rtol=0, atol=1e-12) for p, e in zip(final, expected)),
               "the run with periodic saves left the closed form")
    clear_save()
    for k in range(len(saves)):
        resumed, _ = train(comm, inputs, resume_from=os.path.join(directory, f"save-{k}"))
        exact = all(a.tobytes() == b.tobytes() for a, b in zip(resumed, final))
        assert_all(exact, f"the run resumed from save {k} (iteration {steps[k]}) differs")


@pytest.mark.mpi
def test_a_save_request_is_withdrawn_once_served(comm, tmp_path):
    directory = comm.bcast(str(tmp_path))
    inputs = [4] * comm.size
    _, saves = train(comm, inputs, directory, every=1)
    # requests after iterations 1, 2, 3 and 4: the one after 1 rides heartbeat 2, so the save
    # runs before heartbeat 3 (iteration 2 done) and also serves the one made after 2; the one
    # after 3 rides heartbeat 4: saved on leaving the block, serving the one after 4
    assert_all([s for s, _, _ in saves] == [2, 4], f"saves at {[s for s, *_ in saves]}")
    assert_all(save_requested() is None, f"request left pending: {save_requested()!r}")


@pytest.mark.mpi
def test_a_stop_in_the_same_heartbeat_wins_over_a_save(comm):
    ran, saved = 0, []
    params = [np.zeros(2)]
    dp = DataParallel(params, comm=comm)
    with Join([dp], on_save=lambda: saved.append(1)) as join:
        for i in range(6):
            if join.stopped:
                break
            if i == 1:
                request_save("now")
                request_stop("now")
            with dp.step():
                dp.grads[0][...] = 1.0
            ran += 1
    assert_all(join.stopped and join.save_due and not saved and ran == 2,
               f"stopped {join.stopped} save_due {join.save_due} saves {saved} ran {ran}")
    assert_all(save_requested() == "now", "no on_save served the request: it stays pending")


@pytest.mark.mpi
def test_current_join_and_saving_tell_where_a_save_may_run(comm):
    dp = DataParallel([np.zeros(2)], comm=comm)
    seen = []
    with Join([dp], on_save=lambda: seen.append((Join.current(), join.saving))) as join:
        seen.append((Join.current(), join.saving))
        for _ in range(2 + comm.rank):  # rank 0 joins first: its save runs in a shadow round
            request_save("now")
            with dp.step():
                dp.grads[0][...] = 1.0
    after = (Join.current(), join.saving)
    inside, saves = seen[0], seen[1:]
    assert_all(inside == (join, False) and after == (None, False)
               and len(saves) == join.saves > 0
               and all(s == (None, True) for s in saves), f"{seen} {after}")


def shared_checkpoint(comm, directory):
    params = [np.arange(3.0)]
    checkpoint.save(directory, params, comm=comm)
    return params


def save_inside_a_join(comm, directory, inputs):
    """Each rank's loop calls checkpoint.save inside the Join after each of its iterations."""
    params = [np.zeros(3)]
    dp = DataParallel(params, comm=comm)
    with Join([dp]):
        for _ in range(inputs[comm.rank]):
            with dp.step():
                dp.grads[0][...] = 1.0
            checkpoint.save(directory, params, comm=comm)


def assert_previous_checkpoint_whole(comm, directory, good, before):
    after = os.path.getmtime(os.path.join(directory, checkpoint.MANIFEST))
    loaded = [np.zeros(3)]
    checkpoint.load(directory, loaded, comm=comm)
    assert_all(after == before and loaded[0].tobytes() == good[0].tobytes(),
               "the previous checkpoint changed")


@pytest.mark.mpi
def test_a_save_inside_a_join_raises_on_every_rank_before_any_collective(comm, tmp_path):
    directory = comm.bcast(str(tmp_path))
    good = shared_checkpoint(comm, directory)
    before = os.path.getmtime(os.path.join(directory, checkpoint.MANIFEST))
    with raises_everywhere(RuntimeError, match=r"rank \d+: checkpoint.save was called inside "
                           r"a running Join.*on_save="):
        save_inside_a_join(comm, directory, [2] * comm.size)
    assert_previous_checkpoint_whole(comm, directory, good, before)


@pytest.mark.mpi
def test_a_load_inside_a_join_raises_on_every_rank(comm, tmp_path):
    directory = comm.bcast(str(tmp_path))
    shared_checkpoint(comm, directory)
    params = [np.zeros(3)]
    dp = DataParallel(params, comm=comm)
    with raises_everywhere(RuntimeError, match="checkpoint.load was called inside a running"):
        with Join([dp]):
            with dp.step():
                dp.grads[0][...] = 1.0
            checkpoint.load(directory, params, comm=comm)
    assert_all(not params[0].any(), "load modified the parameters")


@pytest.mark.mpi(min_size=2)
def test_a_periodic_save_refuses_stale_parameters_of_a_joined_rank(comm, tmp_path):
    """An update written in the loop after dp.step() skips joined ranks: the save refuses."""
    directory = comm.bcast(str(tmp_path))
    params = [np.zeros(3)]
    dp = DataParallel(params, comm=comm)
    inputs = [1] + [4] * (comm.size - 1)  # rank 0 joins after one iteration
    with raises_everywhere(ValueError, match=r"different parameters, buffers or optimizer "
                                             r"state .* put the optimizer in the Join"):
        with Join([dp], on_save=lambda: checkpoint.save(directory, params, comm=comm)):
            for i in range(inputs[comm.rank]):
                with dp.step():
                    dp.grads[0][...] = 1.0
                params[0] -= 0.1 * dp.grads[0]  # not on a joined rank
                if i == 1:
                    request_save("test")
    assert_all(not os.path.exists(os.path.join(directory, checkpoint.MANIFEST)),
               "a checkpoint was written")


@pytest.mark.mpi
def test_periodic_saves_with_a_joinable_comm_whose_iterations_end_with_a_message(comm, tmp_path):
    """JoinableComm's end_iteration announces END to joined ranks: the save comes after it."""
    directory = comm.bcast(str(tmp_path))
    jc = JoinableComm(comm)
    inputs = [2 + 2 * r for r in range(comm.size)]
    totals, saves = [], []

    def on_save():
        checkpoint.save(directory, [np.ones(2)], step=join.iterations, comm=comm)
        saves.append(join.iterations)

    with Join([jc], on_save=on_save) as join:
        for t in range(inputs[comm.rank]):
            jc.begin_iteration()
            totals.append(float(jc.allreduce(np.array([1.0 + t]))[0]))
            if t % 2 == 1:
                request_save("test")
    expected = [(1.0 + t) * sum(n > t for n in inputs) for t in range(inputs[comm.rank])]
    every = comm.allgather(saves)
    assert_all(totals == expected and all(s == every[0] for s in every) and every[0],
               f"totals {totals} (expected {expected}), saves by rank {every}")


def saves_of(comm, iterations, on_save=None, ask=lambda i: False):
    """The iterations at which a Join([dp]) over `iterations` steps on this rank ran on_save,
    `ask(i)` telling whether this rank requests a save after its step i."""
    dp = DataParallel([np.zeros(2)], comm=comm)
    saved = []

    def save():
        saved.append(join.iterations)
        if on_save is not None:
            on_save(join)
    with Join([dp], on_save=save) as join:
        for i in range(iterations):
            with dp.step():
                dp.grads[0][...] = 1.0
            if ask(i):
                request_save(f"after step {i}")
    return saved


@pytest.mark.mpi(min_size=2)
def test_requests_made_before_a_save_on_different_ranks_make_one_save(comm):
    # rank 1 asks after step 0 (rides heartbeat 2), rank 0 after step 1, before the save
    saved = saves_of(comm, 6, ask=lambda i: (comm.rank, i) in ((1, 0), (0, 1)))
    assert_all(saved == [2] and save_requested() is None, f"saves at {saved}")


@pytest.mark.mpi
@pytest.mark.parametrize("asker", [0, -1])
def test_a_request_made_inside_on_save_asks_for_the_next_save_on_any_rank(comm, asker):
    asker = asker % comm.size
    first = []

    def again(join):
        if not first:
            first.append(join.iterations)
            if comm.rank == asker:
                request_save("from on_save")
    saved = saves_of(comm, 6, on_save=again, ask=lambda i: i == 0 and comm.rank == 0)
    assert_all(saved == [2, 3] and save_requested() is None, f"saves at {saved}")


@pytest.mark.mpi
def test_a_request_no_on_save_served_is_served_by_the_next_join(comm):
    dp = DataParallel([np.zeros(2)], comm=comm)
    with Join([dp]) as evaluation:  # no on_save: it only tells
        with dp.step():
            dp.grads[0][...] = 1.0
        request_save("during evaluation")
        with dp.step():
            dp.grads[0][...] = 1.0
    pending = save_requested()
    saved = saves_of(comm, 3)
    assert_all(evaluation.save_due and pending == "during evaluation" and saved == [1]
               and save_requested() is None, f"{evaluation.save_due} {pending!r} {saved}")


@pytest.mark.mpi
def test_a_save_that_raises_on_every_rank_leaves_the_request_pending(comm):
    def broken(join):
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        saves_of(comm, 4, on_save=broken, ask=lambda i: i == 0)
    assert_all(save_requested() == "after step 0", f"request: {save_requested()!r}")
