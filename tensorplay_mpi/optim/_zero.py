"""ZeroRedundancyOptimizer: optimizer state sharded over ranks, as a Joinable.

Each rank owns a shard of the parameters, keeps optimizer state only for it, and steps it;
then every parameter is broadcast from its owner.  Parameters smaller than
:data:`DIRECT_BYTES` travel packed, one byte buffer per owner (copied in on the owner, out on
the others: one ``Ibcast`` per owner, however many parameters); larger ones are broadcast
in place, one ``Ibcast`` each, no copy (at most one per :data:`DIRECT_BYTES` of the model).
All are started before any is waited.

Parameters that share memory (the same array listed twice, views of one buffer) are refused
on every rank, as the local optimizers refuse them: two broadcasts would write the same bytes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from ..algorithms._guarded_joinable import GuardedJoinable
from ..algorithms.join import ElasticJoinable, Join
from ..comm._buffers import check_disjoint, device_of, zeros_like
from ..comm._collectives import Work, ibcast, irecv, isend
from ..comm import _torch_cuda as torch_cuda
from ..comm._tensors import as_arrays
from ._clip import clip_grad_norm
from ._linked import LinkedOptimizer
from ._local import Adam, Optimizer
from ._protocol import OptimizerState, check_params, refuse_bfloat16, check_state, is_writeable
from ._zero_copies import Layout, refresh_copies, reshard

_TAG = 0x2E60  # of the state messages of consolidate_state_dict

DIRECT_BYTES = 1 << 20
"""A parameter of at least this many bytes is broadcast on its own, in place."""


def partition(nbytes: Sequence[int], size: int) -> list[int]:
    """Owner rank of each parameter: largest first onto the least loaded rank (ties: lowest).

    Deterministic: every rank computes the same owners from the same sizes.
    """
    loads = [0] * size
    owners = [0] * len(nbytes)
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        rank = min(range(size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += nbytes[i]
    return owners


def sync_plan(params: Sequence[Any], owners: Sequence[int], size: int,
              every_rank: bool = False) -> tuple[list[tuple[int, Any, list]], list[int]]:
    """The broadcasts of a step, the same on every rank: per owner with packed parameters,
    its byte buffer and (bytes of the buffer, bytes of the parameter) view pairs; and the
    parameters broadcast on their own.  With `every_rank`, a rank that owns no parameter
    with elements broadcasts one byte, so that no rank completes a step's sync before every
    rank has stepped its shard (what the copies' settle needs)."""
    packed: list[list[int]] = [[] for _ in range(size)]
    direct = []
    for i, p in enumerate(params):
        if p.nbytes >= DIRECT_BYTES:
            direct.append(i)
        elif p.nbytes:
            packed[owners[i]].append(i)
    broadcasting = {owners[i] for i in direct}
    packs: list[tuple[int, Any, list]] = []
    for owner, members in enumerate(packed):
        if not members and every_rank and owner not in broadcasting and params:
            packs.append((owner, zeros_like(params[0], 1, np.uint8), []))
        if not members:
            continue
        flat = zeros_like(params[members[0]], sum(params[i].nbytes for i in members), np.uint8)
        views, offset = [], 0
        for i in members:
            mine = params[i].reshape(-1).view(np.uint8)
            views.append((flat[offset:offset + mine.size], mine))
            offset += mine.size
        packs.append((owner, flat, views))
    return packs, direct


def sync_parameters(comm: MPI.Intracomm, rank: int, params: Sequence[Any],
                    owners: Sequence[int], packs: list[tuple[int, Any, list]],
                    direct: list[int], wait_all: Callable[[list[Work]], None]) -> None:
    """Broadcast every parameter from its owner (a plan of :func:`sync_plan`), all started
    before any is waited (`wait_all`).  Collective over `comm`."""
    works = []
    for owner, flat, views in packs:
        if owner == rank:
            for packed, param in views:
                packed[...] = param
        works.append(ibcast(comm, flat, owner,
                            f"parameter sync (the {len(views)} packed of rank {owner})"))
    works += [ibcast(comm, params[i], owners[i], f"parameter sync {i}") for i in direct]
    wait_all(works)
    for owner, _, views in packs:
        if owner != rank:
            for packed, param in views:
                param[...] = packed


class ZeroRedundancyOptimizer(GuardedJoinable, LinkedOptimizer, ElasticJoinable,
                              OptimizerState):
    """Optimizer whose state is sharded over the ranks of `comm`.

    Collective over `comm`: every rank constructs it with the same parameter shapes, dtypes
    and order, the same optimizer class and hyperparameters, and no two arrays sharing memory
    (checked: ``ValueError`` on every rank otherwise), and calls :meth:`step` in the same
    iterations.

    Parameters
    ----------
    params, grads : sequence of arrays or torch tensors (CPU or CUDA)
        The parameters (updated in place on every rank) and their gradients (for example
        ``dp.grads``, which hold the average after ``dp.step()``).
    optimizer_class : type, default Adam
        A local optimizer class from :mod:`tensorplay_mpi.optim`; it runs on this rank's shard.
    comm, timeout
        As for :class:`~tensorplay_mpi.algorithms.GuardedJoinable`; `comm` defaults to the
        communicator of the DataParallel whose ``dp.grads`` are the `grads`.
    copies : bool, default False
        Also keep a copy of the previous rank's shard (mod the size), stepped with the same
        gradients, so that ``Join([dp, zero], elastic=True)`` goes on without a lost rank
        (docs/elastic.md); twice the state per rank and a second shard's update per step.
    **defaults
        Hyperparameters of `optimizer_class` (``lr``, ``betas``, ...).  ``max_grad_norm``
        clips all gradients (not only the shard's) to that total norm before each step.

    Notes
    -----
    Under ``Join([dp, zero])`` a joined rank's hook steps this rank's shard with the gradients
    that DataParallel's hook wrote into ``dp.grads`` and takes part in the parameter sync, so
    every shard advances as if its rank were active.  Call :meth:`step` once per iteration
    (per ``dp.step()``): accumulate gradients inside one step rather than with ``no_sync``.
    Bound to ``dp.grads``, it must be in every Join of ``dp`` (checked, ``RuntimeError``).
    Hyperparameters change between steps through :attr:`param_groups`, the same on every rank.
    """

    _announces_blocks = True  # its step: one announced block (shard update, parameter sync)
    _needs_writer = False  # alone in a Join, with gradients of its own, it needs none before it

    def __init__(self, params: Sequence[Any], grads: Sequence[Any],
                 optimizer_class: type[Optimizer] = Adam, comm: MPI.Intracomm | None = None,
                 timeout: float | None = None, copies: bool = False, **defaults: Any) -> None:
        super().__init__(self._link_grads(grads, comm), timeout)
        self.params = as_arrays(refuse_bfloat16(params), "params")  # torch tensors: NumPy views
        grads = as_arrays(grads, "grads")
        try:  # memory sharing is no part of the layout: a rank that has it refuses
            check_disjoint(params=self.params, grads=grads)
            if not isinstance(copies, bool):
                raise TypeError(f"copies must be True or False, got {copies!r}")
            refused = None
        except (TypeError, ValueError) as error:
            refused = error
        layout = ([(p.shape, p.dtype.str, p.flags.c_contiguous, is_writeable(p))
                   for p in self.params],
                  [g.shape for g in grads], optimizer_class.__qualname__,
                  [(k, getattr(v, "__qualname__", v)) for k, v in sorted(defaults.items())],
                  copies)
        self._check_arguments(
            refused, layout,
            "parameters, gradients or optimizer settings",
            f"params {[(p.shape, p.dtype.str) for p in self.params]}, "
            f"{len(grads)} grads and {optimizer_class.__name__}({defaults}), copies={copies}")
        # identical everywhere from here on, so every check below gives one verdict
        check_params(self.params, grads)  # every param, not only this rank's shard
        self.grads = grads
        self.max_grad_norm = defaults.pop("max_grad_norm", None)  # of all grads, not a shard
        if self.max_grad_norm is not None and not self.max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {self.max_grad_norm!r}")
        self.copies = copies
        self.optimizer_class = optimizer_class
        self.device = device_of(self.params[0]) if self.params else "cpu"
        self._adopt(self._lay_out(self.comm, defaults))
        self._consolidated: dict[str, Any] | None = None
        self._resharded: tuple[MPI.Intracomm, Layout] | None = None
        self._step_with_link(must_join=True)  # in place of its shard optimizer

    def _lay_out(self, comm: MPI.Intracomm, defaults: dict[str, Any]) -> Layout:
        """The shards at the size of `comm` as its rank sees them: the owners, this rank's
        shard optimizer and, with copies, that of the copy of the previous rank's shard."""
        size, rank = comm.Get_size(), comm.Get_rank()
        owners = partition([p.nbytes for p in self.params], size)

        def shard_optimizer(owner: int) -> tuple[list[int], Optimizer]:
            shard = [i for i, o in enumerate(owners) if o == owner]
            return shard, self.optimizer_class([self.params[i] for i in shard],
                                               [self.grads[i] for i in shard], comm=comm,
                                               **defaults)
        shard, local = shard_optimizer(rank)
        copy_shard: list[int] = []
        copy: Optimizer | None = None
        if self.copies and size > 1:
            copy_shard, copy = shard_optimizer((rank - 1) % size)
        packs, direct = sync_plan(self.params, owners, size, every_rank=self.copies)
        return Layout(owners, shard, local, copy_shard, copy, packs, direct)

    def _adopt(self, layout: Layout) -> None:
        """Work with `layout` from now on."""
        self.owners, self.shard, self.local = layout.owners, layout.shard, layout.local
        self._shard_index = np.asarray(self.shard, dtype=np.intp)
        self._copy_shard, self._copy = layout.copy_shard, layout.copy
        self._copy_index = np.asarray(self._copy_shard, dtype=np.intp)
        self._packs, self._direct = layout.packs, layout.direct
        self._link_copy()

    def _link_copy(self) -> None:
        """The copy reads the shard optimizer's hyperparameters (one group, one schedule)."""
        if self._copy is not None:
            self._copy.param_groups, self._copy.defaults = (self.local.param_groups,
                                                             self.local.defaults)

    sharded = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The hyperparameters of this rank's shard optimizer, read at each step."""
        return self.local.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The constructor's hyperparameters of this rank's shard optimizer."""
        return self.local.defaults

    def step(self) -> None:
        """Step this rank's shard, then broadcast every parameter from its owner.

        Collective over ``comm``.
        """
        Join.notify_join_context(self)
        self._step_shard_and_sync()

    def _step_shard_and_sync(self) -> None:
        # torch CUDA tensors: the clip and the update after torch's writes, torch's after ours
        with torch_cuda.handed():
            if self.max_grad_norm is not None:
                clip_grad_norm(self.grads, self.max_grad_norm)
            used = self._used()
            self.local.update(None if used is None else used[self._shard_index])
            if self._copy is not None:  # the previous rank's update, the same arithmetic
                self._copy.update(None if used is None else used[self._copy_index])
            self._sync_parameters()

    def _sync_parameters(self) -> None:
        """Every parameter from the rank that owns it (its shard's update)."""
        sync_parameters(self.comm, self.rank, self.params, self.owners, self._packs,
                        self._direct, self._wait_all)

    def _sync_with(self, comm: MPI.Intracomm, owners: list[int], timeout: float) -> None:
        """Every parameter from `owners` (ranks of `comm`), once: a plan of its own."""
        packs, direct = sync_plan(self.params, owners, comm.Get_size())

        def wait_all(works: list[Work]) -> None:
            for work in works:
                work.wait_or_abort(timeout)
        sync_parameters(comm, comm.Get_rank(), self.params, owners, packs, direct, wait_all)

    @property
    def state_nbytes(self) -> int:
        """Bytes of optimizer state held by this rank: its shard's, and with copies the copy's
        of the previous rank's shard."""
        return self.local.state_nbytes + (self._copy.state_nbytes if self._copy else 0)

    # -- checkpoints -------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state on rank `to` (point-to-point, nonblocking).

        Collective over ``comm``: every rank calls it, outside a Join.  Afterwards
        :meth:`state_dict` on rank `to` returns the full state.
        """
        if not 0 <= to < self.size:
            raise ValueError(f"to must be a rank in [0, {self.size}), got {to!r}")
        mine = self.local.state_dict()
        full = {k: mine[k] for k in ("optimizer", "defaults", "param_groups", "schedules",
                                     "steps")}  # the groups: the same on every rank
        full["param_groups"] = [dict(group, max_grad_norm=self.max_grad_norm)  # clipped here,
                                for group in full["param_groups"]]  # over all, not a shard
        full["param_steps"] = steps = np.zeros(len(self.params), dtype=np.int64)
        steps[self._shard_index] = mine["param_steps"]
        full["state"] = {i: mine["state"][k] for k, i in enumerate(self.shard)}
        works: list[Work] = []
        for i, owner in enumerate(self.owners):
            if owner == to or self.rank not in (owner, to):
                continue
            if self.rank == to:
                full["state"][i] = {}
            for name in self.local.state_names:  # in order: MPI never overtakes a message
                if self.rank == owner:
                    works.append(isend(self.comm, full["state"][i][name], to, _TAG))
                else:
                    buf = full["state"][i][name] = zeros_like(self.params[i])
                    works.append(irecv(self.comm, buf, owner, _TAG))
            count = steps[i:i + 1]  # the parameter's own step count, after its state
            works.append(isend(self.comm, count, to, _TAG) if self.rank == owner
                         else irecv(self.comm, count, owner, _TAG))
        self._wait_all(works)
        if self.rank == to:
            full["state"] = dict(sorted(full["state"].items()))
        self._consolidated = full if self.rank == to else None

    def state_dict(self) -> dict[str, Any]:
        """The full state gathered by :meth:`consolidate_state_dict`, on its rank `to`.

        Raises
        ------
        RuntimeError
            On other ranks, or before :meth:`consolidate_state_dict`.
        """
        if self._consolidated is None:
            raise RuntimeError(f"rank {self.rank}: no consolidated state here; call "
                               "consolidate_state_dict(to) on every rank, then state_dict() "
                               "on rank `to`")
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from any world size, or a local optimizer): take this shard.

        Raises
        ------
        ValueError
            If it does not match these parameters or this optimizer class.
        """
        self.check_state_dict(state_dict)
        state = state_dict["state"]
        steps = state_dict.get("param_steps")
        steps = np.full(len(self.params), state_dict["steps"]) if steps is None else \
            np.asarray(steps)
        shard = dict(state_dict, state={k: state[i] for k, i in enumerate(self.shard)},
                     param_steps=steps[self._shard_index])
        self._load_shard(shard)
        if self._copy is not None:
            self._copy.load_state_dict(dict(
                state_dict, state={k: state[i] for k, i in enumerate(self._copy_shard)},
                param_steps=steps[self._copy_index]))
            self._link_copy()

    def check_state_dict(self, state_dict: dict[str, Any], shard: bool = False,
                         source: str = "the state dict") -> None:
        """Raise ``ValueError`` unless `state_dict` is a state of `optimizer_class` for every
        parameter, or with `shard` for this rank's shard (numbered from 0)."""
        if shard:  # the shard optimizer's own check
            self.local.check_state_dict(state_dict, source=source)
        else:
            check_state(state_dict, self.optimizer_class.__name__, self.local.state_names,
                        [p.shape for p in self.params], source)

    def shard_state_dict(self) -> dict[str, Any]:
        """The state of this rank's shard (its parameters numbered from 0); local."""
        return self.local.state_dict()

    def load_shard_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`shard_state_dict` gave on this rank at the same world size.

        With copies, collective over ``comm`` (each rank sends its shard's state to the next
        rank's copy): every rank loads its own.
        """
        self._load_shard(state_dict)
        refresh_copies(self)

    def _load_shard(self, state_dict: dict[str, Any]) -> None:
        self.local.load_state_dict(state_dict)
        self.local.set_hyperparameter("max_grad_norm", None)  # ZeRO clips all, never a shard
        self._link_copy()

    def shard_owners(self, size: int) -> list[int]:
        """The owner of each parameter at world size `size`, as every rank computes it."""
        return partition([p.nbytes for p in self.params], size)

    # -- Joinable ------------------------------------------------------------------------------

    def replicated_arrays(self) -> list[Any]:
        """The parameters (the state is sharded: each rank's own)."""
        return list(self.params)

    def _shadow_step(self) -> None:
        """A joined rank's step: this rank's shard (and copy) with the gradients, and its part
        in the parameter sync."""
        self._step_shard_and_sync()

    def _made_into(self, join: Join) -> None:
        if join.elastic and not self.copies:
            raise ValueError(
                "Join(elastic=True): a ZeroRedundancyOptimizer goes on without a lost rank "
                "only with copies=True (each shard's state also on the next rank; "
                "docs/elastic.md); without, leave elastic off and resume from periodic saves")
        super()._made_into(join)

    # -- ElasticJoinable: an elastic Join's settle (docs/elastic.md) -----------------------

    def elastic_progress(self) -> int | None:
        """The steps applied on this rank."""
        return self.local.steps

    def elastic_state(self) -> list[Any]:
        """None: the settle makes the parameters whole and moves the shards from the copies
        before its broadcast, and adopts them in :meth:`elastic_restore`."""
        return []

    def _elastic_reshard(self, comm: MPI.Intracomm, step: int, root: int,
                         timeout: float) -> None:
        """The settle's hook: the shards on `comm` at `step`, from the copies (collective over
        `comm`); adopted by :meth:`elastic_restore` once every survivor has them."""
        self._resharded = (comm, reshard(self, comm, step, root, timeout))

    def elastic_restore(self) -> None:
        """Adopt the shards made by the settle's hook."""
        if self._resharded is not None:
            self._adopt(self._resharded[1])

    def move_to(self, comm: MPI.Intracomm) -> None:
        """Work on `comm` from now on (collective over `comm`): re-sharded there by the settle,
        or here (:meth:`~tensorplay_mpi.errors.RanksLostError.move` after a loss outside its
        steps) from the copies."""
        settled, self._resharded = self._resharded, None
        if settled is None or settled[0] is not comm:
            self._adopt(reshard(self, comm, self.local.steps, 0, self.timeout, settling=False))
        super().move_to(comm)
        for optimizer in (self.local, self._copy):
            if optimizer is not None:
                optimizer.move_to(comm)
