"""Which MPI, which array libraries, and whether device buffers go to MPI directly.

Run ``python -m tensorplay_mpi.info`` (or under mpiexec: every rank prints).
"""

from __future__ import annotations

import importlib.metadata

import mpi4py
import numpy as np
from mpi4py import MPI

from . import __version__
from .buffers import cuda_aware


def _cupy_version() -> str:
    """Installed CuPy distributions, read from their metadata (CuPy is not imported)."""
    found = sorted(f"{d.metadata['Name']} {d.version}" for d in importlib.metadata.distributions()
                   if (d.metadata["Name"] or "").lower().startswith("cupy"))
    return ", ".join(found) or "not installed"


def report() -> str:
    """The lines that ``python -m tensorplay_mpi.info`` prints."""
    aware, why = cuda_aware()
    vendor, version = MPI.get_vendor()
    lines = {
        "tensorplay_mpi": __version__,
        "MPI library": MPI.Get_library_version().splitlines()[0].strip(),
        "MPI vendor": f"{vendor} {'.'.join(map(str, version))}",
        "MPI standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "cupy": _cupy_version(),
        "ranks": str(MPI.COMM_WORLD.Get_size()),
        "CUDA-aware": f"{'yes' if aware else 'no'} ({why})",
    }
    return "\n".join(f"{key:>15}: {value}" for key, value in lines.items())


if __name__ == "__main__":
    print(report())
