"""The transport: the nonblocking collective wrappers under the Join, over mpi4py.

Each wrapper starts one MPI operation on NumPy or CuPy arrays (torch tensors too) and returns
its :class:`Work`, which owns the buffers until the operation completes; ``outstanding_requests``
counts those still pending in this process.  Also here: whether device pointers may go to MPI
(``cuda_aware``) and whether an MPI error is the report of a lost rank (``is_process_failure``,
under a fault-tolerant launch).  The modules beside this one are the library's own (private).
"""

from ._buffers import cuda_aware
from ._collectives import default_comm, iallgather, iallgatherv, iallreduce, ibcast, irecv, isend
from ._fault_tolerance import is_process_failure
from ._work import Work, outstanding_requests

__all__ = ["Work", "iallreduce", "ibcast", "iallgather", "iallgatherv", "isend", "irecv",
           "default_comm", "outstanding_requests", "cuda_aware", "is_process_failure"]
