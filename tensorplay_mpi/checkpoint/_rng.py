"""A random generator's state as a plain array, for a checkpoint's ``extra``.

``checkpoint.save(..., extra={"rng": rng.bit_generator.state})`` cannot work: the state is a
dict, which NumPy would pickle, and checkpoints load without pickle.  :func:`rng_state` gives
the state as a ``uint8`` array that a checkpoint holds; :func:`set_rng_state` puts it back::

    checkpoint.save(directory, params, extra={"rng": rng_state(rng)})
    ...
    resumed = checkpoint.load(directory, params)
    set_rng_state(rng, resumed.extra["rng"])  # the same draws as the run never stopped

A generator of each rank's own (seeded with the rank: a Monte Carlo sweep, dropout masks per
rank) goes in as :class:`~tensorplay_mpi.checkpoint.PerRank`, so that every rank's state
is saved and comes back to its own rank (a plain ``extra`` value is saved as rank 0 has it, and
one that differs across ranks is refused)::

    checkpoint.save(directory, params, extra={"rng": PerRank(rng_state(rng))})
    ...
    set_rng_state(rng, checkpoint.load(directory, params).extra["rng"])  # this rank's own

Both take a NumPy ``Generator``, a NumPy bit generator, a legacy ``RandomState`` or a
``torch.Generator`` (torch is imported only when given one of its generators).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np


def _bit_generator(generator: Any) -> Any:
    """The NumPy object whose ``state`` property holds the state, or None for torch's."""
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator
    if isinstance(generator, (np.random.BitGenerator, np.random.RandomState)):
        return generator
    torch = sys.modules.get("torch")  # a torch generator means torch is loaded
    if torch is not None and isinstance(generator, torch.Generator):
        return None
    raise TypeError(f"expected a numpy.random.Generator, a NumPy bit generator, a RandomState "
                    f"or a torch.Generator, got {type(generator).__name__}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {"__array__": value.tolist(), "dtype": value.dtype.str}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "__array__" in value:
            return np.array(value["__array__"], dtype=value["dtype"])
        return {k: _from_json(v) for k, v in value.items()}
    return value


def rng_state(generator: Any) -> np.ndarray:
    """The state of `generator` as a ``uint8`` array (a copy: later draws do not change it).

    Raises
    ------
    TypeError
        If `generator` is none of the kinds above.
    """
    numpy_side = _bit_generator(generator)
    if numpy_side is None:
        return generator.get_state().numpy().copy()
    state = (numpy_side.get_state(legacy=False) if isinstance(numpy_side, np.random.RandomState)
             else numpy_side.state)
    return np.frombuffer(json.dumps(_jsonable(state)).encode(), dtype=np.uint8).copy()


def set_rng_state(generator: Any, state: np.ndarray) -> None:
    """Give `generator` the state :func:`rng_state` returned (for a generator of the same kind).

    Raises
    ------
    TypeError
        If `generator` is none of the kinds above, or `state` is not a ``uint8`` array.
    ValueError
        If `state` is not the state of a generator of this kind.
    """
    state = np.asarray(state)
    if state.dtype != np.uint8 or state.ndim != 1:
        raise TypeError(f"state must be the 1-d uint8 array rng_state() returned, got "
                        f"{state.dtype} of shape {state.shape}")
    numpy_side = _bit_generator(generator)
    if numpy_side is None:
        import torch  # a torch.Generator was given: torch is loaded

        try:
            generator.set_state(torch.from_numpy(state.copy()))
        except RuntimeError as failed:
            raise ValueError(f"not a state of this torch.Generator: {failed}") from None
        return
    try:
        decoded = _from_json(json.loads(state.tobytes().decode()))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("not a NumPy generator's state (a torch.Generator's?)") from None
    legacy = isinstance(numpy_side, np.random.RandomState)
    name = (numpy_side.get_state(legacy=False) if legacy else numpy_side.state)["bit_generator"]
    if decoded.get("bit_generator") != name:
        raise ValueError(f"the state is one of a {decoded.get('bit_generator')} bit generator, "
                         f"this generator's is {name}")
    if legacy:
        numpy_side.set_state(decoded)
    else:
        numpy_side.state = decoded
