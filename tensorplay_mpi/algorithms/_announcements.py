"""The codec of JoinableComm's announcements: what an operation is, as the int64 fields that
every rank's ``Iallreduce(int64[42], MAX)`` carries while ranks have joined.

An announcement is ``[kind, op, dtype, root, count, row digest, digest, -digest, rank == root,
rank, payload[32]]`` (:data:`SLOTS` int64).  The kinds are :data:`END`, :data:`ALLREDUCE`,
:data:`ALLGATHER`, :data:`BCAST`, :data:`REFUSED` (an argument error every rank raises),
:data:`CARRIED_ALLREDUCE` and :data:`CARRIED_BCAST` (the data travels in the payload),
:data:`BLOCK` (another joinable's block of collectives: its index in the count), :data:`ALONE`
(the only active rank's result of an operation on a kept array: its bytes in the payload, or a
broadcast from it after the announcement when they do not fit), :data:`CATCH_UP` (its kept
arrays whole, in broadcasts from it after the announcement) and :data:`SLOT_SUM` (a small
float SUM: each active rank's values in its own slots of the payload, summed by every rank:
:func:`slot_words`, :func:`slot_sum`).  Ops and
dtypes travel as codes from 1 (:data:`~tensorplay_mpi.comm._collectives.OPS`, :data:`DTYPES`).
Small MAX, MIN, LAND and LOR allreduces travel as int64 keys in the order of their values
(:func:`order_keys`; floats first through :func:`float_keys`, so NaN reduces the same way on
every rank).  A joined rank announces :data:`NOBODY`, the int64 minimum, MAX's identity.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np
from mpi4py import MPI

from ..comm._agreement import KINDS
from ..comm._digests import ints_digest
from ..comm._ops import OPS, op_name
from ..errors import CollectiveMismatchError

END, ALLREDUCE, ALLGATHER, BCAST, REFUSED = 1, 2, 3, 4, 5
CARRIED_ALLREDUCE, CARRIED_BCAST = 6, 7  # the data travelled in the announcement
BLOCK = 8  # another joinable's block of collectives (Join.announce): its index in the count
ALONE = 9  # the only active rank's result for the kept arrays: in the payload, else a bcast
SLOT_SUM = 10  # a small float SUM: each rank's values in its own payload slots, summed locally
CATCH_UP = 11  # the only active rank's kept arrays, whole: broadcasts from it follow
DTYPES = tuple(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128))
DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES, 1)}
OP_OBJECTS = tuple(getattr(MPI, name) for name in OPS)
OP_CODES = {id(op): code for code, op in enumerate(OP_OBJECTS, 1)}  # MPI.SUM, ... live forever
FIELDS = 6  # kind, op, dtype, root, count, row digest: what the digest covers
ROOT_IS_ME, RANK, PAYLOAD_AT = FIELDS + 2, FIELDS + 3, FIELDS + 4  # after the digests
PAYLOAD = 32  # int64 words of data an announcement carries
SLOTS = PAYLOAD_AT + PAYLOAD
_ORDERED = {"MAX": False, "MIN": True, "LOR": False, "LAND": True}  # op: by reversed keys
NOBODY = np.iinfo(np.int64).min  # what a joined rank announces


def identity(op: MPI.Op, dtype: Any) -> Any:
    """The element that leaves `op` unchanged, for `dtype` (what a joined rank contributes).

    Raises
    ------
    ValueError
        For an op without an identity here (user-defined ops, MAXLOC, ...).
    """
    dtype = np.dtype(dtype)
    name = checked_op_name(op)
    if name == "SUM" and dtype.kind in "fc":  # -0.0, not +0.0: the sum of -0.0s stays -0.0
        return dtype.type(complex(-0.0, -0.0) if dtype.kind == "c" else -0.0)
    if name in ("SUM", "LOR", "LXOR", "BOR", "BXOR"):
        return dtype.type(0)
    if name in ("PROD", "LAND"):
        return dtype.type(1)
    if name == "BAND":
        return dtype.type(True) if dtype.kind == "b" else ~dtype.type(0)
    lowest = name == "MAX"
    if dtype.kind == "b":
        return dtype.type(not lowest)
    if dtype.kind == "f":
        return dtype.type(-np.inf if lowest else np.inf)
    info = np.iinfo(dtype)
    return dtype.type(info.min if lowest else info.max)


def checked_op_name(op: Any) -> str:
    """The name of `op` in :data:`OPS`: a TypeError for a non-op, a ValueError for others."""
    if not isinstance(op, MPI.Op):
        raise TypeError(f"op must be an mpi4py.MPI.Op such as MPI.SUM, got {op!r}")
    name = op_name(op)
    if name is None:
        raise ValueError(f"JoinableComm supports the ops {', '.join(OPS)}; got {op!r}")
    return name


def code_of_op(op: Any) -> int:
    """The wire code of `op`: its position in :data:`OPS`, from 1."""
    code = OP_CODES.get(id(op))
    return OPS.index(checked_op_name(op)) + 1 if code is None else code


OP_KINDS = {"SUM": "iufc", "PROD": "iufc", "MAX": "iuf", "MIN": "iuf", "LAND": "iub",
             "LOR": "iub", "LXOR": "iub", "BAND": "iu", "BOR": "iu", "BXOR": "iu"}
"""The NumPy dtype kinds MPI defines each op on."""


def refuse_op(op_code: int, dtype: np.dtype) -> NoReturn:
    kinds = {"i": "signed", "u": "unsigned", "f": "floating", "c": "complex", "b": "bool"}
    allowed = ", ".join(kinds[k] for k in OP_KINDS[OPS[op_code - 1]])
    raise TypeError(f"MPI.{OPS[op_code - 1]} does not apply to dtype {dtype}: MPI defines it on "
                    f"{allowed} arrays")


def dtype_code(dtype: np.dtype) -> int:
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise TypeError(f"JoinableComm cannot send dtype {dtype}")
    return code


def covered(fields: tuple) -> tuple:
    """The announced fields that active ranks must agree on.

    An allgather's dtype and row shape may differ in the announcement: the row headers
    compare them and raise the same ValueError as when every rank is active.
    """
    return fields[:1] if fields[0] == ALLGATHER else fields


def carried_op(x: Any, op_code: int) -> bool | None:
    """For an allreduce that an announcement can carry: whether its keys are reversed."""
    name = OPS[op_code - 1]
    if (type(x) is not np.ndarray or x.size > PAYLOAD or name not in _ORDERED
            or x.dtype.kind not in "biu" or (name in ("LAND", "LOR") and x.dtype.kind != "b")):
        return None
    return _ORDERED[name]


def order_keys(x: np.ndarray, reverse: bool) -> np.ndarray:
    """int64 keys in the order of `x`'s values (reversed: bitwise not), so MAX reduces them;
    integers and bools (floats arrive as the integers of :func:`float_keys`)."""
    flat = x.reshape(-1)
    if x.dtype == np.uint64:
        keys = (flat ^ np.uint64(1 << 63)).view(np.int64)
    else:
        keys = flat.astype(np.int64)
    return ~keys if reverse else keys


SUM_CODE = OPS.index("SUM") + 1
_SIGN32 = np.uint32(1 << 31)


def sums_in_slots(x: Any, op_code: int, size: int) -> bool:
    """Whether an allreduce of `x` travels as :data:`SLOT_SUM`: a SUM of a float32 or float64
    host array whose values fit the payload once per rank of `size`."""
    return (op_code == SUM_CODE and type(x) is np.ndarray and x.size * size <= PAYLOAD
            and x.dtype in _SLOT_DTYPES)


_SLOT_DTYPES = (np.dtype(np.float64), np.dtype(np.float32))


def slot_words(x: np.ndarray) -> np.ndarray:
    """`x`'s values as the int64 words of its slots, which a MAX over the ranks leaves as
    written (the other ranks write :data:`NOBODY` there), and whose :data:`NOBODY` reads as
    ``-0.0``, the identity of the sum: float64 bits as they are, float32 bits with the sign
    flipped, widened without sign."""
    flat = x.reshape(-1)
    if x.dtype == np.float64:
        return flat.view(np.int64)
    return (flat.view(np.uint32) ^ _SIGN32).astype(np.int64)


def slot_sum(announcement: np.ndarray, dtype: np.dtype, count: int, size: int) -> np.ndarray:
    """The sum over the `size` ranks' slots of `count` values of `dtype` (a joined rank's read
    as ``-0.0``), the same on every rank: rank ``r`` wrote words ``r * count`` on."""
    words = announcement[PAYLOAD_AT:PAYLOAD_AT + count * size].reshape(size, count)
    if dtype == np.float64:
        values = words.view(np.float64)
    else:
        values = (words.astype(np.uint32) ^ _SIGN32).view(np.float32)
    total = values[0].copy()  # in rank order (np.add.reduce would start from +0.0)
    with np.errstate(all="ignore"):  # an overflow is inf, as in MPI's sum: no warning
        for row in values[1:]:
            total += row
    return total


def reversed_keys(op_code: int) -> bool:
    """Whether an allreduce of `op_code` that an announcement carries travels as reversed
    keys (MIN, LAND: so that MAX reduces them)."""
    return _ORDERED[OPS[op_code - 1]]


def from_order_keys(keys: np.ndarray, dtype: np.dtype, reverse: bool) -> np.ndarray:
    """The values of :func:`order_keys`."""
    keys = ~keys if reverse else keys
    if dtype == np.uint64:
        return keys.view(np.uint64) ^ np.uint64(1 << 63)
    return keys.astype(dtype)


MAX_CODE, MIN_CODE = OPS.index("MAX") + 1, OPS.index("MIN") + 1


_KEYS = {np.dtype(f"f{n}"): (np.dtype(f"i{n}"), np.iinfo(f"i{n}"), 8 * n - 1) for n in (2, 4, 8)}
"""Per float dtype: the integer dtype of its width, that integer's limits, the sign shift."""


