"""The optimizer protocol: what every optimizer of the library gives a checkpoint, by rank.

:class:`OptimizerState` is implemented by the local optimizers
(:class:`~tensorplay_mpi.optim.Optimizer`: the same state on every rank) and by
:class:`~tensorplay_mpi.optim.ZeroRedundancyOptimizer` (each rank holds the state of its own
shard).  :mod:`tensorplay_mpi.checkpoint` saves and loads either through it alone:

- the full state: :meth:`~OptimizerState.consolidate_state_dict` (collective; nothing to do
  when the state is whole on every rank), then :meth:`~OptimizerState.state_dict` and
  :meth:`~OptimizerState.load_state_dict`;
- this rank's part (:attr:`~OptimizerState.sharded` optimizers save one file per rank):
  :meth:`~OptimizerState.shard_state_dict` and :meth:`~OptimizerState.load_shard_state_dict`,
  and :meth:`~OptimizerState.shard_owners` to re-shard at another world size;
- the checks, before anything is loaded: :meth:`~OptimizerState.check_state_dict`, which
  ``load_state_dict`` runs too.

A state dict is ``{"optimizer", "defaults", "param_groups", "steps", "param_steps", "state":
{i: {name: array}}}``, ``i`` numbering the parameters it holds (a shard's from 0).  The shared
checks of parameters and state live here too (:func:`check_params`, :func:`check_state`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

from ..comm._buffers import check_disjoint
from ..comm._tensors import is_bfloat16


class OptimizerState(ABC):
    """What a checkpoint saves and loads of an optimizer, on every rank.

    Attributes
    ----------
    params : list of arrays
        Every parameter the optimizer updates (on every rank, a sharded optimizer's included).
    defaults, param_groups
        The hyperparameters: the constructor's, and the one group read at each step (for a
        sharded optimizer, those of this rank's shard optimizer).
    """

    params: list[Any]
    defaults: dict[str, Any]
    param_groups: list[dict[str, Any]]

    #: Whether each rank holds the state of its own parameters only (a checkpoint then saves
    #: one file per rank, or consolidates the state first).
    sharded: bool = False

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The full state (a sharded optimizer's after :meth:`consolidate_state_dict`, on the
        rank it gathered to)."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (:meth:`check_state_dict` first; a sharded optimizer takes its
        shard)."""

    @abstractmethod
    def check_state_dict(self, state_dict: dict[str, Any], shard: bool = False,
                         source: str = "the state dict") -> None:
        """Raise ``ValueError`` unless `state_dict` fits this optimizer: its whole state, or
        with `shard` this rank's part of it.  `source` names the state dict in the message."""

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full state on rank `to` (collective over a sharded optimizer's
        communicator); an optimizer whose state is whole on every rank has nothing to do."""

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's part of the state, its parameters numbered from 0 (the whole state,
        unless :attr:`sharded`)."""
        return self.state_dict()

    def load_shard_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`shard_state_dict` gave on this rank at the same world size."""
        self.load_state_dict(state_dict)

    def replicated_state(self) -> list[Any]:
        """The state arrays that are the same on every rank, without copies (a save's
        cross-rank digest covers them); none for a sharded optimizer."""
        return []

    def shard_owners(self, size: int) -> list[int]:
        """The rank whose part holds each parameter's state at world size `size` (the
        partition every rank computes alike); rank 0 for all, unless :attr:`sharded`."""
        return [0] * len(self.params)


def is_writeable(array: Any) -> bool:
    """Whether `array` may be written (CuPy's flags have no such field: always)."""
    return getattr(array.flags, "writeable", True)


def refuse_bfloat16(params: Sequence[Any]) -> list[Any]:
    """`params` as a list; ``TypeError`` for a bfloat16 tensor among them.

    The update rules are NumPy's, and NumPy has no bfloat16 (float16 it has: those run in
    it).  A bfloat16 model keeps a torch optimizer, stepped by DataParallel's ``update=``."""
    params = list(params)
    for i, p in enumerate(params):
        if is_bfloat16(p):
            raise TypeError(
                f"params[{i}] is bfloat16, which NumPy lacks: the library's optimizers (and "
                "ZeroRedundancyOptimizer) step float16, float32 and float64 params; train a "
                "bfloat16 model with a torch optimizer, DataParallel(model.parameters(), "
                "update=opt.step)")
    return params


def check_params(params: list[Any], grads: list[Any]) -> None:
    """Raise unless `params` are writable, C-contiguous floating arrays shaped like `grads`,
    and no two of the params and grads share memory."""
    if len(params) != len(grads):
        raise ValueError(f"got {len(params)} params but {len(grads)} grads")
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.shape != g.shape:
            raise ValueError(f"grads[{i}] has shape {g.shape}, params[{i}] has {p.shape}")
        if p.dtype.kind != "f":
            raise TypeError(f"params[{i}] must be floating point, got {p.dtype}")
        if not (p.flags.c_contiguous and is_writeable(p)):
            raise ValueError(f"params[{i}] must be C-contiguous and writable (it is updated "
                             "in place)")
    check_disjoint(params=params, grads=grads)


def check_state(state_dict: dict[str, Any], optimizer: str, state_names: Sequence[str],
                shapes: Sequence[tuple], source: str) -> None:
    """Raise ``ValueError`` unless `state_dict` is the state of `optimizer` (a class name)
    for parameters of `shapes`: one entry per parameter, each of `state_names` shaped like it.

    `source` names the state dict in the message.
    """
    missing = [key for key in ("optimizer", "state", "defaults", "steps")
               if not isinstance(state_dict, dict) or key not in state_dict]
    if missing:  # a torch.optim state dict ("state", "param_groups"), or none
        raise ValueError(f"{source} is no state dict of this library's optimizers (it lacks "
                         f"{missing}; a torch.optim one has 'state' and 'param_groups' only): "
                         f"load what {optimizer}.state_dict() gave")
    if state_dict["optimizer"] != optimizer:
        raise ValueError(f"{source} holds {state_dict['optimizer']} state, the optimizer is "
                         f"{optimizer}")
    state = state_dict["state"]
    if sorted(state) != list(range(len(shapes))):
        raise ValueError(f"{source} holds optimizer state for parameters {sorted(state)}, "
                         f"the optimizer has {len(shapes)}")
    for i, shape in enumerate(shapes):
        for name in state_names:
            found = getattr(state[i].get(name), "shape", None)
            if found is None or tuple(found) != tuple(shape):
                raise ValueError(f"optimizer state [{i}][{name!r}] has shape {found} in "
                                 f"{source}, expected {tuple(shape)}")
