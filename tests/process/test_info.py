"""python -m tensorplay_mpi.info: one table from rank 0, the thread decision, the launch check."""

import os
import re
import subprocess
import sys

import pytest
from mpi4py import MPI

from tensorplay_mpi.info import COLUMNS
from tensorplay_mpi.testing import run_mpi


def table_rows(stdout):
    lines = stdout.splitlines()
    header = [i for i, line in enumerate(lines) if line.startswith("rank  host")]
    assert len(header) == 1, stdout  # one table, printed once
    rows = []
    for line in lines[header[0] + 2:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line))
    return rows


def test_every_rank_has_a_row_in_one_table():
    result = run_mpi(3, ["-m", "tensorplay_mpi.info"], timeout=120, TENSORPLAY_MPI_THREADS="1")
    assert result.returncode == 0, result.stderr
    rows = table_rows(result.stdout)
    assert [row[0] for row in rows] == ["0", "1", "2"]
    assert len({row[2] for row in rows}) == 3  # three processes
    assert all(len(row) == len(COLUMNS) for row in rows), rows
    version = " ".join(MPI.Get_library_version().splitlines()[0].split())
    assert all(version in row for row in rows)
    assert all(re.search(r"\(1\)", row[COLUMNS.index("BLAS (threads)")]) for row in rows), rows
    assert "BLAS/OpenMP threads: 1 per rank (TENSORPLAY_MPI_THREADS=1)" in result.stdout
    # Unforced, the answer comes from the MPI library (a yes from MPI 4.1's memory kinds when
    # they name cuda), and every rank's column agrees with it.
    answer = re.search(r"^CUDA-aware: (yes|no) \((.*)\)$", result.stdout, re.M)
    assert answer, result.stdout
    assert answer[2].startswith("the MPI library"), answer[0]
    assert {row[COLUMNS.index("CUDA-aware")] for row in rows} == {answer[1]}
    if "cuda" in _memory_alloc_kinds():
        assert answer[1] == "yes", answer[0]


def _memory_alloc_kinds():
    """MPI 4.1's ``mpi_memory_alloc_kinds`` of COMM_WORLD, as this MPI library reports it."""
    info = MPI.COMM_WORLD.Get_info()
    try:
        return info.Get("mpi_memory_alloc_kinds") or ""
    finally:
        info.Free()


@pytest.mark.parametrize("forced, said", [("0", "no"), ("1", "yes")])
def test_a_forced_cuda_awareness_is_reported_as_forced(forced, said):
    env = {"TENSORPLAY_MPI_CUDA_AWARE": forced, "TENSORPLAY_MPI_THREADS": "keep"}
    result = subprocess.run([sys.executable, "-m", "tensorplay_mpi.info"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    assert f"CUDA-aware: {said} (forced by TENSORPLAY_MPI_CUDA_AWARE={forced}" in result.stdout
    assert [row[COLUMNS.index("CUDA-aware")] for row in table_rows(result.stdout)] == [said]


def test_a_singleton_launch_of_several_tasks_gets_the_launch_warning():
    env = {"SLURM_STEP_NUM_TASKS": "4", "TENSORPLAY_MPI_THREADS": "keep"}
    result = subprocess.run([sys.executable, "-m", "tensorplay_mpi.info"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("WARNING: MPI.COMM_WORLD has 1 rank but "
                                    "SLURM_STEP_NUM_TASKS=4"), result.stdout
    assert "srun --mpi=pmi2" in result.stdout
    assert "BLAS/OpenMP threads: kept (TENSORPLAY_MPI_THREADS=keep)" in result.stdout
    assert len(table_rows(result.stdout)) == 1
