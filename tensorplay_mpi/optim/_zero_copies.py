"""A ZeroRedundancyOptimizer's copies: each shard's state also on the next rank, for an elastic
Join that loses ranks.

With ``copies=True`` rank ``r`` keeps, beside its own shard's optimizer, a copy of rank
``r - 1``'s (mod the size): a second shard optimizer over that shard, stepped in the same step
with the same averaged gradients.  The arithmetic is the same on every rank (the rules are
elementwise, without fast-math or fused multiply-adds, as a replicated local optimizer's), so
the copy is bitwise the owner's state after every step, with no message: it can never be half
received.  It costs a second shard's state (memory) and a second shard's update (time).

After a loss, the survivors (:func:`reshard`, from the elastic settle):

1. complete the interrupted step where some survivors applied it and others did not (those
   behind receive the step's gradients from the survivor the settle adopts, and step their
   shard and copy);
2. broadcast every parameter from its holder (its owner, or for a lost owner the next rank,
   which holds the copy), since a broadcast of the interrupted step may have reached some
   survivors only, in part;
3. re-shard at the new size: each parameter's state (moments, per-parameter step count) goes
   from its holder to its new owner and to the new owner's next rank (its new copy).

A lost rank whose next rank is lost too leaves its shard nowhere: every survivor raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ..comm import _torch_cuda as torch_cuda
from ..comm._buffers import copy_into
from ..comm._collectives import Work, iallgather, ibcast, irecv, isend

if TYPE_CHECKING:
    from ._local import Optimizer
    from ._zero import ZeroRedundancyOptimizer

_TAG = 0x2E61  # the state messages of a re-shard and of a copies' refresh


@dataclass
class Layout:
    """The shards at one world size, as one rank holds them."""

    owners: list[int]
    shard: list[int]
    local: Optimizer
    copy_shard: list[int]
    copy: Optimizer | None
    packs: list[tuple[int, Any, list]]
    direct: list[int]


def _rows(optimizer: Optimizer, k: int) -> list[Any]:
    """What a copy of parameter `k` of `optimizer` holds: its state arrays, its step count."""
    return [*(optimizer.state[k][name] for name in optimizer.state_names),
            optimizer.param_steps[k:k + 1]]


def _wait(works: list[Work], timeout: float) -> None:
    for work in works:
        work.wait_or_abort(timeout)


def refresh_copies(zero: ZeroRedundancyOptimizer) -> None:
    """Make each rank's copy its previous rank's shard state (after a load of shard states).

    Collective over ``zero.comm``: point-to-point, each rank to the next.
    """
    if zero._copy is None:
        return
    comm, after, before = zero.comm, (zero.rank + 1) % zero.size, (zero.rank - 1) % zero.size
    mine, theirs = np.array([zero.local.steps]), np.zeros(1, np.int64)
    works = [isend(comm, a, after, _TAG, "ZeRO copies: state")
             for k in range(len(zero.shard)) for a in _rows(zero.local, k)]
    works += [irecv(comm, a, before, _TAG, "ZeRO copies: state")
              for k in range(len(zero._copy_shard)) for a in _rows(zero._copy, k)]
    works += [isend(comm, mine, after, _TAG, "ZeRO copies: steps"),
              irecv(comm, theirs, before, _TAG, "ZeRO copies: steps")]
    _wait(works, zero.timeout)
    zero._copy.steps = int(theirs[0])


def reshard(zero: ZeroRedundancyOptimizer, comm: MPI.Intracomm, step: int, root: int,
            timeout: float, settling: bool = True) -> Layout:
    """The survivors' shards of `zero` on `comm` (a shrink of ``zero.comm``), at `step`.

    Collective over `comm`.  Completes the interrupted step where some survivors are behind
    (with `settling`: the gradients of `root`, which applied it), makes every parameter its
    holder's, and returns the layout at the size of `comm` with each state moved there; the
    caller adopts it once every survivor has it.

    Raises
    ------
    RuntimeError
        On every survivor, when a lost rank's shard is gone (no copies, or its next rank lost
        too), or, without `settling`, if the survivors are at different steps.
    """
    size, old_size = comm.Get_size(), zero.size
    rows = np.zeros((size, 2), np.int64)
    _wait([iallgather(comm, np.array([zero.rank, zero.local.steps], np.int64), rows,
                      "ZeRO settle: ranks and steps")], timeout)
    new_rank = {int(old): new for new, old in enumerate(rows[:, 0])}
    lost = [r for r in range(old_size) if r not in new_rank]
    if lost and not zero.copies:
        raise RuntimeError(f"rank {zero.rank}: the ZeroRedundancyOptimizer shard of lost "
                           f"rank(s) {lost} is gone: construct it with copies=True to go on "
                           "without a lost rank")
    gone = [d for d in lost if (d + 1) % old_size not in new_rank]
    if gone:
        raise RuntimeError(
            f"rank {zero.rank}: the ZeroRedundancyOptimizer shard of lost rank(s) {gone} "
            f"is gone: its copy was on rank(s) {[(d + 1) % old_size for d in gone]} (of "
            f"{old_size}), lost too; a loss is survived when no two neighbours (r and r + 1 "
            "mod the size) are lost at once: end the job and resume from the last periodic save")
    if (rows[:, 1] < step).any():
        if not settling:
            raise RuntimeError(f"rank {comm.Get_rank()}: the survivors' ZeroRedundancyOptimizer "
                               f"applied from {rows[:, 1].min()} to {rows[:, 1].max()} steps; "
                               "move it only after a loss outside its steps")
        _complete_step(zero, comm, root, step, timeout)
    holders = [new_rank[o] if o in new_rank else new_rank[(o + 1) % old_size]
               for o in zero.owners]
    zero._sync_with(comm, holders, timeout)
    layout = zero._lay_out(comm, zero.local.defaults)
    for optimizer in (layout.local, layout.copy):
        if optimizer is not None:
            optimizer.param_groups, optimizer.defaults = (zero.local.param_groups,
                                                          zero.local.defaults)
            optimizer.steps = step
    _move_state(zero, comm, holders, layout, timeout)
    return layout


def _complete_step(zero: ZeroRedundancyOptimizer, comm: MPI.Intracomm, root: int, step: int,
                   timeout: float) -> None:
    """Apply step `step` on the survivors that did not: `root`'s gradients (clipped already)
    and parameters used, then this rank's shard and copy updated with them.

    Every rank broadcasts in a step's parameter sync once it has stepped its shard (one byte
    where it owns no parameter), so while a survivor is behind no survivor got past the
    interrupted step's sync: `root`'s gradients are still that step's.
    """
    used = zero._used()
    mask = np.ones(len(zero.params), np.uint8) if used is None else used.astype(np.uint8)
    works = [ibcast(comm, g, root, f"ZeRO settle: gradient {i}")
             for i, g in enumerate(zero.grads)]
    _wait(works + [ibcast(comm, mask, root, "ZeRO settle: parameters used")], timeout)
    if zero.local.steps >= step:
        return
    chosen = mask.astype(bool)
    with torch_cuda.handed():
        zero.local.update(chosen[zero._shard_index])
        if zero._copy is not None:
            zero._copy.update(chosen[zero._copy_index])


def _move_state(zero: ZeroRedundancyOptimizer, comm: MPI.Intracomm, holders: list[int],
                layout: Layout, timeout: float) -> None:
    """Each parameter's state from its holder to its owner and its copy in `layout`."""
    rank, size = comm.Get_rank(), comm.Get_size()
    held = {i: (zero.local, k) for k, i in enumerate(zero.shard)}
    held.update({i: (zero._copy, k) for k, i in enumerate(zero._copy_shard)
                 if zero._copy is not None and i not in held})
    targets: list[dict[int, tuple[Any, int]]] = [
        {i: (layout.local, k) for k, i in enumerate(layout.shard)},
        {i: (layout.copy, k) for k, i in enumerate(layout.copy_shard)}]
    works = []
    for i, holder in enumerate(holders):
        dests = [layout.owners[i]] + ([(layout.owners[i] + 1) % size] if layout.copy else [])
        for dest, target in zip(dests, targets):
            if rank == holder:
                sent = _rows(*held[i])
                if dest == rank:
                    for into, value in zip(_rows(*target[i]), sent):
                        copy_into(into, value)
                else:
                    works += [isend(comm, a, dest, _TAG, f"ZeRO settle: state {i}")
                              for a in sent]
            elif rank == dest:
                works += [irecv(comm, a, holder, _TAG, f"ZeRO settle: state {i}")
                          for a in _rows(*target[i])]
    _wait(works, timeout)
