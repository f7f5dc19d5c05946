"""Runnable examples: ``mpiexec -n 4 python -m mpi4py -m tensorplay_mpi.examples.<name>``."""
