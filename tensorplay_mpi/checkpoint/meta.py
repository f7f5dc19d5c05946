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

from ..comm.tensors import host_array
from ..replicas import digest

__all__ = ["SAVABLE_KINDS", "PerRank", "check_savable", "split_extra", "extra_digests",
           "check_extra", "resumed_extra", "groups", "encode_config", "check_config"]

SAVABLE_KINDS = "biufcUS"
"""NumPy dtype kinds a checkpoint holds (bool, integers, floats, complex, strings): those that
``np.load(allow_pickle=False)`` reads back exactly."""


class PerRank:
    """A value of :func:`~tensorplay_mpi.checkpoint.save`'s ``extra`` that is this rank's own
    (a random generator's state, a rank's partial tally): every rank's is saved, and
    :func:`~tensorplay_mpi.checkpoint.load` gives each rank back its own, as an array, under
    the same key of ``Resumed.extra``.

    A plain ``extra`` value is saved as rank 0 has it, and one that differs across ranks is
    refused; a key is per-rank on every rank or on none.  At another world size
    (``load(..., resize=True)``) no per-rank value comes back: a rank's value belongs to a
    rank of the saving run, so the key is absent from ``Resumed.extra``, and reading it raises
    ``KeyError`` saying so (``key in resumed.extra`` tells a program to start it afresh).

    Parameters
    ----------
    value : array-like
        A NumPy or CuPy array or a torch tensor of a kind a checkpoint holds (bool, integer,
        float, complex or string), its shape free per rank.

    Examples
    --------
    ::

        extra = {"rng": checkpoint.PerRank(checkpoint.rng_state(rng))}  # each rank's own
        checkpoint.save(directory, params, extra=extra)
        ...
        resumed = checkpoint.load(directory, params)
        checkpoint.set_rng_state(rng, resumed.extra["rng"])  # this rank's generator
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


def _extra_array(key: str, value: Any) -> np.ndarray:
    """`value` of ``extra[key]`` as the host array a checkpoint holds; TypeError if it is not
    one that loads back without pickle."""
    if not isinstance(key, str):
        raise TypeError(f"extra keys must be strings, got {type(key).__name__} {key!r}")
    try:
        array = host_array(value)  # a device array's or torch CUDA tensor's host copy
    except (TypeError, ValueError) as failed:  # ragged sequences, say
        raise TypeError(f"cannot save extra[{key!r}] ({type(value).__name__}) as an array: "
                        f"{failed}") from None
    if array.dtype.kind not in SAVABLE_KINDS or array.dtype.fields is not None:
        raise _kind_error(f"extra[{key!r}] ({type(value).__name__})", array.dtype)
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
            own[key] = _extra_array(key, value.value)
        else:
            shared[key] = _extra_array(key, value)
    return shared, own


def extra_digests(shared: Mapping[str, np.ndarray], own: Mapping[str, np.ndarray]
                  ) -> tuple[int, int]:
    """Two int64 digests that every rank's save compares: of the keys (which are per-rank),
    and of the values saved as rank 0 has them."""
    layout = np.array(json.dumps([sorted(shared), sorted(own)]))
    return digest([layout]), digest([shared[key] for key in sorted(shared)])


def groups(values: np.ndarray) -> list[list[int]]:
    """The ranks, grouped by equal value (a gathered digest)."""
    found: dict[int, list[int]] = {}
    for rank, value in enumerate(values.tolist()):
        found.setdefault(int(value), []).append(rank)
    return list(found.values())


def check_extra(layouts: np.ndarray, values: np.ndarray, shared: Mapping[str, Any],
                own: Mapping[str, Any]) -> None:
    """Raise ValueError unless every rank's :func:`extra_digests` (gathered: `layouts`,
    `values`) agree: rank 0's plain values are saved, and only they."""
    if (layouts != layouts[0]).any():
        raise ValueError(
            f"ranks passed different extra keys, or marked other keys per rank (the same "
            f"within each of {groups(layouts)}; this rank's plain keys {sorted(shared)}, "
            f"per-rank keys {sorted(own)}): pass the same keys on every rank, each rank's own "
            "values wrapped in checkpoint.PerRank on every rank")
    if (values != values[0]).any():
        raise ValueError(
            f"extra values differ across ranks (the same within each of {groups(values)}; "
            f"keys {sorted(shared)}), and a checkpoint keeps rank 0's: wrap a value that is "
            "each rank's own (a random generator's state, say) in checkpoint.PerRank(...), "
            "which comes back to its own rank, or pass the same value on every rank")


class _Extra(dict):
    """``Resumed.extra``: a per-rank value saved at another world size is absent, and reading
    it raises KeyError saying why."""

    def __init__(self, arrays: Mapping[str, np.ndarray], absent: Sequence[str],
                 saved: int, size: int) -> None:
        super().__init__(arrays)
        self._absent, self._sizes = set(absent), (saved, size)

    def __missing__(self, key: str) -> np.ndarray:
        if key not in self._absent:
            raise KeyError(key)
        saved, size = self._sizes
        raise KeyError(
            f"extra[{key!r}] was saved per rank (checkpoint.PerRank) at {saved} ranks and this "
            f"job has {size}: each value belongs to a rank of that run, so none comes back; "
            f"resume at {saved} ranks to get them, or start this value afresh (reseed a "
            "generator, say) when the key is not in resumed.extra")


def resumed_extra(shared: Mapping[str, np.ndarray], own: Mapping[str, np.ndarray],
                  per_rank: Sequence[str], saved: int, size: int) -> dict[str, np.ndarray]:
    """The ``extra`` of a load at `size` ranks of a checkpoint saved at `saved`: the `shared`
    values and this rank's `own` ones (read at the same world size, else none of the
    `per_rank` keys: reading one raises KeyError naming the world sizes)."""
    return _Extra({**shared, **own}, [] if saved == size else per_rank, saved, size)


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
