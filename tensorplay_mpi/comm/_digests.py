"""Digests: an int64 that stands for a value, so that ranks compare the value cheaply (gathered,
or MAX-reduced beside its negation: the same everywhere iff ``max(d) == -max(-d)``).  This is
the library's one meaning of the word; three kinds, by what they are made from:

- :func:`array_digest`: arrays' bytes, shapes and dtypes (the replica check, a checkpoint's
  values);
- :func:`layout_digest`: the ``repr`` of a description (names, shapes, dtypes, settings: the
  construction checks);
- :func:`ints_digest`: a tuple of ints, fast (JoinableComm's announcements, once per call).

Each is the same in every process for the same value, and never the int64 minimum, so its
negation fits in an int64.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import numpy as np

from ._buffers import is_device_array

_LOWEST = -2**63 + 1


def array_digest(arrays: Iterable[Any]) -> int:
    """The digest of the arrays' bytes, shapes and dtypes (NumPy or CuPy), in order."""
    h = hashlib.blake2b(digest_size=8)
    for array in arrays:
        host = array.get() if is_device_array(array) else np.asarray(array)
        h.update(f"{host.shape}{host.dtype.str}".encode())
        h.update(np.ascontiguousarray(host).tobytes())
    return max(int(np.frombuffer(h.digest(), dtype=np.int64)[0]), _LOWEST)


def layout_digest(layout: Any) -> int:
    """The digest of ``repr(layout)`` (names, shapes, dtypes, settings)."""
    raw = hashlib.blake2b(repr(layout).encode(), digest_size=8).digest()
    return max(int(np.frombuffer(raw, np.int64)[0]), _LOWEST)


def ints_digest(values: tuple) -> int:
    """The digest of a tuple of ints, positive (ints hash by value in every process)."""
    return (hash(values) & ((1 << 62) - 1)) | (1 << 62)
