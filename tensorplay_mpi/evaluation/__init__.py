"""Evaluation over uneven shards: metric states synced over MPI (:mod:`.metrics`, also
``tensorplay_mpi.metrics``) and ``SyncBatchNorm`` (:mod:`.sync_batchnorm`, imported on first
use of ``tensorplay_mpi.SyncBatchNorm``: it needs torch)."""
