"""Checkpoints of every rank: ``save`` and ``load`` of a mapping of state providers (objects that
give and take their own state: ``Stateful``, the library's joinables and optimizers, a
``Consolidated`` ZeRO optimizer, each rank's own values through ``PerRank``) or of arrays; and
the codecs for what a checkpoint holds as arrays: a torch optimizer's or scheduler's
``state_dict()`` (``state_arrays``, ``load_state_arrays``) and a random generator's state
(``rng_state``, ``set_rng_state``)."""

from ._meta import PerRank
from ._providers import Consolidated, Stateful
from ._rng import rng_state, set_rng_state
from ._store import MANIFEST, Resumed, Saved, load, save
from ._torch_state import load_state_arrays, state_arrays

__all__ = ["save", "load", "Saved", "Resumed", "MANIFEST", "PerRank", "Stateful", "Consolidated",
           "rng_state", "set_rng_state", "state_arrays", "load_state_arrays"]
