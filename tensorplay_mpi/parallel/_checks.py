"""DataParallel's argument checks: local, so that what one rank refuses, every rank learns.

The constructor's checks (:func:`check_construction`) run on each rank before the collective
agreement on the arguments (``GuardedJoinable._check_arguments``): a rank that refused raises
its own error there, the others the same kind naming it.  The step's checks
(:func:`check_step`, :func:`check_unused`, :func:`check_requires_grad`) read the arguments of
``dp.step()`` and the model's ``requires_grad``; every rank runs the same code, so each raises
at the same point.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ..comm._buffers import check_disjoint, device_of, is_device_array
from ..comm._tensors import as_arrays, is_bfloat16, is_tensor
from ._compress import COMPRESSIONS
from ._narrow import format_name
from ._torch_grads import check_unbound, frozen_mask


class Arguments(NamedTuple):
    """DataParallel's arguments once checked."""

    given: list[Any]
    """The caller's params: arrays or torch tensors."""
    params: list[Any]
    """The arrays the library works on (a torch tensor: the NumPy or CuPy view of it)."""
    buffers: list[Any]
    given_buffers: list[Any]
    """The caller's buffers: arrays or torch tensors."""
    frozen: list[bool]
    """Per parameter: a torch ``Parameter`` with ``requires_grad=False``."""
    device: str
    broadcast_from: int
    update: Callable[[], Any] | None
    compress: str | None
    """None, or the 16-bit format of the wire: ``"bf16"`` or ``"fp16"``."""


def check_construction(params: Any, buffers: Any, bucket_cap_mb: Any, broadcast_from: Any,
                       update: Any, size: int, compress: Any = None) -> Arguments:
    """DataParallel's arguments, checked on this rank.

    Raises
    ------
    TypeError, ValueError
        As :class:`~tensorplay_mpi.DataParallel` says, for this rank's arguments.
    """
    given, arrays = _check_arrays(params, "params", floating=True)
    frozen = frozen_mask(given)
    check_unbound(given)
    given_buffers, buffer_arrays = _check_arrays(buffers, "buffers", floating=False)
    device = _one_device(arrays + buffer_arrays)
    check_disjoint(params=arrays, buffers=buffer_arrays)
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    root = _check_rank(broadcast_from, "broadcast_from", size)
    _check_compress(compress, arrays, frozen, device)
    return Arguments(given, arrays, buffer_arrays, given_buffers, frozen, device, root,
                     _check_update(update), compress)


def _check_compress(compress: Any, arrays: list[Any], frozen: list[bool], device: str) -> None:
    """Raise unless `compress` is None, or ``"bf16"`` or ``"fp16"`` with float32 params on
    the CPU (but frozen ones, which are never reduced)."""
    if compress is None:
        return
    if compress not in COMPRESSIONS:
        raise ValueError(f"compress must be None, 'bf16' or 'fp16', got {compress!r}")
    for i, (array, still) in enumerate(zip(arrays, frozen)):
        if array.dtype != np.float32 and not still:
            raise TypeError(f"compress={compress!r} takes float32 params (as DDP's compression "
                            f"hooks), params[{i}] is {format_name(array.dtype)}")
    if device != "cpu":
        raise TypeError(f"compress={compress!r} takes params on the CPU, got {device}")


def _check_arrays(given: Any, name: str, floating: bool) -> tuple[list[Any], list[Any]]:
    """The caller's arrays and tensors, and the arrays the library works on (torch tensors:
    NumPy views of their memory); raises if they cannot be trained in place."""
    if isinstance(given, np.ndarray) or is_device_array(given) or is_tensor(given):
        raise TypeError(f"{name}: pass a sequence of arrays (got one "
                        f"{type(given).__name__}: use [array])")
    given = list(given)
    arrays = as_arrays(given, name, bits=True)  # bfloat16: its bits, int16
    for i, array in enumerate(arrays):
        if not (isinstance(array, np.ndarray) or is_device_array(array)):
            raise TypeError(f"{name}[{i}] must be a NumPy or CuPy array or a torch tensor, "
                            f"got {type(array).__name__}")
        if floating:
            _check_floating(given[i], array, f"{name}[{i}]")
        if array.dtype == object:
            raise TypeError(f"{name}[{i}] has dtype object, which MPI cannot send")
        if not array.flags.c_contiguous:
            raise ValueError(f"{name}[{i}] must be C-contiguous ({_contiguous_remedy(given[i])})")
        if not getattr(array.flags, "writeable", True):
            raise ValueError(f"{name}[{i}] is read-only: DataParallel writes it on every rank "
                             "(broadcasts from other ranks, in-place updates)")
    return given, arrays


def _check_floating(given: Any, array: Any, name: str) -> None:
    """Raise ``TypeError`` unless `array` (of the caller's `given`) is a float32 or float64
    array, or a float16 or bfloat16 one in host memory (reduced through float32)."""
    if array.dtype in (np.float32, np.float64):
        return
    if array.dtype == np.float16 or is_bfloat16(given):
        if not isinstance(array, np.ndarray):
            kind = "bfloat16" if is_bfloat16(given) else "float16"
            raise TypeError(f"{name} is {kind} on a GPU: DataParallel takes half-precision "
                            "params on the CPU")
        return
    raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {array.dtype}")


def _contiguous_remedy(given: Any) -> str:
    """How to make `given` contiguous in place: a copy would train memory nobody reads."""
    if is_tensor(given):
        return ("a torch tensor: make the model's own tensor contiguous before DataParallel is "
                "built, `with torch.no_grad(): p.data = p.data.contiguous()`; passing "
                "p.contiguous() would train a copy the model never reads")
    return "use numpy.ascontiguousarray, and train the copy"


