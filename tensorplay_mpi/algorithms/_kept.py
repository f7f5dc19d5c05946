"""A JoinableComm's kept arrays (``jc.keep``): the state every rank keeps current, joined ranks
included.  An operation that uses one announces ``slot << 2 | mode`` (mode :data:`OUT`: the
array receives the result, :data:`INTO`: it accumulates it with the op's ufunc), so a joined
rank applies the same result to its own array; the arrays and the count of results applied are
the JoinableComm's elastic state."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm._ops import OPS
from ..comm._tensors import as_array
from . import _announcements as wire

OUT, INTO = 1, 2  # a kept array's use: receives the result, accumulates it
ACCUMULATE = {"SUM": np.add, "PROD": np.multiply, "MAX": np.maximum, "MIN": np.minimum,
              "LAND": np.logical_and, "LOR": np.logical_or, "LXOR": np.logical_xor,
              "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}
"""What ``into=`` does with a result, per op: the op's NumPy ufunc (NaN: as ``np.maximum``)."""


class KeptArrays:
    """The kept arrays of one JoinableComm, by slot, and the count of results applied."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []  # host views, by slot
        self.given: list[Any] = []  # what the caller passed (arrays or tensors): held, so
        self._slots: dict[int, int] = {}  # their ids stay theirs; id -> slot
        self.updates = np.zeros(1, np.int64)  # results applied (settled in place)
        self.used = False  # a kept array was used in this iteration (of an elastic Join)

    def __bool__(self) -> bool:
        return bool(self.arrays)

    def views(self, arrays: tuple) -> tuple[list[np.ndarray], Exception | None]:
        """The host views of `arrays` to keep, and what this rank refuses of them (checked
        before every rank agrees: :meth:`add` then)."""
        views: list[np.ndarray] = []
        try:
            if not arrays:
                raise TypeError("keep() needs at least one array")
            for i, given in enumerate(arrays):
                views.append(_keepable(given, f"kept array {len(self.arrays) + i}"))
                if id(given) in self._slots or any(
                        np.may_share_memory(views[-1], other)
                        for other in [*self.arrays, *views[:-1]]):
                    raise ValueError(f"kept array {len(self.arrays) + i} is kept already, or "
                                     "shares memory with a kept array")
        except (TypeError, ValueError) as error:
            return views, error
        return views, None

    def add(self, arrays: tuple, views: list[np.ndarray]) -> None:
        """Keep `arrays` (as their `views`) in the next slots."""
        for given, view in zip(arrays, views):
            slot = len(self.arrays)
            self.arrays.append(view)
            self.given.append(given)
            self._slots[id(given)] = self._slots[id(view)] = slot

    def slot(self, array: Any) -> int | None:
        """The slot of `array` if it is kept (by identity), else ``None``."""
        return self._slots.get(id(array))

    def out_slot(self, out: Any) -> int | None:
        """The slot of `out` if it is kept, else ``None``; ``ValueError`` for a view of a kept
        array (``k[...]``, ``t.numpy()``): it would be written on the active ranks only."""
        slot = self.slot(out)
        if slot is None and out is not None:
            try:
                view = as_array(out, "out")
            except TypeError:
                return None
            if any(np.may_share_memory(view, kept) for kept in self.arrays):
                raise ValueError("out= shares memory with a kept array without being it: pass "
                                 "the kept array itself (the object given to jc.keep()), so "
                                 "that every rank writes it")
        return slot

    def use_once_per_iteration(self, elastic: bool) -> None:
        """Count a use of a kept array in this iteration; in an elastic Join, a second one is
        a ``ValueError`` (the settle brings the kept arrays to a count of results, and a loop
        redoes whole iterations)."""
        if elastic and self.used:
            raise ValueError(
                "an elastic Join allows one call with a kept array per iteration: after a lost "
                "rank the survivors adopt the kept arrays of the one that applied the most "
                "results, and a loop redoes its interrupted iteration whole, so a second call "
                "would be applied twice; put the values in one kept array (np.concatenate) or "
                "leave elastic off")
        self.used = True

    def code(self, x: Any, op_code: int, out: Any, into: Any) -> int:
        """The announced use of a kept array by an allreduce of `x`, ``slot << 2 | mode``, or
        0; ``ValueError`` for an `into` that is not kept or not like `x`."""
        if into is None:
            slot = self.out_slot(out)
            return 0 if slot is None else slot << 2 | OUT
        slot = self.slot(into)
        if slot is None:
            raise ValueError("into= takes an array kept with jc.keep() (every rank applies "
                             "the result to it, joined ones too)")
        if out is not None and self.out_slot(out) is not None:
            raise ValueError("pass a kept array as out= or as into=, not both")
        kept = self.arrays[slot]
        if kept.shape != np.shape(x) or kept.dtype != x.dtype:
            raise ValueError(f"into= must be shaped and typed like the input: {np.shape(x)} "
                             f"{x.dtype}, got kept array {slot}, {kept.shape} {kept.dtype}")
        if OPS[op_code - 1] not in ACCUMULATE:
            raise ValueError(f"into= accumulates with {', '.join(ACCUMULATE)}, not "
                             f"MPI.{OPS[op_code - 1]}")
        return slot << 2 | INTO

    def apply(self, code: int, op_code: int, result: np.ndarray) -> None:
        """Apply an operation's `result` (flat or shaped) to the kept array `code` names."""
        kept = self.arrays[code >> 2]
        if code & 3 == INTO:
            ACCUMULATE[OPS[op_code - 1]](kept, result.reshape(kept.shape), out=kept)
        elif not np.may_share_memory(kept, result):  # out= a kept array: written already
            kept.reshape(-1)[...] = result.reshape(-1)
        self.updates += 1

    def apply_carried(self, code: int, op_code: int, dtype_code: int, count: int,
                      floats: bool, announcement: np.ndarray) -> None:
        """A joined rank's side of an allreduce that `announcement` carried: its values, as
        the active ranks decode them, applied to the kept array `code` names."""
        keys = announcement[wire.PAYLOAD_AT:wire.PAYLOAD_AT + count]
        data = wire.from_order_keys(keys, wire.DTYPES[dtype_code - 1],
                                    wire.reversed_keys(op_code))
        if floats:  # floats, as ordered integers
            data = wire.float_values(data, self.arrays[code >> 2].dtype)
        self.apply(code, op_code, data)


def _keepable(given: Any, name: str) -> np.ndarray:
    """`given` as the host array :meth:`JoinableComm.keep` keeps; ``TypeError``/``ValueError``
    for a device array, a dtype the announcements lack, or a read-only or misordered one."""
    array = as_array(given, name)
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name}: keep() takes host arrays (NumPy, torch CPU tensors), got "
                        f"{type(given).__name__}")
    wire.dtype_code(array.dtype)
    if not array.flags.writeable or not array.flags.c_contiguous:
        raise ValueError(f"{name} must be writeable and C-contiguous (results are written "
                         "into it)")
    return array.view(np.ndarray)
