"""Checkpoints of every rank: ``save`` and ``load`` (:mod:`.store`) of a mapping of state
providers (:mod:`.providers`: objects that give and take their own state, each rank's own
through :class:`PerRank`) or of arrays, what a checkpoint may hold (:mod:`.meta`: arrays that
load without pickle), a torch optimizer's or scheduler's state as arrays (:mod:`.torch_state`)
and a random generator's state as an array (:mod:`.rng`)."""

from .meta import PerRank
from .providers import Consolidated, Stateful
from .rng import rng_state, set_rng_state
from .store import MANIFEST, Resumed, Saved, load, save
from .torch_state import load_state_arrays, state_arrays

__all__ = ["save", "load", "Saved", "Resumed", "MANIFEST", "PerRank", "Stateful",
           "Consolidated", "rng_state", "set_rng_state", "state_arrays", "load_state_arrays"]
