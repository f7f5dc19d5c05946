"""SyncBatchNorm for torch models over MPI: batch statistics of every active rank's batch.

``tensorplay_mpi.SyncBatchNorm`` (this module, imported on first use: ``import
tensorplay_mpi`` does not import torch) is ``torch.nn.SyncBatchNorm`` over MPI for CPU
and CUDA tensors.  In training mode each forward pass reduces, over the ranks of its group, the
per-channel sums of the batch and of its squares with the number of samples and the
``micro_batches`` of the step in progress, one allreduce of float64 (the counts are exact
integers there); the backward pass reduces the sums of the output gradient and of its
product with the centred input (float64, accumulated over the batch in its own dtype).
Normalisation, running statistics and the gradients are then those of
``torch.nn.BatchNorm*`` over the concatenated global batch.  Only the per-channel numbers are
float64: the other passes over the batch run in its dtype (float32 for float16 and bfloat16),
the normalisation in torch's own kernel, so a layer costs about what serial BatchNorm costs
plus a float64 copy of the batch (exact sums of squares: a batch whose mean is far from zero
keeps its variance's digits).

In a Join every reduction is an operation of a :class:`~tensorplay_mpi.JoinableComm` that is
in the Join, so a rank that has joined shadows it and contributes zero samples.  A layer
converted as torch users write it, without a group (``SyncBatchNorm.convert_sync_batchnorm(
model)``), reduces through the JoinableComm of the running Join, and a DataParallel over its
parameters brings one into every Join made with it (``Join([dp])``, ``Join([dp, opt])``; see
:class:`~tensorplay_mpi.DataParallel`); outside a Join it reduces over the default
communicator, as torch's over the default group.  A layer converted with a JoinableComm,
``convert_sync_batchnorm(model, jc)``, reduces through that one, which must be in the Join
(``Join([dp, jc])``).  Layers share the JoinableComm's iteration.  With a DataParallel first in
the Join its heartbeat starts the iteration: run the forward pass inside ``with dp.step():``, no
``jc.begin_iteration()`` needed.  While ranks have joined, the statistics, DataParallel's step
and the optimizers' steps travel in one announced stream, in the order the active ranks issue
them.  A layer that reduces over a plain communicator, or a JoinableComm that is not in the
running Join, cannot be shadowed: a Join made with a DataParallel over its parameters raises
``ValueError`` on every rank, before anything starts, and its forward pass inside a running
Join on any of the same ranks raises ``RuntimeError`` before any reduction; both name the forms
above.

A rank with an empty batch contributes zero samples; a batch empty on every rank gives an empty
output and zero gradients and leaves the running statistics as they were, as
``torch.nn.BatchNorm*`` does; a global batch of one sample per channel raises ``ValueError`` on
every active rank, as torch's BatchNorm does for one (while a rank has joined, the Join
ends with it on every rank: a joined rank raises the same kind where it shadows the layer, so it
cannot be caught and skipped inside the loop).  The statistics are summed in float64, so
a float32 or bfloat16 model is as exact as serial BatchNorm in its dtype (tested: within a few
times its error, against a float64 replay).

The backward pass mixes the ranks' output gradients, each the gradient of its own rank's loss.
DataParallel's plain mean weights every rank alike, which fits; ``dp.step(samples=n)``
multiplies rank r's gradient by its ``n_r`` before dividing by their sum, so inside such a step
rank r sums ``n_r`` times its contributions and divides its result by ``n_r``: every gradient
on rank r is then that of the union's loss divided by ``n_r``, and the step's mean is the
gradient of the mean loss over the union, as serial BatchNorm on the concatenated batch gives
(a rank with ``samples=0`` and a non-empty batch cannot be weighted so: ``ValueError`` on
every rank).  The statistics of each micro-batch of ``dp.step(micro_batches=K)`` are collectives
of every active rank, so K must be the same on every active rank in a step (checked in each
forward pass: ``ValueError`` on every rank; a rank with fewer runs empty micro-batches).
"""

from __future__ import annotations

import copy
import math
import weakref
from typing import Any, NoReturn

import numpy as np
import torch
from mpi4py import MPI

from ..algorithms._joinable_comm import JoinableComm
from ..algorithms.join import JOIN_CHECK, Join
from ..comm._collectives import default_timeout, iallreduce
from ..comm._tensors import host_array
from ..parallel._data_parallel import DataParallel, current_step
from .metrics import StatesDiffer, group_of, group_size, overlap, reduce_states


