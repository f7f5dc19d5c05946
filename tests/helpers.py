"""Test helpers: the public ones of tensorplay_mpi.testing, under the names the tests import."""

from tensorplay_mpi.testing import (PATTERNS, active_counts, assert_all, inputs_of, mpiexec_path,
                                    raises_everywhere, run_at_sizes, run_mpi)

__all__ = ["assert_all", "raises_everywhere", "PATTERNS", "inputs_of", "active_counts",
           "mpiexec_path", "run_mpi", "run_at_sizes"]
