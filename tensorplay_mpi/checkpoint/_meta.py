"""What a checkpoint may hold: arrays that load without pickle, each rank's own arrays
(:class:`PerRank`), and the run's configuration.

:func:`tensorplay_mpi.checkpoint.save` calls :func:`check_savable`, :func:`split_extra` and
:func:`encode_config` on every rank before it writes anything, so a value that
:func:`~tensorplay_mpi.checkpoint.load` would reject is refused on every rank and the previous
checkpoint stays whole; :func:`check_config` is the load's comparison of the configuration.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np

from ..comm._tensors import host_array
from ..comm._digests import array_digest

SAVABLE_KINDS = "biufcUS"
"""NumPy dtype kinds a checkpoint holds (bool, integers, floats, complex, strings): those that
``np.load(allow_pickle=False)`` reads back exactly."""


class PerRank:
    """A value that is this rank's own (a random generator's state, a rank's partial tally):
    every rank's is saved, and :func:`~tensorplay_mpi.checkpoint.load` gives each rank back its
    own.

    It wraps an ``extra`` value of the array form (it comes back, as an array, under the same
    key of ``Resumed.extra``), a value in a provider's ``state_dict()`` (under its key of the
    dict ``load_state_dict`` gets), or a whole provider of the mapping form
    (``{"rng": PerRank(generator)}``: all its state is this rank's own).

    A plain value is saved as rank 0 has it, and one that differs across ranks is refused; a
    key is per-rank on every rank or on none.  At another world size
    (``load(..., resize=True)``) no per-rank value comes back: a rank's value belongs to a
    rank of the saving run, so its key is absent (from ``Resumed.extra``, from the dict a
    provider's ``load_state_dict`` gets, every key of a per-rank provider's), and reading it
    raises ``KeyError`` saying so (``key in state`` tells a program to start it afresh).

    Parameters
    ----------
    value : array-like or provider
        A NumPy or CuPy array, a torch tensor or a number, of a kind a checkpoint holds (bool,
        integer, float, complex or string), its shape free per rank; or, in the mapping form,
        an object with ``state_dict()`` and ``load_state_dict()`` or a random generator.

    Examples
    --------
    ::

        extra = {"rng": checkpoint.PerRank(checkpoint.rng_state(rng))}  # each rank's own
        checkpoint.save(directory, params, extra=extra)
        ...
        resumed = checkpoint.load(directory, params)
        checkpoint.set_rng_state(rng, resumed.extra["rng"])  # this rank's generator

    In the mapping form the generator itself goes in::

        checkpoint.save(directory, {"model": dp, "rng": checkpoint.PerRank(rng)})
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


def _kind_error(where: str, dtype: np.dtype) -> TypeError:
    hint = (" (an object array: NumPy would pickle it, and load refuses pickled data; save an "
            "RNG's state with tensorplay_mpi.checkpoint.rng_state(generator), other state as "
            "numeric arrays)" if dtype.kind == "O" else "")
    return TypeError(f"cannot save {where}: dtype {dtype} is not one a checkpoint loads back "
                     f"(bool, integer, float, complex or string arrays){hint}")


def check_savable(params: Sequence[Any], buffers: Sequence[Any],
                  extra: Mapping[str, Any] | None) -> None:
    """Raise TypeError unless every array would load back without pickle.

    `params` and `buffers` are checked by dtype (no copy); each value of `extra` is converted as
    the save converts it (``np.asarray``), so a dict, a list of objects or ``None`` is refused.
    """
    for name, arrays in (("params", params), ("buffers", buffers)):
        for i, array in enumerate(arrays):
            dtype = np.dtype(getattr(array, "dtype", object))
            if dtype.kind not in SAVABLE_KINDS or dtype.fields is not None:
                raise _kind_error(f"{name}[{i}]", dtype)
    split_extra(extra)


def extra_array(key: str, value: Any, where: str | None = None) -> np.ndarray:
    """`value` of ``extra[key]`` (or at `where` in a provider's state) as the host array a
    checkpoint holds; TypeError if it is not one that loads back without pickle."""
    if not isinstance(key, str):
        raise TypeError(f"extra keys must be strings, got {type(key).__name__} {key!r}")
    where = where or f"extra[{key!r}]"
    try:
        array = host_array(value)  # a device array's or torch CUDA tensor's host copy
    except (TypeError, ValueError) as failed:  # ragged sequences, say
        raise TypeError(f"cannot save {where} ({type(value).__name__}) as an array: "
                        f"{failed}") from None
    if array.dtype.kind not in SAVABLE_KINDS or array.dtype.fields is not None:
        raise _kind_error(f"{where} ({type(value).__name__})", array.dtype)
    return array


def split_extra(extra: Mapping[str, Any] | None
                ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """`extra` as host arrays: those saved as rank 0 has them, and this rank's own (the values
    wrapped in :class:`PerRank`); TypeError for a key that is not a string or a value that
    would not load back without pickle (a dict, a list of objects, ``None``)."""
    shared: dict[str, np.ndarray] = {}
    own: dict[str, np.ndarray] = {}
    for key, value in (extra or {}).items():
        if isinstance(value, PerRank):
            own[key] = extra_array(key, value.value)
        else:
            shared[key] = extra_array(key, value)
    return shared, own


def extra_digests(shared: Mapping[str, np.ndarray], own: Mapping[str, np.ndarray]
                  ) -> tuple[int, int]:
    """Two int64 digests that every rank's save compares: of the keys (which are per-rank),
    and of the values saved as rank 0 has them."""
    layout = np.array(json.dumps([sorted(shared), sorted(own)]))
    return array_digest([layout]), array_digest([shared[key] for key in sorted(shared)])


def value_digests(shared: Mapping[str, np.ndarray]) -> np.ndarray:
    """One int64 digest per value saved as rank 0 has it (in the order of the sorted keys): a
    save gathers them to name the values that differ, once the keys agree."""
    return np.array([array_digest([shared[key]]) for key in sorted(shared)], dtype=np.int64)


def groups(values: np.ndarray) -> list[list[int]]:
    """The ranks, grouped by equal value (a gathered digest)."""
    found: dict[int, list[int]] = {}
    for rank, value in enumerate(values.tolist()):
        found.setdefault(int(value), []).append(rank)
    return list(found.values())


def check_extra(layouts: np.ndarray, values: np.ndarray, shared: Mapping[str, Any],
                own: Mapping[str, Any], differing: Sequence[str] = (),
                entries: bool = False) -> None:
    """Raise ValueError unless every rank's :func:`extra_digests` (gathered: `layouts`,
    `values`) agree: rank 0's plain values are saved, and only they.  `differing` names the
    values that differ; with `entries` they are entries of the mapping form's state."""
    if (layouts != layouts[0]).any():
        if entries:
            raise ValueError(
                f"ranks gave different state entries, or per-rank ones on some ranks only (the "
                f"same within each of {groups(layouts)}): give the same keys on every rank, "
                "and wrap an entry or value that is each rank's own in checkpoint.PerRank on "
                "every rank")
        raise ValueError(
            f"ranks passed different extra keys, or marked other keys per rank (the same "
            f"within each of {groups(layouts)}; this rank's plain keys {sorted(shared)}, "
            f"per-rank keys {sorted(own)}): pass the same keys on every rank, each rank's own "
            "values wrapped in checkpoint.PerRank on every rank")
    if (values != values[0]).any():
        if entries:
            raise ValueError(
                f"state {list(differing)} differ(s) across ranks (the same within each of "
                f"{groups(values)}), and a checkpoint keeps rank 0's: return a value that is "
                "each rank's own from state_dict() wrapped in checkpoint.PerRank(...), wrap an "
                "entry that is all each rank's own (a per-rank generator) in "
                "checkpoint.PerRank(obj), or keep the state the same on every rank")
        raise ValueError(
            f"extra values differ across ranks (the same within each of {groups(values)}; "
            f"keys {list(differing) or sorted(shared)}), and a checkpoint keeps rank 0's: wrap "
            "a value that is each rank's own (a random generator's state, say) in "
            "checkpoint.PerRank(...), which comes back to its own rank, or pass the same value "
            "on every rank")


EVERY_KEY = None
"""``absent`` of :class:`Absent` for a provider saved per rank: every key is absent."""


class Absent(dict):
    """A dict of what a load read, without the values saved per rank at another world size:
    reading one of those (`absent`, or with :data:`EVERY_KEY` any key) raises KeyError
    saying why.  ``Resumed.extra``, and the dicts a provider's ``load_state_dict`` gets."""

    def __init__(self, values: Mapping[Any, Any], absent: Sequence[Any] | None,
                 saved: int, size: int, where: str = "extra") -> None:
        super().__init__(values)
        self._absent = None if absent is EVERY_KEY else set(absent)
        self._sizes, self._where = (saved, size), where

    def __missing__(self, key: Any) -> Any:
        if self._absent is not None and key not in self._absent:
            raise KeyError(key)
        saved, size = self._sizes
        raise KeyError(
            f"{self._where}[{key!r}] was saved per rank (checkpoint.PerRank) at {saved} ranks "
            f"and this job has {size}: each value belongs to a rank of that run, so none comes "
            f"back; resume at {saved} ranks to get them, or start this value afresh (reseed a "
            "generator, say) when the key is not in the mapping")


def resumed_extra(shared: Mapping[str, np.ndarray], own: Mapping[str, np.ndarray],
                  per_rank: Sequence[str], saved: int, size: int) -> dict[str, np.ndarray]:
    """The ``extra`` of a load at `size` ranks of a checkpoint saved at `saved`: the `shared`
    values and this rank's `own` ones (read at the same world size, else none of the
    `per_rank` keys: reading one raises KeyError naming the world sizes)."""
    return Absent({**shared, **own}, [] if saved == size else per_rank, saved, size)


def _plain(value: Any, where: str) -> Any:
    """`value` as JSON data: numbers, strings, booleans, None, lists and string-keyed dicts."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(f"config {where} = {value!r} ({type(value).__name__}) cannot be recorded: "
                    "use numbers, strings, booleans, None, and lists or dicts of them")


def encode_config(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The configuration as the manifest records it (JSON data), or None; raise TypeError for
    a value that is not plain data."""
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping (say, vars(args)), got "
                        f"{type(config).__name__}")
    return {str(k): _plain(v, repr(k)) for k, v in config.items()}


def check_config(saved: dict[str, Any] | None, config: Mapping[str, Any] | None) -> None:
    """Raise ValueError naming every key whose value differs between the checkpoint's recorded
    configuration (`saved`) and `config`; nothing to check when `config` is None."""
    if config is None:
        return
    now = encode_config(config)
    assert now is not None  # config is not None
    if saved is None:
        raise ValueError(f"the checkpoint records no configuration (it was saved without "
                         f"config=), so it cannot be checked against {sorted(now)}: load it "
                         "with config=None if it fits")
    missing = object()
    differ = []
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key, missing), now.get(key, missing)
        if json.dumps(old, sort_keys=True, default=str) != json.dumps(new, sort_keys=True,
                                                                       default=str):
            shown = ["(absent)" if v is missing else json.dumps(v) for v in (old, new)]
            differ.append(f"{key}: saved {shown[0]}, now {shown[1]}")
    if differ:
        raise ValueError(f"the checkpoint was saved with another configuration ({'; '.join(differ)}"
                         "); resume with the saved values, or start afresh in another directory")
