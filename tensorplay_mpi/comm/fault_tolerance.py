"""Whether this MPI can survive a lost rank (ULFM: revoke, agree, shrink), decided at run time.

The functions exist in mpi4py 4 whatever the MPI (``Comm.Revoke``, ``Comm.Shrink``,
``Comm.Agree``, ``Comm.Get_failed``), but only an MPI built with User-Level Failure
Mitigation, and launched with it on, reports a lost rank to the survivors instead of ending the
job: Open MPI 5 under ``mpiexec --with-ft ulfm`` (which sets ``OMPI_MCA_mpi_ft_enable=1`` in
every rank's environment).  MPICH's wheels have the functions as stubs.  ``python -m
tensorplay_mpi.info`` prints the decision.
"""

from __future__ import annotations

import os
from typing import Mapping

from mpi4py import MPI

__all__ = ["fault_tolerance", "FUNCTIONS"]

FUNCTIONS = ("Revoke", "Shrink", "Agree", "Get_failed")
"""The ULFM methods of ``mpi4py.MPI.Comm`` that surviving a lost rank needs."""

_ON = ("1", "true", "yes", "on")


def fault_tolerance(vendor: str | None = None,
                    environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether a lost rank is reported to the survivors (ULFM), and why; local.

    Parameters
    ----------
    vendor, environ
        The MPI library's vendor (``MPI.get_vendor()[0]``) and the environment
        (``os.environ``), by default this process's.
    """
    missing = [name for name in FUNCTIONS if not hasattr(MPI.Comm, name)]
    if missing:
        return False, f"mpi4py {MPI.Get_version()} has no {', '.join(missing)} (mpi4py 4 has)"
    vendor = MPI.get_vendor()[0] if vendor is None else vendor
    environ = os.environ if environ is None else environ
    if vendor != "Open MPI":
        return False, (f"{vendor}: its ULFM functions end the job on a lost rank here (Open "
                       "MPI 5 under mpiexec --with-ft ulfm reports it instead)")
    if environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in _ON:
        return False, "Open MPI launched without --with-ft ulfm (OMPI_MCA_mpi_ft_enable unset)"
    return True, "Open MPI launched with --with-ft ulfm (OMPI_MCA_mpi_ft_enable=1)"
