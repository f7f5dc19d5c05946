"""Serial tests of the collective wrappers and the registry of pending operations (COMM_SELF)."""

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi.comm import iallgather, iallreduce, ibcast, outstanding_requests
from tensorplay_mpi.comm._work import sweep_pending


@pytest.mark.parametrize("start, name", [
    (lambda buf, out: iallreduce(MPI.COMM_SELF, buf, out), "sendbuf"),
    (lambda buf, out: iallreduce(MPI.COMM_SELF, out, buf), "recvbuf"),
    (lambda buf, out: ibcast(MPI.COMM_SELF, buf, 0), "buf"),
    (lambda buf, out: iallgather(MPI.COMM_SELF, buf, out), "sendbuf"),
])
def test_a_buffer_that_is_no_array_is_a_type_error_naming_the_argument(start, name):
    with pytest.raises(TypeError, match=f"{name} must be an array .* got list"):
        start([1.0, 2.0, 3.0], np.empty(3))
    assert outstanding_requests() == 0  # nothing was started


def test_a_dropped_work_is_owned_until_the_library_completes_it():
    out = np.empty(4)
    iallreduce(MPI.COMM_SELF, np.arange(4.0), out)  # dropped at once
    assert outstanding_requests() == 1
    sweep_pending()  # what every library start does once operations pile up
    assert outstanding_requests() == 0
    np.testing.assert_array_equal(out, np.arange(4.0))
