"""Helpers of this suite's own: the parsing of the programs' RESULT lines, comparisons and
measurements.  The public test helpers (``assert_all``, ``run_mpi``, ...) are imported from
:mod:`tensorplay_mpi.testing` directly."""

import os
import re
from pathlib import Path

import numpy as np

__all__ = ["ROOT", "PROGRAMS", "STOP_DEMO", "results", "demo_digest", "UNEVEN", "gathered_equal",
           "rss_bytes", "buckets_of", "HostSubclass"]

ROOT = Path(__file__).resolve().parent.parent
"""The repository's root."""

PROGRAMS = ROOT / "tests" / "programs"
"""The programs that serial tests launch under mpiexec (the third tier of conftest.py)."""


STOP_DEMO = str(PROGRAMS / "stop_demo.py")
"""A demo (train or train_torch) that signals its own ranks at a chosen batch."""

_LABELS = ("RESULT", "WENT ON", "FOLLOWUP")


def results(stdout, label="RESULT"):
    """{rank: outcome} from the ``LABEL rank=R outcome`` lines of a program's ranks.

    mpiexec may join two ranks' lines without a newline, so an outcome ends at the next
    labelled ``rank=`` or at the end of the line.
    """
    ends = "|".join(f"{other} rank=" for other in _LABELS)
    found = re.findall(rf"{label} rank=(\d+) (.*?)(?={ends}|$)", stdout, re.M)
    return {int(rank): text for rank, text in found}


def demo_digest(result):
    """The parameter digest a demo run prints (it must have exited 0, identical on all ranks)."""
    found = re.search(r"parameters identical on all \d+ ranks: yes \(digest ([0-9a-f]+)\)",
                      result.stdout)
    assert result.returncode == 0 and found, f"{result.stdout}\n{result.stderr}"
    return found.group(1)


UNEVEN = ["three_plus_rank", "rank0_zero", "last_zero"]
"""The uneven patterns of :data:`PATTERNS` (a rank with no input included)."""


def gathered_equal(arrays, comm):
    """True on every rank iff every rank holds bitwise the same arrays."""
    every = comm.allgather([a.tobytes() for a in arrays])
    return all(b == every[0] for b in every)


def rss_bytes():
    """This process's resident memory in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def buckets_of(grads):
    """The gradients grouped by the buffer their memory belongs to (what DataParallel packed
    together), observed through the public views only."""
    groups = []
    for g in grads:
        group = next((grp for grp in groups if grp[0].base is g.base), None)
        if group is None:
            groups.append([g])
        else:
            group.append(g)
    return groups


class HostSubclass(np.ndarray):
    """A host array of another ndarray type (as ``np.memmap`` and ``np.matrix`` are)."""
