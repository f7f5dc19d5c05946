"""Shared fixtures.  The tensorplay_mpi.testing plugin (``-p`` in pyproject.toml) gives the
``comm`` fixture, a fresh communicator per MPI test that must end with no pending request, and
debug mode (collective signature checks) on unless TENSORPLAY_MPI_DEBUG is set."""

import pytest
from fake_device import reset_settings


@pytest.fixture(autouse=True)
def settings_from_the_environment():
    """Every test starts and ends with settings read from the environment as it is then."""
    reset_settings()
    yield
    reset_settings()
