"""Shared fixtures come from the tensorplay_mpi.testing plugin (``-p`` in pyproject.toml): the
``comm`` fixture, a fresh communicator per MPI test that must end with no pending request, and
debug mode (collective signature checks) on unless TENSORPLAY_MPI_DEBUG is set."""
