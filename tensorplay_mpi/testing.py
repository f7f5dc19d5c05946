"""Testing code built on tensorplay_mpi with pytest-mpi: verdicts every rank shares.

A rank that fails a test alone leaves the others waiting in their next collective, so every
check here decides on data gathered from every rank and fails on all of them together.

- :func:`assert_all` and :func:`raises_everywhere`: collective assertions.
- :data:`PATTERNS`, :func:`inputs_of`, :func:`active_counts`: uneven numbers of inputs per rank
  (zeros included) and the number of ranks active in each iteration, at any world size.
- :func:`run_mpi` and :func:`run_at_sizes`: a program under ``mpiexec`` at every rank count,
  with a hard timeout and every rank's output.
- As a pytest plugin (``pytest_plugins = ["tensorplay_mpi.testing"]`` in a ``conftest.py``, or
  ``-p tensorplay_mpi.testing``): a ``comm`` fixture (a fresh duplicate of ``COMM_WORLD`` that
  must end with no library request pending) and debug mode on (``TENSORPLAY_MPI_DEBUG=1``:
  ranks compare the signature of every library collective before it starts, so a join hook that
  does not shadow its joinable fails with
  :class:`~tensorplay_mpi.errors.CollectiveMismatchError` instead of hanging), unless
  ``TENSORPLAY_MPI_DEBUG`` is set.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Callable, Iterator, Sequence

from mpi4py import MPI

from ._resets import reset_all
from .comm._agreement import agree
from .comm._work import Work, outstanding_requests
from .settings import settings

__all__ = ["assert_all", "raises_everywhere", "PATTERNS", "inputs_of", "active_counts", "run_mpi",
           "run_at_sizes", "debug_mode", "reset_settings", "reset_between_tests",
           "reset_process_state"]

_verdicts: MPI.Intracomm | None = None  # COMM_WORLD's private duplicate for verdicts
_debug_by_plugin = False  # the pytest plugin turned debug mode on
_DETAIL_BYTES = 4096  # of a failed verdict's detail that the other ranks quote


def assert_all(ok: Any, detail: Any = "") -> None:
    """Fail on every rank if `ok` is false on any rank, naming those ranks and their `detail`.

    Collective over ``COMM_WORLD``: every rank must call it at the same point.  The verdicts
    meet through :func:`~tensorplay_mpi.comm._agreement.agree`: a rank whose `ok` is false raises
    ``AssertionError("rank R: DETAIL")``; the others an ``AssertionError`` naming the failed
    ranks and quoting their details.
    """
    global _verdicts
    if _verdicts is None:
        # A private duplicate: these verdicts never meet a library collective.
        _verdicts = MPI.COMM_WORLD.Dup()
    verdicts = _verdicts
    rank = verdicts.Get_rank()
    error = None if ok else AssertionError(f"rank {rank}: {detail}")
    agree(lambda row, every: Work(verdicts.Iallgather(row, every), "test verdict", (row, every)),
          rank, verdicts.Get_size(), "test verdict", settings().timeout, error,
          text_bytes=_DETAIL_BYTES)


class RaisedInfo:
    """What :func:`raises_everywhere` caught on this rank: :attr:`value`, the exception."""

    value: BaseException | None = None


@contextlib.contextmanager
def raises_everywhere(expected: type[BaseException] | tuple[type[BaseException], ...],
                      match: str | None = None) -> Iterator[RaisedInfo]:
    """Check that the block raises `expected` (its message matching `match`) on every rank.

    Collective over ``COMM_WORLD``, like :func:`assert_all`: a rank that raised nothing, or
    something else, fails the test on every rank, named with what it did.

    Examples
    --------
    ::

        with raises_everywhere(ValueError, match="different parameter"):
            DataParallel(params_whose_shapes_differ_per_rank, comm=comm)
    """
    info = RaisedInfo()
    try:
        yield info
    except Exception as raised:  # decided below, on every rank
        info.value = raised
    error = info.value
    kinds = expected if isinstance(expected, tuple) else (expected,)
    names = "/".join(kind.__name__ for kind in kinds)
    if error is None:
        ok, detail = False, f"raised nothing, expected {names}"
    elif not isinstance(error, expected):
        ok, detail = False, f"raised {type(error).__name__}: {error} (expected {names})"
    elif match is not None and not re.search(match, str(error)):
        ok, detail = False, f"{type(error).__name__} {str(error)!r} does not match {match!r}"
    else:
        ok, detail = True, ""
    assert_all(ok, detail)


PATTERNS: dict[str, Callable[[int, int], int]] = {
    "three_plus_rank": lambda r, w: 3 + r,
    "even": lambda r, w: 4,
    "rank0_zero": lambda r, w: 0 if r == 0 else 2 + r,
    "last_zero": lambda r, w: 0 if r == w - 1 else max(1, 5 - r),
    "scrambled": lambda r, w: (7 * r + 3) % 5,
    "one_straggler": lambda r, w: 6 if r == w // 2 else 1,
}
"""Number of inputs of rank ``r`` in a world of size ``w``: uneven, even, a rank with none, one
rank (the middle one, not the highest) alone for the last five iterations."""


def inputs_of(pattern: str, size: int) -> list[int]:
    """Every rank's number of inputs under `pattern` (a key of :data:`PATTERNS`)."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {sorted(PATTERNS)}, got {pattern!r}")
    return [PATTERNS[pattern](r, size) for r in range(size)]


