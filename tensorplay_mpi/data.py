"""Uneven sharding without padding or dropping: every sample belongs to exactly one rank."""

from __future__ import annotations

from typing import Iterable

import numpy as np

__all__ = ["shard_sizes", "shard", "batches"]


def shard_sizes(num_samples: int, size: int, skew: float = 0.0,
                idle: Iterable[int] = ()) -> list[int]:
    """How many samples each rank gets: rank ``r`` weighs ``1 + skew * r``, idle ranks 0.

    ``skew=0`` splits as evenly as possible; a larger skew gives higher ranks more samples.
    The sizes always add up to `num_samples` (nothing padded, nothing dropped).

    Raises
    ------
    ValueError
        If `num_samples` < 0, `size` < 1, `skew` < 0, or every rank is idle.
    """
    if num_samples < 0 or size < 1 or skew < 0:
        raise ValueError(f"need num_samples >= 0, size >= 1, skew >= 0; got "
                         f"{num_samples}, {size}, {skew}")
    weights = 1.0 + skew * np.arange(size)
    weights[[r for r in idle if 0 <= r < size]] = 0.0
    if not weights.any():
        raise ValueError(f"every rank is idle ({sorted(idle)}): nobody would get a sample")
    bounds = np.rint(np.concatenate([[0.0], np.cumsum(weights)]) / weights.sum() * num_samples)
    return np.diff(bounds).astype(int).tolist()


def shard(num_samples: int, rank: int, size: int, skew: float = 0.0,
          idle: Iterable[int] = ()) -> range:
    """The contiguous sample indices of `rank` (see :func:`shard_sizes`)."""
    sizes = shard_sizes(num_samples, size, skew, idle)
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])


def batches(indices: range | np.ndarray, batch_size: int,
            rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Split `indices` into batches of `batch_size` (the last may be smaller), shuffled by `rng`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = np.asarray(indices)
    if rng is not None:
        order = rng.permutation(order)
    return [order[i:i + batch_size] for i in range(0, order.size, batch_size)]
