"""State providers: objects that give and take their own state, the mapping form of
:func:`~tensorplay_mpi.checkpoint.save` and :func:`~tensorplay_mpi.checkpoint.load`.

One mapping names everything a run must get back::

    state = {"model": dp, "optimizer": opt, "sampler": sampler, "rng": PerRank(rng)}
    checkpoint.save(directory, state, comm=comm)
    ...
    resumed = checkpoint.load(directory, state, comm=comm)   # every object in place

Each value is one of:

- a provider of its own (:class:`Stateful`): ``state_dict()`` returns a mapping of arrays,
  torch tensors, numbers, strings, booleans, None and dicts, lists and tuples of them, saved as
  rank 0 has it (it must be the same on every rank, as a replicated object's is); a value
  wrapped in :class:`~tensorplay_mpi.checkpoint.PerRank` (a dict's value) is each rank's
  own.  ``load_state_dict`` gets the same mapping back (tensors as CPU tensors, arrays as
  NumPy arrays).  torch modules, optimizers and learning-rate schedulers are providers;
- one of the library's objects, whose state the checkpoint knows how to take: a
  :class:`~tensorplay_mpi.DataParallel` (its parameters and buffers, checked identical on
  every rank, and its ``steps``), an optimizer of the library (a
  :class:`~tensorplay_mpi.ZeroRedundancyOptimizer` saved sharded, one file per rank and
  re-sharded at another world size, or whole with :class:`Consolidated`), a
  :class:`~tensorplay_mpi.data.Sampler` (its epoch, every rank's cursor and its state,
  re-split at another world size), a NumPy or torch random generator;
- ``PerRank(obj)`` of a provider or a generator: all its state is each rank's own;
- a plain value (an array, a tensor, a number, or ``PerRank`` of one), saved as the array
  form's ``extra`` is and read back from ``Resumed.extra`` (``load`` leaves it alone).

At most one DataParallel, one optimizer of the library and one Sampler go in a checkpoint.
A load takes the entries its mapping names (others in the checkpoint are left); an entry the
checkpoint lacks, or saved from another kind of object, is refused on every rank before
anything is loaded.  Per-rank values saved at another world size (``resize=True``) are absent
from the dicts ``load_state_dict`` gets (a per-rank provider's: every key), and reading one
raises ``KeyError`` naming both world sizes; a per-rank generator keeps the state it has.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from typing import Any, Callable, Mapping, NamedTuple, Protocol, runtime_checkable

import numpy as np

from ..optim._protocol import OptimizerState
from ._meta import EVERY_KEY, Absent, PerRank, extra_array
from ._rng import rng_state, set_rng_state
from ._torch_state import decode_tree, encode_tree

_DESCRIBED = {"model": "a DataParallel", "optimizer": "an optimizer of the library",
              "sampler": "a Sampler", "state": "a provider", "per-rank": "a per-rank provider",
              "value": "a plain value"}
_PROVIDED = ("state", "per-rank")  # a provider's own state_dict(), replicated or per rank


@runtime_checkable
class Stateful(Protocol):
    """What a checkpoint asks of an object: its state, given and taken (the protocol of
    ``torch.distributed.checkpoint.stateful.Stateful``; torch modules, optimizers and
    schedulers follow it).

    ``state_dict()`` returns a mapping of arrays (NumPy, CuPy), torch tensors, numbers,
    strings, booleans, None, and dicts, lists and tuples of them; each rank's own values go in
    wrapped in :class:`~tensorplay_mpi.checkpoint.PerRank` (as a dict's values).  The
    rest must be the same on every rank (a save compares digests and refuses, on every rank,
    what differs).  ``load_state_dict(state)`` takes the same mapping back (tensors as CPU
    torch tensors, arrays as NumPy arrays); per-rank values saved at another world size are
    absent from it.
    """

    def state_dict(self) -> Mapping[str, Any]:
        """This object's state."""

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take the state :meth:`state_dict` gave."""


class Consolidated:
    """A :class:`~tensorplay_mpi.ZeroRedundancyOptimizer` saved whole: rank 0 gathers its
    full state (``consolidate_state_dict``) into the manifest, instead of one shard file per
    rank (the default).  A whole state loads into a ZeroRedundancyOptimizer or a local
    optimizer; give the optimizer itself to ``load``.

    Examples
    --------
    ::

        checkpoint.save(directory, {"model": dp, "optimizer": Consolidated(zero)})
    """

    __slots__ = ("optimizer",)

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def __repr__(self) -> str:
        return f"Consolidated({self.optimizer!r})"


class _Generator:
    """A NumPy or torch random generator as a provider (its state: one uint8 array)."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": rng_state(self.generator)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "state" in state:  # else saved per rank at another world size: kept as it is
            set_rng_state(self.generator, state["state"])


def _is_generator(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return (isinstance(value, (np.random.Generator, np.random.BitGenerator,
                               np.random.RandomState))
            or (torch is not None and isinstance(value, torch.Generator)))


def _library_kind(value: Any) -> str | None:
    """``"model"``, ``"optimizer"`` or ``"sampler"`` for the library's objects, else None."""
    from ..data import Sampler
    from ..parallel._data_parallel import DataParallel

    for kind, types in (("model", DataParallel), ("optimizer", (OptimizerState, Consolidated)),
                        ("sampler", Sampler)):
        if isinstance(value, types):
            return kind
    return None


def _provider(key: str, value: Any) -> Any:
    """`value` as a provider (a generator through its adapter), or None for a plain value;
    TypeError for an object that is neither."""
    if _is_generator(value):
        return _Generator(value)
    has = [callable(getattr(value, m, None)) and not isinstance(value, type)
           for m in ("state_dict", "load_state_dict")]
    if all(has):
        return value
    if has[0]:
        raise TypeError(f"state[{key!r}] ({type(value).__name__}) has state_dict() but no "
                        "load_state_dict(): a provider gives and takes its state; add "
                        "load_state_dict(state), or save what it gives as a plain value")
    try:
        extra_array(key, value, f"state[{key!r}]")
    except TypeError as reason:
        raise TypeError(
            f"state[{key!r}] is a {type(value).__name__}: not a state provider (it has no "
            f"state_dict() and load_state_dict()), nor an array, a tensor or a number to save "
            f"as it is ({reason})") from None
    return None


def classify(key: Any, value: Any) -> tuple[str, Any]:
    """`value` of the mapping's `key`: its kind (``"model"``, ``"optimizer"``, ``"sampler"``,
    ``"state"``, ``"per-rank"`` or ``"value"``) and the object that gives its state (for a
    provider, itself or its adapter; for a plain value, the value)."""
    if not isinstance(key, str) or not key or "/" in key:
        raise (TypeError if not isinstance(key, str) else ValueError)(
            f"the state's keys must be non-empty strings without '/', got {key!r}")
    per_rank = isinstance(value, PerRank)
    inner = value.value if per_rank else value
    kind = _library_kind(inner)
    if kind is not None:
        if per_rank:
            raise TypeError(f"state[{key!r}]: checkpoint.PerRank({type(inner).__name__}): "
                            f"{_DESCRIBED[kind]} keeps its own per-rank state; give it as it is")
        return kind, inner
    if per_rank and isinstance(inner, type):
        raise TypeError(f"state[{key!r}]: checkpoint.PerRank wraps an array, a tensor or a "
                        f"number, or a provider (state_dict() and load_state_dict()); got the "
                        f"class {inner.__name__}")
    provider = _provider(key, inner)
    if provider is None:
        return "value", value
    return ("per-rank" if per_rank else "state"), provider


# -- save ----------------------------------------------------------------------------------------


class Contents(NamedTuple):
    """What a save writes, in either form (the mapping form's `entries`: each key's kind)."""

    params: Any = ()
    buffers: Any = ()
    optimizer: Any = None
    zero: str = "sharded"
    step: int = 0
    epoch: int = 0
    cursor: int = 0
    extra: Mapping[str, Any] | None = None
    entries: dict[str, str] | None = None


def _one(taken: dict[str, str], kind: str, key: str) -> None:
    """Record that `key` holds the checkpoint's one object of `kind`; ValueError for two."""
    if kind in taken:
        raise ValueError(f"state[{key!r}] is a second {_DESCRIBED[kind][2:]} (after "
                         f"state[{taken[kind]!r}]): a checkpoint holds one DataParallel, one "
                         "optimizer of the library and one Sampler; save the others in "
                         "checkpoints of their own")
    taken[kind] = key


def contents(state: Mapping[str, Any]) -> Contents:
    """What the mapping form saves of `state`: calls each provider's ``state_dict()``;
    TypeError or ValueError for an entry that cannot be saved."""
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    entries: dict[str, str] = {}
    taken: dict[str, str] = {}
    for key, value in state.items():
        kind, obj = classify(key, value)
        entries[key] = kind
        if kind in ("model", "optimizer", "sampler"):
            _one(taken, kind, key)
        if kind == "model":
            fields.update(params=obj.params, buffers=obj.buffers, step=obj.steps)
        elif kind == "optimizer":
            whole = isinstance(obj, Consolidated)
            fields.update(optimizer=obj.optimizer if whole else obj,
                          zero="consolidated" if whole else "sharded")
        elif kind == "sampler":
            fields.update(epoch=obj.epoch, cursor=obj.cursor)
            extra[key] = obj.state()
        elif kind in _PROVIDED:
            extra.update(_encoded(key, obj, kind == "per-rank"))
        else:
            extra[key] = value
    return Contents(**fields, extra=extra, entries=entries)


def _encoded(key: str, provider: Any, per_rank: bool) -> dict[str, Any]:
    """The arrays of `provider`'s state under ``KEY/tree`` (its JSON) and ``KEY/N``; each
    rank's own as PerRank (all of them for a `per_rank` provider)."""
    tree = provider.state_dict()
    if not isinstance(tree, Mapping):
        raise TypeError(f"state[{key!r}].state_dict() returned a {type(tree).__name__}, not a "
                        "mapping")
    arrays: dict[str, Any] = {}
    encoded = encode_tree(tree, arrays, key, f"state[{key!r}].state_dict()")
    arrays[f"{key}/tree"] = np.array(json.dumps(encoded, allow_nan=True))
    if per_rank:
        return {k: v if isinstance(v, PerRank) else PerRank(v) for k, v in arrays.items()}
    return arrays


# -- load ----------------------------------------------------------------------------------------


class Plan:
    """What a load fills: the arrays and the optimizer the store loads, and in the mapping
    form (`entries` not None) each entry's kind and object."""

    def __init__(self, params: Any = (), buffers: Any = (), optimizer: Any = None,
                 entries: dict[str, tuple[str, Any]] | None = None) -> None:
        self.params, self.buffers, self.optimizer = params, buffers, optimizer
        self.entries = entries

    @property
    def partial(self) -> bool:
        """Whether entries the checkpoint holds may be left unloaded (the mapping form)."""
        return self.entries is not None

    @property
    def model(self) -> Any:
        return next((obj for kind, obj in (self.entries or {}).values() if kind == "model"),
                    None)

    def prepare(self, meta: dict, extra: Mapping[str, np.ndarray],
                size: int) -> list[Callable[[], None]]:
        """Check every entry against the checkpoint (`meta`, the manifest's; `extra`, this
        rank's extra arrays) and decode its state; the calls that load them, in the
        mapping's order.  ValueError for an entry the checkpoint lacks or holds of another
        kind, or a Sampler it cannot resume."""
        saved_kinds = meta.get("providers")
        loads: list[Callable[[], None]] = []
        for key, (kind, obj) in (self.entries or {}).items():
            if kind == "value":
                continue
            if saved_kinds is not None:
                _check_entry(key, kind, obj, saved_kinds)
            saved = (saved_kinds or {}).get(key, kind)
            if kind == "model":
                loads.append(functools.partial(setattr, obj, "steps", int(meta["step"])))
            elif kind == "sampler":
                loads.append(_sampler_load(obj, meta, extra.get(key)))
            elif kind in _PROVIDED:
                loads.append(functools.partial(obj.load_state_dict, _decoded(
                    key, saved, extra, meta["world_size"], size)))
        return loads

    def plain(self, meta: dict) -> Callable[[str], bool]:
        """Whether an extra key of the checkpoint is a plain value (the array form's extra,
        or a plain entry of the mapping form), not part of an entry's state."""
        if self.entries is None:
            return lambda key: True
        taken = {key for key, (kind, _) in self.entries.items() if kind != "value"}
        taken |= {k for k, kind in (meta.get("providers") or {}).items() if kind != "value"}
        return lambda key: key.split("/", 1)[0] not in taken


def plan(state: Mapping[str, Any]) -> Plan:
    """What the mapping form loads into the objects of `state`; TypeError or ValueError for
    an entry that cannot take a state."""
    entries: dict[str, tuple[str, Any]] = {}
    taken: dict[str, str] = {}
    fields: dict[str, Any] = {}
    for key, value in state.items():
        kind, obj = classify(key, value)
        if kind in ("model", "optimizer", "sampler"):
            _one(taken, kind, key)
        if kind == "optimizer":
            obj = obj.optimizer if isinstance(obj, Consolidated) else obj
            fields["optimizer"] = obj
        elif kind == "model":
            fields.update(params=obj.params, buffers=obj.buffers)
        entries[key] = (kind, obj)
    return Plan(**fields, entries=entries)


def _check_entry(key: str, kind: str, obj: Any, saved_kinds: Mapping[str, str]) -> None:
    if key not in saved_kinds:
        raise ValueError(f"the checkpoint holds no state for {key!r} (it holds "
                         f"{sorted(saved_kinds)}): leave it out of the mapping to start it "
                         "afresh, or load another checkpoint")
    saved = saved_kinds[key]
    if saved != kind and not (saved in _PROVIDED and kind in _PROVIDED):
        raise ValueError(f"state[{key!r}] was saved from {_DESCRIBED[saved]}, given a "
                         f"{type(obj).__name__}")


def _sampler_load(sampler: Any, meta: dict, state: Any) -> Callable[[], None]:
    """The call that resumes `sampler` from the checkpoint, tried first on a copy (so that a
    Sampler that cannot resume is refused before anything is loaded)."""
    epoch, cursors = int(meta["epoch"]), meta["cursors"]
    copy.deepcopy(sampler).resume(epoch, cursors, state)
    return functools.partial(sampler.resume, epoch, cursors, state)


def _decoded(key: str, saved: str, extra: Mapping[str, np.ndarray], saved_size: int,
             size: int) -> Any:
    """The state of provider `key` as its ``state_dict()`` gave it (`saved`: its kind)."""
    where = f"state[{key!r}]"
    if f"{key}/tree" not in extra:
        if saved == "per-rank" and saved_size != size:  # its every value belongs to a rank
            return Absent({}, EVERY_KEY, saved_size, size, where)
        raise ValueError(f"the checkpoint holds no state for {key!r} (no {key}/tree among its "
                         f"arrays): leave it out of the mapping, or load another checkpoint")
    tree = json.loads(str(extra[f"{key}/tree"]))
    return decode_tree(tree, extra, key, lambda values, absent, at: Absent(
        values, absent, saved_size, size, f"{where}{at}"))