def active_counts(inputs: Sequence[int]) -> list[int]:
    """Number of active ranks in each iteration, given every rank's number of inputs."""
    return [sum(n > i for n in inputs) for i in range(max(inputs, default=0))]


def mpiexec_path() -> str | None:
    """``$MPIEXEC``, or the mpiexec beside this Python (the mpich wheel's), or the one on PATH."""
    return (os.environ.get("MPIEXEC")
            or shutil.which("mpiexec", path=os.path.dirname(sys.executable))
            or shutil.which("mpiexec"))


def run_mpi(nprocs: int, args: Sequence[str], timeout: float = 120,
            **env: str | None) -> subprocess.CompletedProcess[str]:
    """Run ``mpiexec -n nprocs python -m mpi4py ARGS`` with a hard timeout.

    `env` adds variables to the environment (``None`` removes one).  Every rank's output comes
    back in the result's ``stdout`` and ``stderr``.
    """
    launcher = mpiexec_path()
    if launcher is None:
        raise RuntimeError("no mpiexec found: set $MPIEXEC or install the mpich extra")
    environ = dict(os.environ)
    for name, value in env.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    if _debug_by_plugin and "TENSORPLAY_MPI_DEBUG" not in env:
        environ.pop("TENSORPLAY_MPI_DEBUG", None)  # the plugin's setting stays in-process
    cmd = [launcher, "-n", str(nprocs), sys.executable, "-m", "mpi4py", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=environ)


def run_at_sizes(args: Sequence[str], sizes: Sequence[int] = (1, 2, 3, 4),
                 timeout: float = 120, **env: str | None
                 ) -> dict[int, subprocess.CompletedProcess[str]]:
    """Run a program (say, an uneven-inputs scenario) under mpiexec at each of `sizes`.

    Raises
    ------
    AssertionError
        At the first size where the program fails, with every rank's output.
    """
    results = {}
    for size in sizes:
        result = run_mpi(size, args, timeout=timeout, **env)
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed at {size} rank(s) (exit "
                                 f"{result.returncode}):\n{result.stdout}\n{result.stderr}")
        results[size] = result
    return results


def debug_mode(enabled: bool = True) -> None:
    """Turn the collective signature checks of ``TENSORPLAY_MPI_DEBUG=1`` on or off in this
    process (it sets the variable and makes the library read its settings again)."""
    os.environ["TENSORPLAY_MPI_DEBUG"] = "1" if enabled else "0"
    reset_settings()


def reset_settings() -> None:
    """Make the library read its ``TENSORPLAY_MPI_*`` variables again, for a test that changed
    them: every decision made from the environment (the cached settings, the CUDA-awareness
    decision) is forgotten.  The BLAS thread limit, applied once per process, stays."""
    reset_all("settings")


def reset_between_tests() -> None:
    """What a test suite resets around every test: the settings (:func:`reset_settings`) and
    this rank's stop and save requests, so that no test sees another's environment or a
    request it left pending."""
    reset_all(("settings", "requests"))


def reset_process_state() -> None:
    """Reset all of the library's process-wide state that can be reset (the state table of the
    API reference): settings, decisions made from them, the thread decision, the excepthook,
    the stop and save requests.  The next library call sets the process up again.

    Raises
    ------
    RuntimeError
        If library operations are still pending (they cannot be dropped); nothing is reset.
    """
    pending = outstanding_requests()
    if pending:
        raise RuntimeError(f"{pending} library operation(s) still pending: complete them "
                           "(wait on their Work, or finish the Join) before resetting")
    reset_all()


# -- the pytest plugin ---------------------------------------------------------------------------


def pytest_configure(config: Any) -> None:
    """Debug mode on in tests, unless ``TENSORPLAY_MPI_DEBUG`` says otherwise.

    Programs that :func:`run_mpi` launches do not inherit it: they run as users run them,
    unless the test passes ``TENSORPLAY_MPI_DEBUG`` itself.
    """
    global _debug_by_plugin
    if "TENSORPLAY_MPI_DEBUG" not in os.environ:
        debug_mode(True)
        _debug_by_plugin = True


def _comm() -> Iterator[MPI.Intracomm]:
    """A duplicate of COMM_WORLD for one test; afterwards no library request may be pending."""
    dup = MPI.COMM_WORLD.Dup()
    yield dup
    pending = outstanding_requests()
    dup.Free()
    assert_all(pending == 0, f"{pending} requests still pending after the test")


if "pytest" in sys.modules:  # as a plugin: the fixture (pytest is not needed otherwise)
    comm = sys.modules["pytest"].fixture(name="comm")(_comm)
