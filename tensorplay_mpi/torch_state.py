"""A torch optimizer's or scheduler's ``state_dict()`` as arrays for a checkpoint: the path
:mod:`tensorplay_mpi.checkpoint.torch_state` had before the package's folders."""

from .checkpoint.torch_state import load_state_arrays, state_arrays

__all__ = ["state_arrays", "load_state_arrays"]