def _sums(group: Any, local: np.ndarray, channels: int, check: bool = False) -> np.ndarray:
    """`local` (float64, host) summed over the group's ranks, in place: one allreduce; with
    `check` (the forward pass; later passes have the same lengths), every rank's number of
    `channels` is compared first (see reduce_states): ``ValueError`` on every rank, joined ones
    too."""
    if check:
        try:
            return reduce_states({"sums": local}, group)["sums"]
        except StatesDiffer:
            _refuse(group, ValueError(f"SyncBatchNorm: ranks have different numbers of "
                                      f"channels (this rank {channels}): every rank must run "
                                      f"the same model"))
    if isinstance(group, JoinableComm):
        return group.allreduce(local, out=local)
    iallreduce(group, MPI.IN_PLACE, local, MPI.SUM, "SyncBatchNorm's sums").wait_or_abort(
        default_timeout())
    return local


def _refuse(group: Any, error: Exception) -> NoReturn:
    """Raise `error`, which every active rank raises at this point; ranks that have joined
    raise it too, at this point (a JoinableComm's refusal)."""
    if isinstance(group, JoinableComm):
        group._refuse(error)
    raise error


def _micro_batches() -> np.ndarray:
    """``[1, K, K * K]`` (int64), K the ``micro_batches`` of the ``dp.step()`` in progress (1
    outside one): summed over the active ranks, every rank can tell whether all ran the same
    K (``ranks * sum(K * K) == sum(K) ** 2`` only when every K is equal)."""
    step = current_step()
    k = 1 if step is None else step[0]
    return np.array([1, k, k * k], dtype=np.int64)


def _check_micro_batches(group: Any, ranks: int, k_sum: int, k_squares: int) -> None:
    """Raise on every active rank (and joined ones) unless every active rank runs the same
    number of micro-batches in its ``dp.step()``: a short rank's step would end, and its
    gradient buckets be matched against another rank's next statistics."""
    if ranks * k_squares != k_sum * k_sum:
        k = int(_micro_batches()[1])
        _refuse(group, ValueError(
            f"SyncBatchNorm: the active ranks run different numbers of micro-batches in this "
            f"dp.step() (micro_batches={k} here, {k_sum / ranks:g} on average over {ranks} "
            f"ranks): the statistics of each micro-batch are one collective of every active "
            f"rank, so every rank must run the same micro_batches in a step. Pass the same K "
            f"on every rank, and let a rank with fewer micro-batches run empty ones (a batch of "
            f"0 samples, forward and backward pass: it adds nothing)"))


def _weight() -> float:
    """What DataParallel multiplies this rank's gradient by at the step's end: its
    ``samples`` in a ``dp.step(samples=)`` in progress, else 1 (a plain mean)."""
    step = current_step()
    return 1.0 if step is None or step[1] is None else float(step[1])


def _refuse_zero_weights(group: Any, ranks: float) -> None:
    """A rank with ``samples=0`` and a non-empty batch: its samples move every rank's
    statistics, but its gradient is multiplied by zero; no weighting can be exact."""
    if ranks > 0:
        _refuse(group, ValueError(
            f"SyncBatchNorm: {ranks:g} rank(s) entered dp.step(samples=0) with a non-empty "
            f"batch: its samples move the statistics of every rank's batch, but a per-sample "
            f"mean multiplies its gradient by zero, so the step could not be the gradient of "
            f"the mean loss over the union; pass each rank the number of samples its loss "
            f"averages over (0 only for an empty batch), or leave samples= out"))


def _by_channel(x: torch.Tensor) -> torch.Tensor:
    """`x` as ``(N, C, L)`` (an empty batch included)."""
    return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))


_WORKING_FORM = ("convert the model without a group, then build the DataParallel over it and "
                 "put that first in the Join: `model = SyncBatchNorm.convert_sync_batchnorm("
                 "model)`, `dp = DataParallel(model.parameters(), buffers=model.buffers(), "
                 "...)`, `Join([dp])` (or `Join([dp, opt])`), the forward pass inside `with "
                 "dp.step():`; or convert it with a JoinableComm and put that in the Join: "
                 "`jc = JoinableComm(comm); model = SyncBatchNorm.convert_sync_batchnorm(model, "
                 "jc)`, `Join([dp, jc])`")