def float_keys(x: np.ndarray, largest: bool) -> np.ndarray:
    """Integers of `x`'s width in the order of its float values, every NaN the extreme that
    wins the reduction (`largest`: MAX's), so a MAX or MIN over them propagates NaN the same
    way on every rank, as ``np.maximum`` does (MPI leaves NaN to the order of reduction)."""
    kind, limits, shift = _KEYS[x.dtype]
    flat = x.reshape(-1)
    bits = flat.view(kind)
    keys = bits ^ ((bits >> shift) & limits.max)  # negative: the magnitude bits reversed
    np.copyto(keys, limits.max if largest else limits.min, where=flat != flat)  # NaN
    return keys


def float_values(keys: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The floats of :func:`float_keys` (an extreme key: a NaN)."""
    kind, limits, shift = _KEYS[dtype]
    return (keys ^ ((keys >> shift) & limits.max)).view(dtype)


ROWS_KEPT = 256
"""Announcement rows an announcer keeps made (:func:`encode`'s `rows`); a loop repeats a few."""
_CHECKED = FIELDS + 2  # the words that must come back unchanged when every rank agrees


def encode(announcement: np.ndarray, fields: tuple, rank: int,
           payload: np.ndarray | None = None, rows: dict | None = None, at: int = 0) -> tuple:
    """Write this active rank's announcement of the operation `fields` (kind, op, dtype code,
    root, count, row digest) into `announcement` (:data:`SLOTS` int64), with `payload`, if
    any, from payload word `at` on (the others :data:`NOBODY`).

    Returns what :func:`decode` checks quickly: the checked words as bytes and as a tuple;
    kept in the announcer's `rows` (a dict), they are made once per signature."""
    key = (fields, rank)
    rows = {} if rows is None else rows
    made = rows.get(key)
    if made is None:
        signature = ints_digest(covered(fields))
        row = np.full(SLOTS, NOBODY, np.int64)
        row[:PAYLOAD_AT] = fields + (signature, -signature, int(rank == fields[3]), rank)
        if len(rows) >= ROWS_KEPT:
            rows.clear()
        made = rows[key] = (row, row[:_CHECKED].tobytes(), tuple(row[:_CHECKED].tolist()))
    np.copyto(announcement, made[0])
    if payload is not None:
        announcement[PAYLOAD_AT + at:PAYLOAD_AT + at + payload.size] = payload
    return made


def as_payload(x: Any) -> np.ndarray:
    """The bytes of `x` (at most ``8 * PAYLOAD``) as payload words, zero-padded."""
    return np.frombuffer(x.tobytes().ljust(8 * PAYLOAD, b"\0"), np.int64)


def from_payload(announcement: np.ndarray, dtype: np.dtype, count: int) -> np.ndarray:
    """The `count` values of `dtype` whose bytes an announcement's payload carries."""
    data = announcement[PAYLOAD_AT:].tobytes()[:count * np.dtype(dtype).itemsize]
    return np.frombuffer(data, dtype)


_NAMES = {END: "the end of an iteration", ALLREDUCE: "allreduce", ALLGATHER: "allgather",
          BCAST: "bcast", REFUSED: "a call with a bad argument", CARRIED_ALLREDUCE: "allreduce",
          CARRIED_BCAST: "bcast", BLOCK: "a block of another joinable",
          ALONE: "an operation on a kept array of the only active rank", SLOT_SUM: "allreduce",
          CATCH_UP: "the kept arrays of the only active rank"}


def describe(fields: tuple) -> str:
    """What an announcement's `fields` (kind, op, dtype code, root, count, row digest) say,
    for messages: ``allreduce of 4 float32 (SUM)``."""
    kind, op, code, root, count, rows = fields
    name = _NAMES.get(kind, f"kind {kind}")
    if kind == REFUSED:
        return f"{name} ({KINDS[op - 1].__name__})" if 0 < op <= len(KINDS) else name
    if kind not in (ALLREDUCE, ALLGATHER, BCAST, CARRIED_ALLREDUCE, CARRIED_BCAST, SLOT_SUM):
        return name
    what = f"{name} of {count} {DTYPES[code - 1]}" + (" per row" if kind == ALLGATHER else "")
    if kind in (ALLREDUCE, CARRIED_ALLREDUCE, SLOT_SUM):
        what += f" ({OPS[op - 1]}{', persistent' if kind == ALLREDUCE and rows & 1 else ''})"
    elif root != -1 or kind in (BCAST, CARRIED_BCAST):
        what += f" from root {'highest_active' if root == -1 else root}"
    if kind != ALLGATHER and rows >> 2:
        what += f", {'into' if rows >> 2 & 3 == 2 else 'out'}= kept array {rows >> 4}"
    return what


def decode(announcement: np.ndarray, size: int, what: str, sent: tuple | None = None) -> tuple:
    """The fields of a MAX-reduced `announcement` over `size` ranks, checked the same way on
    every rank.

    Raises
    ------
    CollectiveMismatchError
        Naming `what`, if the announcement is not one operation every active rank announced
        (its digests differ: ranks that announced different operations, or another
        collective).
    RuntimeError
        If it names no valid operation.
    """
    if sent is not None and announcement[:_CHECKED].tobytes() == sent[1]:
        # this rank's own operation came back: every active rank announced it (a valid one)
        return sent[2] + (int(announcement[ROOT_IS_ME]), int(announcement[RANK]))
    values = tuple(announcement[:PAYLOAD_AT].tolist())
    kind, op, code, root, count, rows = fields = values[:FIELDS]
    signature, negated = values[FIELDS:FIELDS + 2]
    if signature != -negated or signature != ints_digest(covered(fields)):
        raise CollectiveMismatchError(
            f"{what} is not one operation that every active rank announced: active ranks "
            "issued different JoinableComm operations (a different kind, dtype, element "
            "count, op or root; allreduce against iallreduce of a small host array; a bad "
            "argument on some ranks only), or the collectives of a Join's joinables did not "
            "run in the order of its list (a collective of a joinable of yours between "
            "JoinableComm operations, say); no rank received a value from it.")
    data = kind in (ALLREDUCE, ALLGATHER, BCAST, CARRIED_ALLREDUCE, CARRIED_BCAST, ALONE,
                    SLOT_SUM)
    reduces = kind in (ALLREDUCE, CARRIED_ALLREDUCE, SLOT_SUM)
    if not ((data or kind in (END, REFUSED, BLOCK, CATCH_UP))
            and (not data or 1 <= code <= len(DTYPES))
            and 0 <= op <= (len(OPS) if reduces or kind == ALONE else len(KINDS))
            and (not (reduces or kind == REFUSED) or op > 0) and -1 <= root < size
            and count >= 0):
        raise RuntimeError(f"{what} is invalid: {values}")
    return values
