"""A random generator's state as an array for a checkpoint: the path
:mod:`tensorplay_mpi.checkpoint.rng` had before the package's folders (also
``from tensorplay_mpi.checkpoint import rng_state, set_rng_state``)."""

from .checkpoint.rng import rng_state, set_rng_state

__all__ = ["rng_state", "set_rng_state"]