class _LayerLink:
    """A layer's link to a DataParallel over its parameters and buffers: whether the layer
    needs the JoinableComm of a Join (it has no group), and the check that a Join made with
    the DataParallel runs: the layer must reduce through a JoinableComm of that Join, its own
    or, without a group, the Join's.  Pickled as nothing (a model saved whole loads without
    it) and shared by copies."""

    def __init__(self, layer: "SyncBatchNorm") -> None:
        self._layer = weakref.ref(layer)

    def __reduce__(self) -> tuple:
        return type(None), ()

    def __deepcopy__(self, memo: dict) -> "_LayerLink":
        return self

    @property
    def needs_stream(self) -> bool:
        """Whether the layer has no group: it reduces through the running Join's JoinableComm."""
        layer = self._layer()
        return layer is not None and layer.process_group is None

    def __call__(self, join: Any) -> None:
        layer = self._layer()
        if layer is None or not join.enabled:
            return
        group = layer.process_group
        streams = [j for j in join.joinables if isinstance(j, JoinableComm)]
        if (group is None and streams) or any(j is group for j in streams):
            return
        where = ("it has no group and the Join holds no JoinableComm" if group is None else
                 "its JoinableComm is not in this Join" if isinstance(group, JoinableComm)
                 else "it reduces over a plain communicator, which a joined rank cannot shadow")
        raise ValueError(f"a SyncBatchNorm layer of this model cannot train in this Join: "
                         f"{where} (its statistics would be matched against the gradient "
                         f"buckets of a joined rank); {_WORKING_FORM}")


def _training_group(group: JoinableComm | MPI.Intracomm | None
                    ) -> JoinableComm | MPI.Intracomm:
    """The group of a training pass of a layer whose group is `group`: that one; without one,
    the JoinableComm of the running Join, else (no Join, or one without a JoinableComm) the
    default communicator."""
    if group is not None:
        return group
    join = Join.current()
    orderer = None if join is None or join.stream is None else join.stream.orderer
    return orderer if isinstance(orderer, JoinableComm) else group_of(None)


def _check_in_join(group: JoinableComm | MPI.Intracomm, given: bool) -> None:
    """Inside a running Join over any of the ranks of `group`, `group` must be the Join's
    JoinableComm: joined ranks shadow nothing else; raise before any reduction.  `given`: the
    layer has a group of its own (else it found no JoinableComm in the Join)."""
    join = Join.current()
    if join is None:
        return
    if any(j is group for j in join.joinables):
        if isinstance(join.joinables[0], DataParallel) and current_step() is None:
            raise RuntimeError(
                "a SyncBatchNorm forward pass in training mode, in a Join that a DataParallel "
                "leads, runs inside `with dp.step():`: its heartbeat starts the iteration, and "
                "a forward pass before the step or under dp.no_sync() belongs to no iteration "
                "(a rank that has just run out of inputs would not shadow its statistics); "
                "accumulate gradients with dp.step(micro_batches=K)")
        return
    comm = group.comm if isinstance(group, JoinableComm) else group
    if overlap(comm, join.joinables[0].join_process_group) == 0:
        return
    if isinstance(group, JoinableComm):
        what = "through a JoinableComm that is not in the running Join"
    elif given:
        what = "over a plain communicator inside a running Join"
    else:
        what = ("over a plain communicator inside a running Join (converted without a group, it "
                "reduces through the running Join's JoinableComm, and this Join has none: the "
                "DataParallel over the model, built after converting it, is not in it)")
    raise RuntimeError(f"SyncBatchNorm reduces {what}, where ranks that have joined cannot "
                       f"shadow it; {_WORKING_FORM}")


