"""torch optimizer and scheduler state as arrays, for checkpoints: no pickle, bitwise.

A torch ``state_dict()`` is a tree of dicts, lists and tuples holding tensors, numbers,
strings, booleans and None.  :func:`state_arrays` turns it into flat NumPy arrays under one
prefix: every tensor becomes an array of its dtype (``"PREFIX/3"``; bfloat16, which NumPy
lacks, its bits as int16, marked in the tree), the tree around them one
JSON string (``"PREFIX/tree"``), in which floats round-trip exactly.  These are what
:func:`tensorplay_mpi.checkpoint.save` takes as `extra` and loads without pickle;
:func:`load_state_arrays` rebuilds the state dict and loads it::

    from tensorplay_mpi import checkpoint
    from tensorplay_mpi.checkpoint import _torch_state as torch_state

    extra = {**torch_state.state_arrays(opt, "opt"), **torch_state.state_arrays(sched, "sched")}
    checkpoint.save(directory, model.parameters(), buffers=model.buffers(), extra=extra, ...)
    ...
    resumed = checkpoint.load(directory, model.parameters(), buffers=model.buffers())
    if resumed is not None:
        torch_state.load_state_arrays(opt, resumed.extra, "opt")
        torch_state.load_state_arrays(sched, resumed.extra, "sched")

State on a CUDA device is saved from a host copy; ``load_state_dict`` moves it back to the
parameters' device, as torch does.  torch is looked up in ``sys.modules`` (a caller with a torch
optimizer has imported it).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Callable, Mapping

import numpy as np

from ..comm._buffers import is_device_array
from ..comm._tensors import host_array
from ._meta import PerRank, extra_array


def state_arrays(obj: Any, prefix: str) -> dict[str, np.ndarray]:
    """``obj.state_dict()`` as arrays under `prefix` (``"PREFIX/tree"``, ``"PREFIX/0"``, ...).

    Parameters
    ----------
    obj : object with ``state_dict()``
        A torch optimizer or learning-rate scheduler (any object whose state dict holds
        tensors, numbers, strings, booleans, None, and dicts, lists and tuples of them).
    prefix : str
        The name under which the arrays go; one per object saved in the same checkpoint.

    Returns
    -------
    dict of str to numpy.ndarray
        Copies: later steps do not change them.

    Raises
    ------
    TypeError
        For an `obj` without ``state_dict()``; for a value that is none of the above (a
        function a scheduler kept, say: construct
        the scheduler with it again and it is not state), or a tensor NumPy cannot hold
        (complex with the conjugate bit set, say), naming where it is in the state dict.
        bfloat16 tensors are saved as their bits (int16) and loaded as bfloat16.
    """
    _check_prefix(prefix)
    _check_stateful(obj, "state_dict")
    arrays: dict[str, np.ndarray] = {}
    tree = encode_tree(obj.state_dict(), arrays, prefix, "state_dict()")
    arrays[f"{prefix}/tree"] = np.array(json.dumps(tree, allow_nan=True))
    return arrays


def load_state_arrays(obj: Any, arrays: Mapping[str, np.ndarray], prefix: str) -> None:
    """Rebuild the state dict :func:`state_arrays` saved under `prefix`; ``obj.load_state_dict``.

    Raises
    ------
    KeyError
        If `arrays` (``resumed.extra``) hold nothing under `prefix`, naming the prefixes found.
    TypeError
        For an `obj` without ``load_state_dict()``.
    """
    _check_prefix(prefix)
    key = f"{prefix}/tree"
    if key not in arrays:
        found = sorted({k.rsplit("/", 1)[0] for k in arrays if k.endswith("/tree")})
        raise KeyError(f"no torch state saved under {prefix!r} (found: {found})")
    _check_stateful(obj, "load_state_dict")
    tree = json.loads(str(arrays[key]))
    obj.load_state_dict(decode_tree(tree, arrays, prefix))


def _check_stateful(obj: Any, method: str) -> None:
    if not callable(getattr(obj, method, None)):
        raise TypeError(f"expected a torch optimizer or learning-rate scheduler (an object with "
                        f"{method}()), got {type(obj).__name__}")


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty str, got {prefix!r}")


def encode_tree(value: Any, arrays: dict[str, Any], prefix: str, where: str) -> Any:
    """JSON for the tree `value`; its tensors and arrays go into `arrays`, referred to by
    number (``"PREFIX/N"``), a :class:`~tensorplay_mpi.checkpoint.PerRank` leaf (a dict's
    value) as ``PerRank(host array)``.  TypeError, naming `where` in the tree, for what cannot
    be saved without pickle."""
    torch = sys.modules.get("torch")
    if isinstance(value, PerRank):
        host = extra_array(prefix, value.value, where)
        return {"per_rank": _number(arrays, prefix, PerRank(host))}
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:  # NumPy lacks it: its bits, as int16
            host = value.detach().cpu().view(torch.int16).numpy().copy()
            return {"tensor": _number(arrays, prefix, host), "dtype": "bfloat16"}
        try:  # a CUDA tensor: a host copy (torch's load_state_dict moves it back)
            host = value.detach().cpu().numpy().copy()
        except (TypeError, RuntimeError) as error:
            raise TypeError(f"{where} is a torch tensor of dtype {value.dtype}, which NumPy "
                            f"cannot hold ({error})") from None
        return {"tensor": _number(arrays, prefix, host)}
    if isinstance(value, np.ndarray) or is_device_array(value):
        if value.dtype.hasobject:
            raise TypeError(f"{where} is a NumPy array of objects: only numbers can be saved")
        return {"ndarray": _number(arrays, prefix, np.array(host_array(value)))}
    if isinstance(value, np.generic):
        return {"numpy": value.dtype.str, "value": value.item()}
    if isinstance(value, dict):
        items = [[encode_tree(k, arrays, prefix, f"{where} key {k!r}"),
                  encode_tree(v, arrays, prefix, f"{where}[{k!r}]")] for k, v in value.items()]
        return {"dict": items}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        if any(isinstance(v, PerRank) for v in value):
            raise TypeError(f"{where} is a {kind} holding a checkpoint.PerRank value: put "
                            "each rank's own values under the keys of a dict (at another "
                            "world size they are left out of it)")
        return {kind: [encode_tree(v, arrays, prefix, f"{where}[{i}]")
                       for i, v in enumerate(value)]}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{where} = {value!r} ({type(value).__name__}) cannot be saved without "
                    "pickle: only tensors, arrays, numbers, strings, booleans, None, and dicts, "
                    "lists and tuples of them")


def _number(arrays: dict[str, Any], prefix: str, host: Any) -> int:
    """Put `host` in `arrays` under the next number of `prefix`; that number."""
    number = sum(1 for k in arrays if k != f"{prefix}/tree")
    arrays[f"{prefix}/{number}"] = host
    return number


ABSENT = object()
"""What :func:`decode_tree` makes of a per-rank leaf the arrays lack (saved at another world
size): left out of its dict."""


def decode_tree(tree: Any, arrays: Mapping[str, np.ndarray], prefix: str,
                dict_of: Callable[[dict, list, str], dict] | None = None,
                where: str = "") -> Any:
    """The inverse of :func:`encode_tree`: tensors as CPU torch tensors, arrays as NumPy
    arrays.  A per-rank leaf that `arrays` lack is left out of its dict, which `dict_of`
    makes (``dict_of(values, absent_keys, where)``; default: a plain dict)."""
    if not isinstance(tree, dict):
        return tree
    if "per_rank" in tree:
        key = f"{prefix}/{tree['per_rank']}"
        return np.array(arrays[key]) if key in arrays else ABSENT
    if "tensor" in tree:
        torch = sys.modules["torch"]
        tensor = torch.from_numpy(np.array(arrays[f"{prefix}/{tree['tensor']}"]))
        return tensor.view(torch.bfloat16) if tree.get("dtype") == "bfloat16" else tensor
    if "ndarray" in tree:
        return np.array(arrays[f"{prefix}/{tree['ndarray']}"])
    if "numpy" in tree:
        return np.dtype(tree["numpy"]).type(tree["value"])
    if "float" in tree:
        return float(tree["float"])
    if "dict" in tree:
        values, absent = {}, []
        for k, v in tree["dict"]:
            key = decode_tree(k, arrays, prefix, dict_of, where)
            value = decode_tree(v, arrays, prefix, dict_of, f"{where}[{key!r}]")
            if value is ABSENT:
                absent.append(key)
            else:
                values[key] = value
        return dict_of(values, absent, where) if dict_of is not None and absent else values
    kind = "list" if "list" in tree else "tuple"
    items = [decode_tree(v, arrays, prefix, dict_of, f"{where}[{i}]")
             for i, v in enumerate(tree[kind])]
    return items if kind == "list" else tuple(items)
