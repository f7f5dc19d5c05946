"""Uneven sharding without padding or dropping: every sample belongs to exactly one rank, and
:class:`Sampler`, which keeps that true per epoch across a resume at another world size."""

from __future__ import annotations

import numbers
import sys
from typing import Iterable, Iterator, Sequence, TypeVar

import numpy as np

__all__ = ["shard_sizes", "shard", "batches", "Sampler"]

_T = TypeVar("_T")


def shard_sizes(num_samples: int, size: int, skew: float = 0.0,
                idle: Iterable[int] = (), weights: Sequence[float] | None = None) -> list[int]:
    """How many samples each rank gets: rank ``r`` weighs ``1 + skew * r`` (or ``weights[r]``
    when given), idle ranks 0.

    ``skew=0`` splits as evenly as possible; a larger skew gives higher ranks more samples.
    `weights` gives each rank's share (per-site data set sizes such as ``[40, 35, 25]``, or
    the exact sizes themselves, which then come back as they are).  The sizes always add up to
    `num_samples` (nothing padded, nothing dropped).

    Raises
    ------
    ValueError
        If `num_samples` < 0, `size` < 1, `skew` < 0, `weights` is not `size` finite numbers
        >= 0, or every rank is idle.
    """
    if num_samples < 0 or size < 1 or skew < 0:
        raise ValueError(f"need num_samples >= 0, size >= 1, skew >= 0; got "
                         f"{num_samples}, {size}, {skew}")
    shares = 1.0 + skew * np.arange(size) if weights is None else _checked_weights(weights,
                                                                                   size)
    shares[[r for r in idle if 0 <= r < size]] = 0.0
    if not shares.any():
        raise ValueError(f"every rank is idle ({sorted(idle)}): nobody would get a sample")
    bounds = np.rint(np.concatenate([[0.0], np.cumsum(shares)]) / shares.sum() * num_samples)
    return np.diff(bounds).astype(int).tolist()


def _checked_weights(weights: Sequence[float], size: int) -> np.ndarray:
    try:
        values = np.array(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"weights must be {size} numbers >= 0, got {weights!r}") from None
    if values.shape != (size,) or not np.isfinite(values).all() or (values < 0).any():
        raise ValueError(f"weights must be {size} finite numbers >= 0 (one per rank), got "
                         f"{weights!r}")
    return values


def shard(num_samples: int, rank: int, size: int, skew: float = 0.0,
          idle: Iterable[int] = (), weights: Sequence[float] | None = None) -> range:
    """The contiguous sample indices of `rank` (see :func:`shard_sizes`)."""
    sizes = shard_sizes(num_samples, size, skew, idle, weights)
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


_STATE_FORMAT = 2  # 1: without the weights of each world size (read too)


