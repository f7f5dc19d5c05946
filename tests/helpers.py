"""Test helpers: the public ones of tensorplay_mpi.testing, under the names the tests import,
and the parsing of the programs' RESULT lines."""

import re

from tensorplay_mpi.testing import (PATTERNS, active_counts, assert_all, inputs_of, mpiexec_path,
                                    raises_everywhere, run_at_sizes, run_mpi)

__all__ = ["assert_all", "raises_everywhere", "PATTERNS", "inputs_of", "active_counts",
           "mpiexec_path", "run_mpi", "run_at_sizes", "results"]


def results(stdout):
    """{rank: outcome} from the ``RESULT rank=R outcome`` lines of a program's ranks.

    mpiexec may join two ranks' lines without a newline, so an outcome ends at the next
    ``RESULT rank=``/``WENT ON rank=`` or at the end of the line.
    """
    found = re.findall(r"RESULT rank=(\d+) (.*?)(?=RESULT rank=|WENT ON rank=|$)", stdout, re.M)
    return {int(rank): text for rank, text in found}
