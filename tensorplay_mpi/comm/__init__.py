"""The transport: everything that talks MPI, below the Join.

Users need the collective wrappers (``tensorplay_mpi.comm.iallreduce`` and the others of
:mod:`tensorplay_mpi.comm.collectives`), re-exported here; the rooms beside them are the
library's own: operations and their registry (``work``), buffers and devices (``buffers``,
``tensors``, ``torch_cuda``), failure handling (``guard``, ``agreement``, ``drain``,
``stall``), lost ranks under ULFM (``fault_tolerance``, ``shrink``), persistent collectives
(``persistent``) and the reductions by name (``ops``).
"""

from .collectives import (OPS, Work, check_comm, default_comm, default_timeout, iallgather,
                           iallgatherv, iallreduce, ibcast, irecv, isend, op_name,
                           outstanding_requests, resolve_timeout)

__all__ = ["Work", "iallreduce", "ibcast", "iallgather", "iallgatherv", "isend", "irecv",
           "default_comm", "default_timeout", "resolve_timeout", "check_comm",
           "outstanding_requests", "OPS", "op_name"]
