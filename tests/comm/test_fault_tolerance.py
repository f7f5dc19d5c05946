"""The run-time decision on fault tolerance (ULFM): only Open MPI launched with it says yes."""

import pytest

from tensorplay_mpi.comm._fault_tolerance import fault_tolerance


@pytest.mark.parametrize("vendor, environ, expected, why", [
    ("Open MPI", {"OMPI_MCA_mpi_ft_enable": "1"}, True, "with --with-ft ulfm"),
    ("Open MPI", {"OMPI_MCA_mpi_ft_enable": "true"}, True, "with --with-ft ulfm"),
    ("Open MPI", {}, False, "without --with-ft ulfm"),
    ("Open MPI", {"OMPI_MCA_mpi_ft_enable": "0"}, False, "without --with-ft ulfm"),
    ("MPICH", {"OMPI_MCA_mpi_ft_enable": "1"}, False, "MPICH: its ULFM functions end the job"),
])
def test_only_open_mpi_launched_with_ulfm_reports_a_lost_rank(vendor, environ, expected, why):
    tolerant, reason = fault_tolerance(vendor, environ)
    assert tolerant is expected and why in reason, reason


def test_this_process_has_a_decision_with_a_reason():
    tolerant, reason = fault_tolerance()
    assert isinstance(tolerant, bool) and reason