def _check_update(update: Any) -> Callable[[], Any] | None:
    if update is not None and not callable(update):
        raise TypeError(f"update must be a callable taking no argument (for example "
                        f"opt.step), got {type(update).__name__}")
    return update


def _one_device(arrays: list[Any]) -> str:
    devices = {device_of(a) for a in arrays}
    if len(devices) > 1:
        where = ", ".join(f"[{i}] on {device_of(a)}" for i, a in enumerate(arrays))
        raise ValueError(f"params and buffers must be on one device, got {where}")
    return devices.pop() if devices else "cpu"


def _check_rank(value: Any, name: str, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int rank, got {value!r}")
    if not 0 <= int(value) < size:
        raise ValueError(f"{name} must be a rank in [0, {size}), got {value!r}")
    return int(value)


def check_step(micro_batches: Any, unused: Sequence[int], samples: Any,
               bound: np.ndarray, compress: str | None = None
               ) -> tuple[int, np.ndarray | None, int | None]:
    """``dp.step()``'s arguments: `micro_batches` and `samples` as ints, `unused` as an index
    array (None if empty); `bound` says, per parameter, whether autograd tells whether it is
    used (a torch parameter that requires gradients); `compress`, the DataParallel's.

    Raises
    ------
    TypeError
        If `micro_batches` is not an int, `samples` not an int or None, or `unused` not a
        sequence of ints.
    ValueError
        If ``micro_batches < 1``, ``samples < 0``, `samples` with `compress` (the sample
        counts would ride in 16 bits, exact only to 256 in bfloat16), or `unused` names a
        bound parameter.
    IndexError
        If `unused` names no parameter.
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, numbers.Integral):
        raise TypeError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    indices = _check_unused(unused, bound) if len(unused) else None
    if samples is not None and (isinstance(samples, bool)
                                or not isinstance(samples, numbers.Integral)):
        raise TypeError(f"samples must be an int >= 0 or None, got {samples!r}")
    if samples is not None and samples < 0:
        raise ValueError(f"samples must be an int >= 0 or None, got {samples!r}")
    if samples is not None and compress is not None:
        raise ValueError(f"samples= with compress={compress!r}: the sample counts would be "
                         "summed in 16 bits; average per sample without compress")
    return int(micro_batches), indices, None if samples is None else int(samples)


def _check_unused(unused: Sequence[int], bound: np.ndarray) -> np.ndarray:
    indices = np.asarray(unused)
    if indices.dtype.kind not in "iu" or indices.ndim != 1:
        raise TypeError(f"unused must be a sequence of int parameter indices, got {unused!r}")
    for i in indices.tolist():
        if not 0 <= i < len(bound):
            raise IndexError(f"unused: parameter index {i} out of range [0, {len(bound)})")
        if bound[i]:
            raise ValueError(f"unused: parameter {i} is a torch parameter that requires "
                             "gradients; whether it is used is read from autograd (its "
                             "p.grad), not passed")
    return indices


def check_requires_grad(requires: list[tuple[int, Any, bool]]) -> None:
    """Raise ``RuntimeError`` if a torch parameter of `requires`, ``(index, parameter,
    requires_grad when DataParallel was built)``, was frozen or unfrozen since."""
    for i, p, required in requires:
        if bool(p.requires_grad) != required:
            state = "frozen" if required else "unfrozen"
            raise RuntimeError(
                f"params[{i}] was {state} (requires_grad set to {not required}) after "
                "DataParallel was built; DataParallel reads requires_grad once, as DDP: "
                "build a new DataParallel after changing which parameters train")


def check_ready(index: int, ready: np.ndarray, bucket_of: list[int]) -> None:
    """Raise unless ``mark_ready(index)`` names a parameter with a bucket that is not ready yet
    (`ready`, per parameter, in this step)."""
    if not 0 <= index < len(ready):
        raise IndexError(f"parameter index {index} out of range [0, {len(ready)})")
    if ready[index]:
        raise RuntimeError(f"mark_ready({index}) was already called in this step")
    if bucket_of[index] < 0:
        raise ValueError(f"mark_ready({index}): parameter {index} is frozen (it has no bucket)")


def check_per_sample(ranks: int, active: int, step: int) -> None:
    """Raise ``RuntimeError`` unless all or none of the `active` ranks of step number `step`
    passed ``samples=`` (`ranks` did)."""
    if ranks not in (0, active):
        raise RuntimeError(f"{ranks} of {active} active ranks passed samples= to dp.step() in "
                           f"step {step}: every active rank must pass it for the same steps")


def check_control(step: int, counts: list[int], joined_optimizer: Any) -> None:
    """Raise, on every rank, unless the step control's sums `counts` (``[active, syncs, votes
    for dividing by the world size, votes for dividing by the active ranks, ranks averaging
    per sample]``) of step number `step` agree; `joined_optimizer` is the stateful optimizer
    bound to ``dp.grads`` when it is in the Join, else None."""
    active, syncing, by_world, by_active, per_sample = counts
    check_per_sample(per_sample, active, step)
    if syncing not in (0, active):
        raise RuntimeError(
            f"{syncing} of {active} active ranks synchronise gradients in this step: every "
            "active rank must use dp.no_sync() for the same steps")
    if not syncing and joined_optimizer is not None:
        raise RuntimeError(
            f"dp.no_sync() while a rank has joined, with {type(joined_optimizer).__name__} in "
            "the Join: a joined rank steps it every round, so its state would diverge. "
            "Accumulate K micro-batches inside one step, `with dp.step(micro_batches=K):` "
            "with K backward passes")
    if by_world and by_active:
        raise ValueError(
            f"joined ranks passed different divide_by_initial_world_size to their Join "
            f"({by_world} True, {by_active} False): pass the same on every rank")
