"""Test helpers: collective verdicts and launching programs under mpiexec."""

import os
import shutil
import subprocess
import sys

from mpi4py import MPI


def assert_all(ok, detail=""):
    """Collective assertion: fails on every rank if it fails on any, naming the ranks."""
    verdicts = MPI.COMM_WORLD.allgather((bool(ok), str(detail)))
    bad = [f"rank {r}: {d}" for r, (good, d) in enumerate(verdicts) if not good]
    assert not bad, "; ".join(bad)


def mpiexec_path():
    """$MPIEXEC, or the mpiexec beside this Python (the mpich wheel's), or the one on PATH."""
    return (os.environ.get("MPIEXEC")
            or shutil.which("mpiexec", path=os.path.dirname(sys.executable))
            or shutil.which("mpiexec"))


def run_mpi(nprocs, args, timeout=120, **env):
    """Run ``mpiexec -n nprocs python -m mpi4py ARGS`` with a hard timeout and extra `env`."""
    cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, "-m", "mpi4py", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **env))