class Sampler:
    """This rank's batches, epoch by epoch: every sample exactly once per epoch, resumable at
    another world size.

    Epoch ``e`` at ``size`` ranks: rank ``r`` takes its contiguous :func:`shard` of
    ``range(num_samples)``, permuted by ``np.random.default_rng([seed, e, r])`` (unless
    ``shuffle=False``), in batches of `batch_size`: the order of ``batches(shard(...), ...)``.
    :attr:`cursor` counts this rank's batches consumed in the epoch (a batch counts once the
    loop asks for the next one, so a ``break`` leaves the current batch unconsumed).

    As a torch ``DataLoader``'s ``batch_sampler``, iterate :meth:`track` of the loader: its
    workers take batches from the sampler ahead of the loop, and :meth:`track` counts only
    those handed to the loop (a loader iterating the sampler outside it is refused).

    A checkpoint saves ``cursor=sampler.cursor`` and ``extra={"sampler": sampler.state()}``;
    :meth:`resume` takes the saved epoch, every rank's cursor and that state.  At the same
    world size every rank goes on with its own shard from its cursor (the run never stopped).
    At another world size the samples of the interrupted epoch that no rank consumed are split
    over the new ranks (contiguously, in the old ranks' order, with the same `skew`), so the
    epoch still uses each sample exactly once; later epochs use the new world size's split.
    A second resize in the same epoch re-splits what is left again.

    Parameters
    ----------
    num_samples : int
        The data set's size; sample ids are ``0 .. num_samples - 1``.
    rank, size : int
        This rank and the world size.
    batch_size : int
        Samples per batch (a shard's last batch may be smaller).
    seed : int, default 0
        The order's seed.
    skew : float, default 0
        Rank ``r`` gets a share proportional to ``1 + skew * r`` (:func:`shard_sizes`).
    weights : sequence of float, optional
        Instead of `skew`, each rank's share at this world size: per-site data set sizes
        (``[40, 35, 25]``) or the exact shard sizes.  A resume at another world size takes
        that sampler's own weights for the re-split; the weights of every earlier world size
        of the epoch travel in :meth:`state`, so each sample is still used exactly once.
    shuffle : bool, default True
        Permute each shard per epoch; ``False`` keeps the ids in order.

    Raises
    ------
    TypeError
        If `num_samples`, `rank`, `size`, `batch_size` or `seed` is not an int.
    ValueError
        If `rank` is not in ``[0, size)``, ``batch_size < 1``, or :func:`shard_sizes` refuses.

    Examples
    --------
    ::

        sampler = Sampler(len(data), comm.rank, comm.size, batch_size=16, seed=0)
        # with torch: loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
        # and `for batch in sampler.track(loader):` in place of `for idx in sampler:`
        resumed = checkpoint.load(directory, params, comm=comm, resize=True)
        if resumed is not None:
            sampler.resume(resumed.epoch, resumed.cursors, resumed.extra.get("sampler"))
        for epoch in range(sampler.epoch, epochs + 1):
            sampler.set_epoch(epoch)
            with Join([dp]) as join:
                for idx in sampler:
                    if join.stopped:
                        break
                    ...
    """

    def __init__(self, num_samples: int, rank: int, size: int, *, batch_size: int,
                 seed: int = 0, skew: float = 0.0, weights: Sequence[float] | None = None,
                 shuffle: bool = True) -> None:
        for name, value in (("num_samples", num_samples), ("rank", rank), ("size", size),
                            ("batch_size", batch_size), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"Sampler: {name} must be an int, got {value!r}")
        if not 0 <= rank < size:
            raise ValueError(f"need 0 <= rank < size, got rank {rank}, size {size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if weights is not None and skew:
            raise ValueError("pass skew or weights, not both")
        shard_sizes(num_samples, size, skew, weights=weights)  # checks them all
        self.num_samples, self.rank, self.size = int(num_samples), int(rank), int(size)
        self.batch_size, self.seed, self.skew, self.shuffle = batch_size, seed, skew, shuffle
        self.weights = None if weights is None else _checked_weights(weights, size).tolist()
        self.epoch = 1
        self.cursor = 0
        self._splits: list[tuple[int, list[int]]] = []  # earlier splits of this epoch
        self._base: list[int] | None = None  # every rank's cursor where this split began
        self._earlier: dict[int, list[float]] = {}  # weights of earlier world sizes (state)
        self._tracking = False  # a tracked loader takes its iterator: it does not count
        self._tracks = 0  # track() iterators being iterated (one at a time)

    def _weights(self, size: int, last: bool = False) -> list[float] | None:
        """The weights of a split of this epoch over `size` ranks (None: by `skew`): those the
        checkpoint recorded for that size, but for the `last` split, over this sampler's
        ranks, which takes its own."""
        if last or size not in self._earlier:
            return self.weights if size == self.size else None
        return self._earlier[size]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` at its beginning; nothing changes if it is the current epoch (so a
        resumed epoch goes on from the cursor)."""
        if epoch != self.epoch:
            self.epoch, self.cursor, self._splits, self._earlier = int(epoch), 0, [], {}
            self._base = None

    def _fresh(self, size: int) -> list[np.ndarray]:
        """Every rank's samples of the current epoch at `size` ranks, in order."""
        parts = []
        for r in range(size):
            ids = np.asarray(shard(self.num_samples, r, size, self.skew,
                                   weights=self._weights(size)))
            if self.shuffle:
                ids = np.random.default_rng([self.seed, self.epoch, r]).permutation(ids)
            parts.append(ids)
        return parts

    def _parts(self) -> list[np.ndarray]:
        """Every current rank's samples of the epoch (consumed ones included): the epoch's
        first split, then what each later split left, re-split."""
        if not self._splits:
            return self._fresh(self.size)
        parts = self._fresh(self._splits[0][0])
        sizes = [size for size, _ in self._splits[1:]] + [self.size]
        for k, ((_, cursors), size) in enumerate(zip(self._splits, sizes)):
            for r, (part, c) in enumerate(zip(parts, cursors)):
                if not 0 <= c <= -(-part.size // self.batch_size):
                    raise ValueError(
                        f"cannot re-split the data: rank {r}'s cursor {c} is beyond its "
                        f"{part.size} samples in batches of {self.batch_size}")
            parts = _split(np.concatenate([p[c * self.batch_size:] for p, c in
                                           zip(parts, cursors)]), size, self.skew,
                           self._weights(size, last=k == len(sizes) - 1))
        return parts

    def batches(self) -> list[np.ndarray]:
        """This rank's batches of the current epoch, consumed ones included."""
        mine = self._parts()[self.rank]
        return [mine[i:i + self.batch_size] for i in range(0, mine.size, self.batch_size)]

    def __len__(self) -> int:
        """This rank's batches left in the epoch, from :attr:`cursor` on: what iterating the
        sampler yields (``len(loader)`` of a DataLoader built on it; other ranks may have
        more or fewer)."""
        return len(self.batches()) - self.cursor

    def max_batches(self) -> int:
        """The most batches any rank has in the current epoch (the Join's iterations)."""
        return max(-(-p.size // self.batch_size) for p in self._parts())

    def __iter__(self) -> Iterator[np.ndarray]:
        """This rank's batches from :attr:`cursor` on, counting each once the next is asked.

        Raises
        ------
        RuntimeError
            When a torch ``DataLoader`` iterates the sampler outside :meth:`track` (the
            cursor would count the batches its workers took ahead of the loop).
        """
        refused = None if self._tracking else _untracked_loader(sys._getframe(1))
        return self._from(self.cursor, not self._tracking, refused)

    def _from(self, start: int, count: bool, refused: str | None) -> Iterator[np.ndarray]:
        if refused is not None:  # raised at the loader's first request, once it is whole
            raise RuntimeError(refused)
        for batch in self.batches()[start:]:
            yield batch
            if count:
                self.cursor += 1

    def track(self, loader: Iterable[_T]) -> Iterator[_T]:
        """The batches of `loader`, a torch ``DataLoader`` built with ``batch_sampler=`` this
        sampler, counting in :attr:`cursor` each batch the loop consumed, as iterating the
        sampler itself does (a batch counts once the loop asks for the next one).

        The loader's workers (``num_workers``), its ``prefetch_factor`` and its pinning thread
        (``pin_memory``) take batches from the sampler ahead of the loop; those count only
        when the loader hands them to the loop, so a checkpoint's cursor resumes at the first
        batch the loop did not consume.  A loader built with ``in_order=False`` is refused
        (it hands batches out of the sampler's order).  Each ``track(loader)`` goes on from
        the cursor.

        Raises
        ------
        TypeError
            If `loader` has no ``batch_sampler`` (it is not a DataLoader).
        ValueError
            If its ``batch_sampler`` is not this sampler, or it was built with
            ``in_order=False``.

        Examples
        --------
        ::

            loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2, pin_memory=True)
            for batch in sampler.track(loader):
                ...
        """
        if not hasattr(loader, "batch_sampler"):
            raise TypeError(f"Sampler.track: expected a torch DataLoader built with "
                            f"batch_sampler=this sampler, got {type(loader).__name__}")
        if loader.batch_sampler is not self:
            raise ValueError(f"Sampler.track: the loader's batch_sampler is another "
                             f"{type(loader.batch_sampler).__name__}, not this sampler: build "
                             "it with DataLoader(dataset, batch_sampler=sampler, ...)")
        if not getattr(loader, "in_order", True):
            raise ValueError("Sampler.track: the loader was built with in_order=False, so it "
                             "hands batches out of the sampler's order and no cursor can say "
                             "which were consumed: leave in_order at True")
        return self._tracked(loader)

    def _tracked(self, loader: Iterable[_T]) -> Iterator[_T]:
        if self._tracks:
            raise RuntimeError("Sampler.track: another track() of this sampler is still being "
                               "iterated; two at once would each count the same cursor: finish "
                               "or close the first (one loop over one tracked loader)")
        self._tracks += 1
        try:
            self._tracking = True  # the loader's iterator of the sampler, taken now, does not
            try:  # count
                handed = iter(loader)
            finally:
                self._tracking = False
            for batch in handed:
                yield batch
                self.cursor += 1
        finally:
            self._tracks -= 1

    def state(self) -> np.ndarray:
        """What :meth:`resume` needs besides the epoch and the cursors: an int64 array (the
        same on every rank) for a checkpoint's ``extra``."""
        flat = [_STATE_FORMAT, self.num_samples, self.batch_size, self.epoch, self.size,
                len(self._splits)]
        for size, cursors in self._splits:
            flat += [size, *cursors]
        weighted = dict(self._earlier)  # the epoch's splits so far, then this world size's
        if self.weights is not None and (self.size not in weighted or self._splits):
            weighted[self.size] = self.weights
        flat.append(len(weighted))
        for size, w in sorted(weighted.items()):  # float64 bits as int64: exact
            flat += [size, *np.asarray(w, np.float64).view(np.int64).tolist()]
        return np.array(flat, dtype=np.int64)

    def resume(self, epoch: int, cursors: Sequence[int], state: np.ndarray | None) -> None:
        """Go on from a checkpoint: its `epoch`, every saved rank's cursor and :meth:`state`.

        Raises
        ------
        ValueError
            On every rank alike, when the data cannot be re-split: another number of samples or
            batch size, a state of another epoch, cursors that do not fit, or no state while the
            world size changed.
        """
        cursors = [int(c) for c in cursors]
        if state is None:
            if len(cursors) != self.size:
                raise ValueError(
                    f"the checkpoint holds no sampler state (extra['sampler']), so its "
                    f"{len(cursors)} ranks' cursors cannot be re-split over {self.size} ranks: "
                    f"resume at {len(cursors)} ranks, or save sampler.state()")
            splits: list[tuple[int, list[int]]] = []
        else:
            splits = self._decode(np.asarray(state), epoch, len(cursors))
        self.epoch, self.cursor, self._base = int(epoch), 0, None
        if len(cursors) == self.size:  # go on with every rank's own shard
            self._splits = splits
            self._splits.append((self.size, cursors))
            self._parts()  # checks every cursor
            self._splits.pop()
            self.cursor, self._base = cursors[self.rank], cursors
        else:  # what no rank consumed, over this world size
            self._splits = [*splits, (len(cursors), cursors)]
            self._parts()

    def shrink(self, lost: Sequence[int], steps: int | None = None) -> np.ndarray:
        """Go on without the `lost` ranks, which left after `steps` steps of the current split
        (an elastic Join's :class:`~tensorplay_mpi.errors.RanksLostError`: ``lost.lost``,
        ``lost.steps``; ``None``: the split is done, every batch consumed, as after a loss in a
        validation between epochs); local, the same on every survivor.

        Each rank of the split consumed one batch per step until its batches ran out (a loop
        of one batch per step, from the cursor where the split began); the samples no rank
        consumed are split over the survivors as in a resize, so the epoch still uses each
        sample exactly once.  This rank's number becomes its place among the survivors.
        Returns the samples the lost ranks consumed since the split began (where this sampler
        was made, set to the epoch, resumed or shrunk): they count as used, so a tally of the
        epoch's samples adds them, on one survivor.

        Raises
        ------
        ValueError
            If `lost` is empty, names a rank outside ``[0, size)`` or this rank, or `steps`
            is negative.
        """
        if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in lost):
            raise ValueError(f"lost must be ranks (ints), got {list(lost)!r}")
        gone = sorted({int(r) for r in lost})
        if not gone or gone[0] < 0 or gone[-1] >= self.size or self.rank in gone:
            raise ValueError(f"lost must name ranks of [0, {self.size}) other than this rank "
                             f"{self.rank}, got {list(lost)!r}")
        if steps is not None and (isinstance(steps, bool) or steps < 0
                                  or not isinstance(steps, numbers.Integral)):
            raise ValueError(f"steps must be an int >= 0 or None, got {steps!r}")
        base, parts = self._base or [0] * self.size, self._parts()
        cursors = [-(-p.size // self.batch_size) if steps is None else
                   min(b + int(steps), -(-p.size // self.batch_size))
                   for b, p in zip(base, parts)]
        consumed = np.concatenate([np.asarray(
            parts[r][base[r] * self.batch_size:cursors[r] * self.batch_size], dtype=np.int64)
            for r in gone])
        survivors = [r for r in range(self.size) if r not in gone]
        if self.weights is not None:
            self._earlier[self.size] = self.weights
        self._splits.append((self.size, cursors))
        self.weights = None if self.weights is None else [self.weights[r] for r in survivors]
        self.rank, self.size = survivors.index(self.rank), len(survivors)
        self.cursor, self._base = 0, None
        return consumed

    def admit(self, rank: int, size: int, state: np.ndarray) -> None:
        """Go on at `size` ranks as `rank`: new ranks (spares recruited after a loss,
        :class:`~tensorplay_mpi.algorithms.SparePool`) take places among the ranks of the
        current split, and the samples of the epoch that no rank consumed are re-split over
        all of them, as in a resize; local.

        `state` is :meth:`state` of a rank of the current split where it begins (right after
        :meth:`shrink`: no rank has consumed a batch of it), the same on every rank, a new
        one included (its sampler made with the same arguments, of any epoch).

        Raises
        ------
        ValueError
            If `rank` is not in ``[0, size)``, `state` is not a state of this data set or its
            split has begun on this rank (its cursor is not 0), or the sampler splits by
            `weights` (a new rank's share is unknown).
        """
        flat = np.asarray(state, np.int64)
        if not 0 <= rank < size:
            raise ValueError(f"need 0 <= rank < size, got rank {rank}, size {size}")
        if self.weights is not None or _weighted(flat):
            raise ValueError("Sampler.admit: a sampler that splits by weights cannot take new "
                             "ranks (their shares are unknown); split by skew with spares")
        if flat.size < 6 or (int(flat[3]) == self.epoch and self.cursor):
            raise ValueError(f"Sampler.admit: the split has begun on this rank (cursor "
                             f"{self.cursor}) or {flat[:6].tolist()} is no sampler state; "
                             "admit ranks right after shrink()")
        self.rank, self.size = int(rank), int(size)
        self.resume(int(flat[3]), [0] * int(flat[4]), flat)

    def _decode(self, state: np.ndarray, epoch: int, saved_size: int
                ) -> list[tuple[int, list[int]]]:
        flat = state.astype(np.int64).tolist()
        if len(flat) < 6 or flat[0] not in (1, _STATE_FORMAT):
            raise ValueError(f"not a Sampler state (format {flat[:1]}), cannot re-split")
        num, batch, saved_epoch, size, count = flat[1:6]
        if (num, batch) != (self.num_samples, self.batch_size):
            raise ValueError(
                f"cannot re-split the data: the checkpoint's sampler had {num} samples in "
                f"batches of {batch}, this one {self.num_samples} in batches of "
                f"{self.batch_size} (the cursors count those batches)")
        if saved_epoch != epoch or size != saved_size:
            raise ValueError(f"the sampler state is of epoch {saved_epoch} at {size} ranks, "
                             f"the checkpoint's cursors of epoch {epoch} at {saved_size}")
        splits, at = [], 6
        for _ in range(count):
            n = flat[at]
            splits.append((n, flat[at + 1:at + 1 + n]))
            at += 1 + n
        self._earlier = {}
        for _ in range(flat[at] if flat[0] >= 2 else 0):
            n = flat[at + 1]
            self._earlier[n] = np.array(flat[at + 2:at + 2 + n], np.int64).view(
                np.float64).tolist()
            at += 1 + n
        return splits


def _weighted(state: np.ndarray) -> bool:
    """Whether a :meth:`Sampler.state` holds the weights of a split."""
    if state.size < 6 or state[0] < 2:
        return False
    at = 6
    for _ in range(int(state[5])):
        at += 1 + int(state[at])
    return at < state.size and int(state[at]) > 0


_LOADERS = ("torch.utils.data",)  # modules whose loaders take batches ahead of the loop


def _untracked_loader(caller: object) -> str | None:
    """Why the sampler's iterator is refused when `caller`, the frame that asked for it, is a
    torch DataLoader's (outside :meth:`Sampler.track` its prefetching would count), or None."""
    module = getattr(caller, "f_globals", {}).get("__name__", "")
    if not module.startswith(_LOADERS):
        return None
    return ("Sampler: a torch DataLoader iterates this sampler outside sampler.track(loader): "
            "a loader takes batches ahead of the loop (with workers, num_workers x "
            "prefetch_factor of them), so the cursor would count batches the loop never "
            "consumed and a resume would skip them; iterate `for batch in "
            "sampler.track(loader):` instead of the loader")


def _split(ids: np.ndarray, size: int, skew: float,
           weights: Sequence[float] | None = None) -> list[np.ndarray]:
    """`ids` in contiguous pieces over `size` ranks (:func:`shard_sizes`)."""
    bounds = np.concatenate([[0], np.cumsum(shard_sizes(ids.size, size, skew,
                                                         weights=weights))])
    return [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
