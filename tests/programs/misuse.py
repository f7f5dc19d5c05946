"""Failures outside the paths a step covers; run under mpiexec by test_failures.py.

    mpiexec -n 3 python -m mpi4py tests/programs/misuse.py MODE

MODE (rank 1 misbehaves):
  post_hook   a post hook raises on rank 1 only; the other ranks leave the Join and go on
  disabled    rank 1 raises inside a Join(enable=False) block; the others go on
  step        rank 1 raises inside dp.step() with no Join; the others wait in the step
  uncaught    rank 1 raises between epochs, outside any library call (run without -m mpi4py)
  exit        rank 1 calls sys.exit(3) between epochs (with -m mpi4py: the job aborts)
  exit0       rank 1 calls sys.exit(0) inside a Join
  exit_thread a thread of rank 1 calls sys.exit(4); the program then ends normally
  late        every rank raises the same error, rank 1 much later than the grace; then every
              rank tries another Join
  continue    rank 1 raises in a step; the others catch the PeerFailureError and leave the loop
  own         a blocking collective of the program's own inside a Join with uneven inputs (run
              with a small TENSORPLAY_MPI_TIMEOUT)
  save_inside checkpoint.save (to the directory in argv[2]) inside a Join, outside its
              on_save, while rank 0, without inputs, has joined: a RuntimeError before any
              collective on the others, a PeerFailureError on rank 0

Every rank that catches an exception prints ``RESULT rank=R ExceptionType: message`` and raises
it again; ranks that go on print ``WENT ON rank=R`` and sleep far longer than any test waits.
"""

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from report import report

from tensorplay_mpi import DataParallel, Join, JoinHook, PeerFailureError, checkpoint
from tensorplay_mpi.settings import settings

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from toys import AllReducer  # noqa: E402

mode = sys.argv[1]
world = MPI.COMM_WORLD
comm = world.Dup()
bad = world.rank == 1


class RaisingPostHook(JoinHook):
    def post_hook(self, is_last_joiner):
        if bad:
            raise ValueError("post hook boom")


class PostHookFailure(AllReducer):
    def join_hook(self, **kwargs):
        return RaisingPostHook()


def go_on():
    print(f"WENT ON rank={world.rank}", flush=True)
    time.sleep(120)


try:
    if mode == "post_hook":
        joinable = PostHookFailure(comm)
        with Join([joinable]):
            for _ in range(2 + world.rank):
                joinable()
        go_on()
    elif mode == "disabled":
        joinable = AllReducer(comm)
        with Join([joinable], enable=False):
            joinable()
            if bad:
                raise ValueError("boom in a disabled Join")
        go_on()
    elif mode == "step":
        dp = DataParallel([np.zeros(4)], comm=comm)
        for _ in range(3):
            with dp.step():
                if bad:
                    raise ValueError("boom in a step without a Join")
                dp.grads[0] = np.ones(4)
    elif mode in ("uncaught", "exit"):
        dp = DataParallel([np.zeros(4)], comm=comm)
        for _ in range(2):
            with Join([dp]):
                with dp.step():
                    dp.grads[0] = np.ones(4)
            if bad and mode == "exit":
                sys.exit(3)
            if bad:
                raise ValueError("boom between epochs")
        go_on()
    elif mode == "exit0":
        dp = DataParallel([np.zeros(4)], comm=comm)
        with Join([dp]):
            for i in range(5):
                if bad and i == 2:
                    sys.exit(0)
                with dp.step():
                    dp.grads[0] = np.ones(4)
    elif mode == "exit_thread":
        dp = DataParallel([np.zeros(4)], comm=comm)
        with Join([dp]):
            with dp.step():
                dp.grads[0] = np.ones(4)
        if bad:
            thread = threading.Thread(target=sys.exit, args=(4,))
            thread.start()
            thread.join()
        world.Barrier()
        print(f"RESULT rank={world.rank} ok", flush=True)
    elif mode == "late":
        dp = DataParallel([np.zeros(4)], comm=comm)
        try:
            with Join([dp]):
                with dp.step():
                    dp.grads[0] = np.ones(4)
                if bad:
                    time.sleep(2 * settings().grace)
                raise ValueError("the same bug on every rank")
        except ValueError:
            pass
        error = None
        try:
            with Join([dp]):
                with dp.step():
                    dp.grads[0] = np.ones(4)
        except RuntimeError as exc:
            error = exc
        report(world, error)  # every rank's outcome, however late
    elif mode == "continue":
        dp = DataParallel([np.zeros(4)], comm=comm)
        with Join([dp]) as join:
            for i in range(6):
                try:
                    if join.stopped:
                        break
                    if bad and i == 2:
                        raise ValueError("bad batch on rank 1")
                    with dp.step():
                        dp.grads[0] = np.ones(4)
                except PeerFailureError:
                    break
    elif mode == "own":
        dp = DataParallel([np.zeros(4)], comm=comm)
        with Join([dp]):
            for _ in range(2 + world.rank):
                with dp.step():
                    dp.grads[0] = np.ones(4)
                comm.allreduce(1.0)  # joined ranks cannot shadow this one
    elif mode == "save_inside":
        params = [np.zeros(4)]
        dp = DataParallel(params, comm=comm)
        with Join([dp]):
            for _ in range(0 if world.rank == 0 else 2):
                with dp.step():
                    dp.grads[0] = np.ones(4)
                checkpoint.save(sys.argv[2], params, comm=comm)
except Exception as exc:
    print(f"RESULT rank={world.rank} {type(exc).__name__}: {exc}", flush=True)
    time.sleep(0.5)  # let mpiexec forward the RESULT line before the abort ends the job
    raise
