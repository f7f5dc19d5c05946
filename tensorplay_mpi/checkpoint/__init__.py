"""Checkpoints of every rank: ``save`` and ``load`` (:mod:`.store`), what a checkpoint may hold
(:mod:`.meta`: arrays that load without pickle, each rank's own as :class:`PerRank`), a torch
optimizer's or scheduler's state as arrays (:mod:`.torch_state`) and a random generator's state
as an array (:mod:`.rng`)."""

from .meta import PerRank
from .rng import rng_state, set_rng_state
from .store import MANIFEST, Resumed, Saved, load, save
from .torch_state import load_state_arrays, state_arrays

__all__ = ["save", "load", "Saved", "Resumed", "MANIFEST", "PerRank", "rng_state",
           "set_rng_state", "state_arrays", "load_state_arrays"]
