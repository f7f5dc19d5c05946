"""Shared fixtures, and the three tiers of this suite (``make test`` runs them all, but the
serial tests marked ``slow`` by :data:`SLOW`: ``make test-slow`` runs those, and CI both):

1. serial tests: ``pytest -m "not mpi"``, one process, no ``mpiexec`` (``COMM_WORLD`` has one
   rank): the API, user errors, buffers, settings, docs and packaging;
2. in-process MPI tests: ``@pytest.mark.mpi(min_size=...)``, pytest itself under
   ``mpiexec -n N python -m mpi4py`` at N = 1 to 4 (``make test-mpi``), verdicts gathered so
   every rank passes or fails together;
3. launched programs: ``tests/programs/*.py``, started by a serial test under ``mpiexec`` with a
   hard timeout (``tensorplay_mpi.testing.run_mpi``) for what cannot happen inside pytest
   (aborts, signals, killed ranks, exit codes); each rank prints ``RESULT rank=R ...`` lines
   that ``helpers.results`` reads.

The files are grouped by the module they test, a folder each (``join/``, ``comm/``,
``buffers/``, ``parallel/``, ``optim/``, ``checkpoint/``, ``data/``, ``stopping/``,
``evaluation/``, ``process/``, ``project/``; docs/testing.md lists them); the helpers beside this
file (``helpers``, ``toys``, ...) import from any of them (``pythonpath`` in pyproject.toml).

The tensorplay_mpi.testing plugin (``-p`` in pyproject.toml) gives the ``comm`` fixture, a fresh
duplicate of ``COMM_WORLD`` per test that must end with no pending request, and debug mode
(collective signature checks) on unless TENSORPLAY_MPI_DEBUG is set."""

from fnmatch import fnmatch

import pytest

from tensorplay_mpi.testing import reset_between_tests

SLOW = (
    # randomised failure points: every neighbouring pair at 2 ranks, samples at 3 and 4 (~100 s)
    "tests/join/test_failure_points.py::*",
    # real signals stop the demos, which resume to the digest of a run never stopped (~70 s;
    # the NumPy demo's case at 2 ranks stays)
    "tests/stopping/test_stop_resume.py::*[[][134]-*",
    "tests/stopping/test_stop_resume_torch.py::*",
    # the documentation's examples at 3 ranks (at 1 rank they stay in make test; ~50 s)
    "tests/project/test_docs.py::test_docs_example_runs[[]*-3[]]",
    # the demos at 3 and 4 ranks, the torch demo, its evaluation (~30 s)
    "tests/project/test_examples.py::"
    "test_demo_training_is_accurate_exact_and_identical_on_every_rank[[][34]-*",
    "tests/project/test_examples.py::test_the_torch_demo_prints_the_demo_lines_and_trains_as_well",
    "tests/evaluation/test_evaluation_demo.py::*[[]train_torch[]]",
    # failures at 3 ranks (at 2 ranks they stay; ~30 s)
    "tests/parallel/test_data_parallel_failures.py::*[[]3-*",
    "tests/parallel/test_update.py::test_an_exception_in_update_raises_on_every_rank[[]3-*",
    # failure paths that wait for their deadlines: stall reports, grace periods (~50 s)
    "tests/join/test_failures.py::"
    "test_an_uncaught_exception_without_mpi4py_run_aborts_the_job[[]0-False[]]",
    "tests/join/test_failures.py::test_a_stalled_wait_is_reported_once_with_where_every_rank_is",
    "tests/join/test_failures.py::"
    "test_a_rank_that_comes_to_the_agreement_after_the_grace_gets_the_same_verdict",
    "tests/join/test_failures.py::test_stall_reports_can_be_turned_off",
    "tests/join/test_failures.py::test_a_timeout_names_the_likely_causes_and_nothing_follows_it"
    "[[]1[]]",
    "tests/join/test_failures.py::test_a_stalled_rank_times_out_with_a_report_and_an_abort"
    "[[][34][]]",
)
"""The serial tests that ``make test`` leaves to ``make test-slow`` (CI runs both): where the
serial tier's time went (``pytest --durations``), each kept at one rank count or one case in
``make test`` where it has several."""


def pytest_collection_modifyitems(config, items):
    """Mark the :data:`SLOW` tests ``slow``."""
    for item in items:
        if any(fnmatch(item.nodeid, pattern) for pattern in SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def process_state_between_tests():
    """Every test starts and ends with settings read from the environment as it is then and no
    stop or save request pending in this process (tensorplay_mpi.process.STATE's "settings" and
    "requests" scopes)."""
    reset_between_tests()
    yield
    reset_between_tests()
