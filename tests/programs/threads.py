"""A Work waited for by a helper thread while the main thread keeps starting operations.

    mpiexec -n 2 python -m mpi4py tests/programs/threads.py

The registry tests pending operations when many start; MPI forbids two threads testing one
request at once, so the registry must skip the one the helper thread is waiting for.  Prints
``RESULT rank=R ok`` when every result is exact.
"""

import threading
import time

import numpy as np
from mpi4py import MPI
from report import report

from tensorplay_mpi import JoinableComm
from tensorplay_mpi.comm import iallreduce, outstanding_requests
from tensorplay_mpi.comm._work import sweep_pending



def wait_for(work, out):
    out.append(work.wait(timeout=60))


world = MPI.COMM_WORLD
comm = world.Dup()
JoinableComm(comm)  # guarded: waits poll for failure notices too
error = None
try:
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE, "mpi4py initialised a lower thread level"
    for trial in range(10):
        if world.rank == 0:
            time.sleep(0.02)  # the others' first operation stays pending for a while
        first = iallreduce(comm, np.full(1 << 16, 1.0), np.empty(1 << 16))
        waited: list = []
        helper = threading.Thread(target=wait_for, args=(first, waited))
        helper.start()
        sums = []
        while (helper.is_alive() or len(sums) < 50) and len(sums) < 2000:  # the registry's tests
            sums.append(iallreduce(comm, np.full(8, float(len(sums))), np.empty(8)))
            for _ in range(20):
                sweep_pending()
        sums += [iallreduce(comm, np.full(8, float(i)), np.empty(8))
                 for i in range(len(sums), 2000)]  # the same number on every rank
        helper.join()
        for i, work in enumerate(sums):
            work.wait(timeout=60)
            if not (work.result() == i * world.size).all():
                raise AssertionError(f"trial {trial}: operation {i} gave {work.result()}")
        if waited != [True] or not (first.result() == world.size).all():
            raise AssertionError(f"trial {trial}: the helper thread's wait gave {waited}")
    if outstanding_requests():
        raise AssertionError(f"{outstanding_requests()} operations pending")
except Exception as exc:  # noqa: BLE001 - the RESULT line carries it
    error = exc
report(world, error)
