"""Which MPI, BLAS, GPU and CUDA-awareness every rank sees: one table, printed by rank 0.

Run ``python -m tensorplay_mpi.info``, or under the launcher of the job
(``mpiexec -n 4 python -m tensorplay_mpi.info``, ``srun --mpi=pmi2 python -m tensorplay_mpi.info``):
every rank reports, and rank 0 prints one row per rank.  A launch that started every task as a
singleton gets the same warning, with the same fix, as a Join would raise.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from typing import Any

import mpi4py
import numpy as np
from mpi4py import MPI

from . import __version__
from .comm._buffers import cuda_aware, loaded_libmpi
from .comm._fault_tolerance import fault_tolerance
from ._process import check_launch
from ._threads import decision, limit_threads

__all__ = ["report"]

COLUMNS = ("rank", "host", "pid", "GPU", "libmpi", "MPI version", "thread level", "mpi4py",
           "BLAS (threads)", "CUDA-aware")
_THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


def _cupy_version() -> str:
    """Installed CuPy distributions, read from their metadata (CuPy is not imported)."""
    found = sorted(f"{d.metadata['Name']} {d.version}" for d in importlib.metadata.distributions()
                   if (d.metadata["Name"] or "").lower().startswith("cupy"))
    return ", ".join(found) or "not installed"


def _gpu() -> str:
    """This rank's current GPU through CuPy, when CuPy is installed (imported only here)."""
    if _cupy_version() == "not installed":
        return "- (CuPy not installed)"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        device = cupy.cuda.Device().id
        name = cupy.cuda.runtime.getDeviceProperties(device)["name"].decode()
    except Exception as error:  # no driver, no device: say so, it is what info is for
        return f"- ({type(error).__name__}: {error})"
    return f"{device} of {count}: {name}"


def _blas() -> str:
    """The BLAS and OpenMP libraries this process loaded, with their thread counts."""
    from threadpoolctl import threadpool_info

    pools = [" ".join(filter(None, (p["internal_api"], p.get("version"))))
             + f" ({p['num_threads']})" for p in threadpool_info()]
    return ", ".join(pools) or "none loaded"


def rank_facts() -> dict[str, Any]:
    """This rank's row of the table (collective: every rank limits its threads first)."""
    limit_threads(MPI.COMM_WORLD, notice=False)  # the report says it, once
    aware, _ = cuda_aware()
    return {
        "rank": MPI.COMM_WORLD.Get_rank(),
        "host": MPI.Get_processor_name(),
        "pid": os.getpid(),
        "GPU": _gpu(),
        "libmpi": ", ".join(loaded_libmpi()) or "?",
        "MPI version": " ".join(MPI.Get_library_version().splitlines()[0].split()),
        "thread level": _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "mpi4py": mpi4py.__version__,
        "BLAS (threads)": _blas(),
        "CUDA-aware": "yes" if aware else "no",
    }


def _table(rows: list[dict[str, Any]]) -> list[str]:
    cells = [[str(row[c]) for c in COLUMNS] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return lines


def report() -> str | None:
    """The text ``python -m tensorplay_mpi.info`` prints: on rank 0, ``None`` elsewhere.

    Collective over ``COMM_WORLD``.
    """
    rows = MPI.COMM_WORLD.gather(rank_facts())
    if rows is None:
        return None
    aware, why = cuda_aware()
    tolerant, tolerance = fault_tolerance()
    vendor, version = MPI.get_vendor()
    try:
        check_launch()
        warning = []
    except RuntimeError as error:
        warning = [f"WARNING: {error}", ""]
    lines = [
        *warning,
        f"tensorplay_mpi {__version__}, numpy {np.__version__}, cupy {_cupy_version()}, "
        f"MPI {vendor} {'.'.join(map(str, version))} (standard "
        "{}.{})".format(*MPI.Get_version()),
        f"ranks: {len(rows)}",
        f"BLAS/OpenMP threads: {decision()}",
        f"CUDA-aware: {'yes' if aware else 'no'} ({why})",
        "fault tolerance (a lost rank reported, ULFM): {} ({})".format(
            "yes" if tolerant else "no", tolerance),
        "",
        *_table(rows),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    text = report()
    if text is not None:
        print(text)
        sys.stdout.flush()
