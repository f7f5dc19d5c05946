"""Shared fixtures: a fresh communicator per MPI test that must end with no pending request."""

import pytest
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

