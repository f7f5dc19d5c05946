"""The predefined MPI reductions by name: what signatures and announcements can describe."""

from __future__ import annotations

from mpi4py import MPI

OPS = ("SUM", "PROD", "MAX", "MIN", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR")
"""The predefined reductions by name."""


def op_name(op: MPI.Op) -> str | None:
    """The name of a predefined reduction from :data:`OPS`, else ``None``."""
    return next((name for name in OPS if op == getattr(MPI, name)), None)
