"""Shared fixtures, and the three tiers of this suite (``make test`` runs them all, but the
serial tests marked ``@pytest.mark.slow``, or ``pytest.param(..., marks=pytest.mark.slow)`` for
the cases of a test that are slow at some rank counts only: ``make test-slow`` runs those, and
CI both; ``make check`` runs the tests of what changed):

1. serial tests: ``pytest -m "not mpi"``, one process, no ``mpiexec`` (``COMM_WORLD`` has one
   rank): the API, user errors, buffers, settings, docs and packaging;
2. in-process MPI tests: ``@pytest.mark.mpi(min_size=...)``, pytest itself under
   ``mpiexec -n N python -m mpi4py`` at N = 1 to 4 (``make test-mpi``), verdicts gathered so
   every rank passes or fails together;
3. launched programs: ``tests/programs/*.py``, started by a serial test under ``mpiexec`` with a
   hard timeout (``tensorplay_mpi.testing.run_mpi``) for what cannot happen inside pytest
   (aborts, signals, killed ranks, exit codes); each rank prints ``RESULT rank=R ...`` lines
   that ``helpers.results`` reads.

The test tree mirrors the package: the tests of ``tensorplay_mpi/X/`` are in ``X/`` here
(``algorithms/``, ``comm/``, ``parallel/``, ``optim/``, ``checkpoint/``, ``evaluation/``), those
of the root modules in ``data/``, ``stopping/`` and ``process/``; docs/testing.md lists them. A
file holds the tests of one subject whatever their tier: its serial tests and its MPI tests side
by side, the marker choosing (``make test-serial`` runs ``-m "not mpi"``, ``make test-mpi``
``-m mpi``, over the same files). The helpers beside this file (``helpers``, ``toys``, ...)
import from any folder (``pythonpath`` in pyproject.toml).

The tensorplay_mpi.testing plugin (``-p`` in pyproject.toml) gives the ``comm`` fixture, a fresh
duplicate of ``COMM_WORLD`` per test that must end with no pending request, and debug mode
(collective signature checks) on unless TENSORPLAY_MPI_DEBUG is set."""

import pytest

from tensorplay_mpi.testing import reset_between_tests


@pytest.fixture(autouse=True)
def process_state_between_tests():
    """Every test starts and ends with settings read from the environment as it is then and no
    stop or save request pending in this process (the "settings" and "requests" scopes of the
    resets registered in tensorplay_mpi._resets)."""
    reset_between_tests()
    yield
    reset_between_tests()
