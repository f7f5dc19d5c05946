"""Shared fixtures: a fresh communicator per MPI test that must end with no pending request."""

import pytest
from fake_device import reset_settings
from helpers import assert_all
from mpi4py import MPI

from tensorplay_mpi.comm import outstanding_requests


@pytest.fixture
def comm():
    """A duplicate of COMM_WORLD for one test; afterwards no library request may be pending."""
    dup = MPI.COMM_WORLD.Dup()
    yield dup
    pending = outstanding_requests()
    dup.Free()
    assert_all(pending == 0, f"{pending} requests still pending after the test")



@pytest.fixture(autouse=True)
def settings_from_the_environment():
    """Every test starts and ends with settings read from the environment as it is then."""
    reset_settings()
    yield
    reset_settings()
