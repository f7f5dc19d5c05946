"""A save that fails at any step loses nothing: afterwards `load` finds a whole checkpoint on
every rank, the new one or the previous one, for replicated, ZeRO-sharded and consolidated
saves.  Failures are injected on one rank or on every rank: an exception in a shard write, an
EIO from the directory fsync after the manifest's rename (the commit point), a
KeyboardInterrupt right after an agreement (a second Ctrl-C reaching a rank during the stop's
own save)."""

import errno
import os

import numpy as np
import pytest

from tensorplay_mpi import SGD, Adam, DataParallel, ZeroRedundancyOptimizer, checkpoint
from tensorplay_mpi.checkpoint import _store as store
from tensorplay_mpi.testing import assert_all

SHAPES = [(4,), (3, 3), (5,)]
KINDS = ["replicated", "zero-sharded", "zero-consolidated"]


class Injected(Exception):
    pass


def make(comm, kind, value):
    params = [np.full(s, float(value)) for s in SHAPES]
    dp = DataParallel(params, comm=comm)
    opt = (SGD(params, dp.grads, lr=0.1, momentum=0.9) if kind == "replicated" else
           ZeroRedundancyOptimizer(params, dp.grads, Adam, comm=comm, lr=0.1))
    with dp.step():
        for g in dp.grads:
            g[...] = value
    opt.step()
    return params, opt


def save(comm, directory, kind, value):
    params, opt = make(comm, kind, value)
    zero = kind.split("-")[1] if kind != "replicated" else "sharded"
    checkpoint.save(directory, params, optimizer=opt, zero=zero, step=value, comm=comm)


def loaded_step(comm, directory, kind):
    """The step of the checkpoint `load` finds; its parameters checked against the ones that
    save wrote (the same construction, its step's value)."""
    params, opt = make(comm, kind, 0)
    resumed = checkpoint.load(directory, params, optimizer=opt, comm=comm)
    written = make(comm, kind, resumed.step)[0]
    whole = all((p == w).all() for p, w in zip(params, written))
    return resumed.step if whole else -1


def inject(monkeypatch, comm, point, ranks):
    """Make this rank fail at `point` if it is in `ranks`."""
    if comm.rank not in ranks:
        return
    if point == "shard write":
        real = store.write_arrays

        def write(path, arrays):
            if "optimizer-shard" in os.path.basename(path):
                raise Injected("shard write")
            return real(path, arrays)
        monkeypatch.setattr(store, "write_arrays", write)
    elif point == "directory fsync after the rename":
        real_replace, real_fsync = os.replace, os.fsync
        renamed = []

        def replace(src, dst):
            real_replace(src, dst)
            renamed.append(os.path.basename(dst) == checkpoint.MANIFEST)

        def fsync(fd):
            if renamed and renamed[-1]:
                raise OSError(errno.EIO, "injected EIO")
            return real_fsync(fd)
        monkeypatch.setattr(store.os, "replace", replace)
        monkeypatch.setattr(store.os, "fsync", fsync)
    else:  # "interrupt after agreement N": the agreement completes, then Ctrl-C
        wanted = int(point.rsplit(" ", 1)[1])
        real, count = store.agree_or_raise, [0]

        def agree(*args, **kwargs):
            values = real(*args, **kwargs)
            count[0] += 1
            if count[0] == wanted:
                raise KeyboardInterrupt
            return values
        monkeypatch.setattr(store, "agree_or_raise", agree)


POINTS = ["shard write", "directory fsync after the rename", "interrupt after agreement 1",
          "interrupt after agreement 2", "interrupt after agreement 3",
          "interrupt after agreement 4"]
LAST_AGREEMENT = 4  # the arrays, arguments, shard and manifest contents, the manifest (commit)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("who", ["one", "every"])
def test_a_failed_save_leaves_a_whole_checkpoint(comm, tmp_path, monkeypatch, kind, point,
                                                 who):
    if who == "one" and point.startswith("interrupt") and not point.endswith(
            str(LAST_AGREEMENT)):
        pytest.skip("one rank interrupted before the last agreement: the others wait for it "
                    "in the next one until the deadline, as for any rank that stops")
    directory = comm.bcast(str(tmp_path))
    save(comm, directory, kind, 1)  # the previous checkpoint
    ranks = {comm.size - 1} if who == "one" else set(range(comm.size))
    if point == "directory fsync after the rename":
        ranks = {0} if who == "one" else ranks  # rank 0 writes the manifest
    with monkeypatch.context() as patch:
        inject(patch, comm, point, ranks)
        try:
            save(comm, directory, kind, 2)
            outcome = "saved"
        except (Injected, OSError, KeyboardInterrupt) as error:
            outcome = type(error).__name__
        except Exception as error:  # the others learn of a rank's failure
            outcome = type(error).__name__
    step = loaded_step(comm, directory, kind)
    steps = comm.allgather(step)
    assert_all(step in (1, 2) and len(set(steps)) == 1,
               f"{point} on {who} rank(s), {kind}: loaded steps {steps} ({outcome})")
    if point.startswith("interrupt after agreement") and point.endswith(str(LAST_AGREEMENT)):
        assert_all(step == 2, f"committed, then interrupted: loaded step {step}")