def _working(x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype the elementwise passes run in: its own for float32 and float64, float32
    for narrower floats (as torch's CPU kernels compute them)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _vector(values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Per-channel float64 `values` as a tensor of `like`'s dtype and device."""
    return torch.from_numpy(values).to(like.device, like.dtype)


def _per_channel(values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """Per-channel `values` shaped ``(1, C, 1)`` to scale a batch `like` (:func:`_by_channel`)."""
    return _vector(values, like)[None, :, None]


def _host(sums: torch.Tensor) -> np.ndarray:
    """Per-channel sums on the host: a view of a CPU tensor, a copy of a device one."""
    return sums.numpy() if sums.device.type == "cpu" else host_array(sums, "sums")


def _lost(dtype: torch.dtype) -> float:
    """The ratio ``E[x^2] / var`` above which the variance from the sums of the values and of
    their squares (float64) is less exact than the batch's dtype can tell apart (for float64, 1e-12
    relative): float64 keeps ``2**-53 * ratio`` of its digits' worth in error."""
    working = dtype if dtype in (torch.float32, torch.float64) else torch.float32  # _working
    return max(torch.finfo(working).eps / 16, 2.0 ** -40) / 2.0 ** -53


def _centred(group: Any, wide: torch.Tensor, mean: np.ndarray, count: int,
             channels: int) -> tuple[np.ndarray, np.ndarray]:
    """The mean and the variance from the sums of ``x - mean`` and of its squares (float64),
    one more allreduce: exact where the mean is far from zero (every active rank takes this
    pass alike: it decides from the same sums)."""
    centred = wide - torch.from_numpy(mean).to(wide.device)[None, :, None]
    local = np.concatenate([_host(centred.sum((0, 2))), _host(centred.square().sum((0, 2)))])
    totals = _sums(group, local, channels)
    shift = totals[:channels] / count
    return mean + shift, np.maximum(totals[channels:] / count - shift * shift, 0.0)


class _SyncBatchNormFunction(torch.autograd.Function):
    """The statistics of every rank's batch, summed in float64 (one allreduce of 2C + 4
    numbers); the per-channel arithmetic in NumPy; the passes over the batch in its own dtype
    (float32 for narrower floats), the normalisation in torch's kernel: the same work per
    element as serial BatchNorm, but a float64 copy for the sums of squares."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, factor: float,
                group: Any) -> torch.Tensor:
        channels = x.shape[1]
        flat = _by_channel(x.detach())
        wide = flat.double()  # exact squares: the variance of a batch whose mean is far from 0
        local = np.concatenate([_host(wide.sum((0, 2))), _host(wide.square().sum((0, 2))),
                                [flat.shape[0] * flat.shape[2]], _micro_batches()])
        totals = _sums(group, local, channels, check=True)  # counts: exact in float64
        count, *micro_batches = (int(v) for v in totals[2 * channels:])
        _check_micro_batches(group, *micro_batches)
        if count == 1:
            _refuse(group, ValueError(
                f"Expected more than 1 value per channel when training, got {count} over "
                f"every rank (input size {list(x.shape)} here)"))
        mean = totals[:channels] / max(count, 1)  # empty everywhere: as serial, an empty
        second = totals[channels:2 * channels] / max(count, 1)  # output
        var = np.maximum(second - mean * mean, 0.0)
        if np.any(second > _lost(flat.dtype) * var):  # E[x^2] - E[x]^2 lost too many digits:
            mean, var = _centred(group, wide, mean, count, channels)  # a second pass
        if running_mean is not None and running_var is not None and count > 0:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(_vector(factor * mean, running_mean))
                running_var.mul_(1 - factor).add_(
                    _vector(factor * var * count / (count - 1), running_var))
        work = _working(flat)
        moments = _vector(np.stack([mean, var]), work)
        y = torch.nn.functional.batch_norm(  # (x - mean) * invstd * weight + bias
            work, moments[0], moments[1],
            None if weight is None else weight.detach().to(work.dtype),
            None if bias is None else bias.detach().to(work.dtype), False, 0.0, eps)
        ctx.save_for_backward(x, weight)
        ctx.mean, ctx.invstd = mean, 1.0 / np.sqrt(var + eps)
        ctx.count, ctx.group, ctx.has_bias = count, group, bias is not None
        return y.to(x.dtype).reshape(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        mean, invstd = ctx.mean, ctx.invstd
        channels = x.shape[1]
        flat = _working(_by_channel(x))
        dy = _working(grad.reshape(flat.shape))
        xmu = flat - _per_channel(mean, flat)
        sum_dy = _host(dy.sum((0, 2), dtype=torch.float64))
        sum_dy_xmu = _host((dy * xmu).sum((0, 2), dtype=torch.float64))
        grad_input = None
        if ctx.needs_input_grad[0]:  # `dy` is this rank's loss's: weighted as DataParallel
            share = _weight()  # will weight it (see the module's docstring)
            zero = float(share == 0 and x.numel() > 0)
            totals = _sums(ctx.group, np.concatenate([sum_dy * share, sum_dy_xmu * share,
                                                      [zero]]), channels)
            _refuse_zero_weights(ctx.group, float(totals[-1]))
            count = max(ctx.count, 1) * (share or 1.0)  # and unweighted here
            mean_dy, mean_dy_xmu = totals[:channels] / count, totals[channels:-1] / count
            scale = invstd if weight is None else invstd * _host(weight.detach().double())
            # scale * (dy - mean_dy - xmu * invstd^2 * mean_dy_xmu), per channel in float64
            factors = _vector(np.stack([-scale * invstd * invstd * mean_dy_xmu, scale,
                                        scale * mean_dy]), flat)[:, None, :, None]
            grad_input = xmu.mul_(factors[0]).addcmul_(dy, factors[1]).sub_(factors[2])
            grad_input = grad_input.to(x.dtype).reshape(x.shape)
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:  # local: the gradient averaging
            grad_weight = _vector(sum_dy_xmu * invstd, weight)  # sums them
        if ctx.has_bias and ctx.needs_input_grad[2]:  # over the ranks
            grad_bias = _vector(sum_dy, x)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalisation over the batches of every (active) rank, through MPI.

    The arguments of ``torch.nn.SyncBatchNorm``; inputs of shape ``(N, C, ...)`` on the CPU or
    a CUDA device (the 2C sums of each pass go to MPI through the host).
    In training mode collective over `process_group`: every active rank runs each forward pass
    (and the backward pass, where the input needs a gradient), an empty batch included.

    Parameters
    ----------
    num_features, eps, momentum, affine, track_running_stats, device, dtype
        As for ``torch.nn.BatchNorm1d``.
    process_group : JoinableComm or mpi4py.MPI.Intracomm, optional
        Inside a Join, the :class:`~tensorplay_mpi.JoinableComm` in the Join; outside one,
        any communicator.  None (the default): the JoinableComm of the running Join (a
        DataParallel over the layer's parameters brings one into its Joins), else
        ``MPI.COMM_WORLD``.

    Raises
    ------
    ValueError
        In training, when every rank together has one value per channel; for an input of
        fewer than 2 dimensions; when a Join is made with a DataParallel over the layer's
        parameters and the layer cannot reduce through a JoinableComm of that Join; on
        every rank, when the active ranks entered their ``dp.step()`` with different
        ``micro_batches``, or, in the backward pass, when a rank passed ``samples=0`` with a
        non-empty batch.
    RuntimeError
        In training inside a running Join on any of the same ranks, over a plain communicator
        or through a JoinableComm that is not in the Join.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: JoinableComm | MPI.Intracomm | None = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = None if process_group is None else group_of(process_group)
        self._tag_tensors()

    def _tag_tensors(self) -> None:
        """Let a DataParallel over this layer's parameters or buffers hold a JoinableComm for it
        and check the Joins it is made into."""
        check = _LayerLink(self)
        for t in (self.weight, self.bias, self.running_mean, self.running_var,
                  self.num_batches_tracked):
            if t is not None:
                setattr(t, JOIN_CHECK, check)  # read by a DataParallel over them

    def __getstate__(self) -> dict[str, Any]:
        """A model saved whole (``torch.save(model)``): the group is not saved (a communicator
        cannot be pickled); the loaded layer has none, as one converted without a group, until
        it is converted again with one, ``convert_sync_batchnorm(model, jc)``."""
        state = dict(self.__dict__)
        state["process_group"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._tag_tensors()

    def __deepcopy__(self, memo: dict) -> "SyncBatchNorm":
        """A copy (``copy.deepcopy(model)``) shares the group, as it shares ``COMM_WORLD``."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            copied.__dict__[name] = (value if name == "process_group" else
                                     copy.deepcopy(value, memo))
        copied._tag_tensors()
        return copied

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        tracking = self.training and self.track_running_stats
        factor = 0.0 if self.momentum is None else self.momentum
        if tracking and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training:  # as torch: no collective in eval mode
            return torch.nn.functional.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias,
                self.running_mean is None, 0.0, self.eps)
        group = _training_group(self.process_group)
        _check_in_join(group, self.process_group is not None)
        if group_size(group) == 1:
            return torch.nn.functional.batch_norm(
                input, self.running_mean if tracking else None,
                self.running_var if tracking else None, self.weight, self.bias, True, factor,
                self.eps)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean if tracking else None,
            self.running_var if tracking else None, self.eps, factor, group)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_group: JoinableComm | MPI.Intracomm | None = None
                               ) -> torch.nn.Module:
        """`module` with every ``BatchNorm*D`` layer replaced by a :class:`SyncBatchNorm`.

        As ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: parameters, running statistics
        and the training flag are carried over (shared, not copied); the module returned is
        `module` itself unless `module` is a batch-norm layer.  A layer converted before (a
        loaded model, say) takes `process_group` when one is given.
        """
        converted = module
        if isinstance(module, SyncBatchNorm) and process_group is not None:
            module.process_group = group_of(process_group)  # converted before: the group given
        elif isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(
                module, SyncBatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted._tag_tensors()
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted


# A pickled model (torch.save) names the class by its public path, which imports it on first
# use: the private module may move without breaking saved models.
SyncBatchNorm.__module__ = "tensorplay_mpi.evaluation"
