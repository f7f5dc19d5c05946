"""What a checkpoint may hold: arrays that load without pickle, and the run's configuration.

:func:`tensorplay_mpi.checkpoint.save` calls :func:`check_savable` and :func:`encode_config` on
every rank before it writes anything, so a value that :func:`~tensorplay_mpi.checkpoint.load`
would reject is refused on every rank and the previous checkpoint stays whole;
:func:`check_config` is the load's comparison of the configuration.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np

from ..comm.tensors import host_array

__all__ = ["SAVABLE_KINDS", "check_savable", "encode_config", "check_config"]

SAVABLE_KINDS = "biufcUS"
"""NumPy dtype kinds a checkpoint holds (bool, integers, floats, complex, strings): those that
``np.load(allow_pickle=False)`` reads back exactly."""


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
    for key, value in (extra or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"extra keys must be strings, got {type(key).__name__} {key!r}")
        try:
            array = host_array(value)  # a device array's or torch CUDA tensor's host copy
        except (TypeError, ValueError) as failed:  # ragged sequences, say
            raise TypeError(f"cannot save extra[{key!r}] ({type(value).__name__}) as an array: "
                            f"{failed}") from None
        if array.dtype.kind not in SAVABLE_KINDS or array.dtype.fields is not None:
            raise _kind_error(f"extra[{key!r}] ({type(value).__name__})", array.dtype)


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
