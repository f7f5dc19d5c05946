"""torch parameters whose ``.grad`` is DataParallel's bucket memory: bound, re-bound, hooked.

``loss.backward()`` accumulates into ``p.grad`` in place when ``p.grad`` exists, so binding
``p.grad`` to the parameter's view into its bucket makes autograd write where the allreduce
reads, without a copy.  torch unbinds it in two ways: ``model.zero_grad()`` (``set_to_none``
by default) sets ``p.grad = None``, after which a backward pass stores a fresh tensor; and a
caller may assign ``p.grad``.  :meth:`TorchGradients.point_grads_at_buckets` repairs either
before the bucket is read: a gradient of ``None`` is zero, another tensor is copied into the
view, and ``p.grad`` is the view again.  DataParallel points them there at every step's
start, in the post-accumulate-grad hook of each parameter, and at the step's end for
parameters no hook marked ready.

Which parameters have a gradient, in torch's sense (``p.grad is not None`` in a program
without DataParallel), is tracked in :attr:`TorchGradients.has`: a ``None`` found when binding
clears it, a backward pass (the hook) or a tensor assigned by the caller sets it.  After a
synchronising step :meth:`TorchGradients.publish` makes ``p.grad`` the averaged view where some
rank had a gradient, and ``None`` where no rank had one, as DDP's ``find_unused_parameters``.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import numpy as np

from ..comm._tensors import is_tensor

_BINDING = "_tensorplay_mpi_binding"  # the attribute of a bound parameter: a _BoundTo


class _BoundTo:
    """A parameter's weak link to the binding of its gradient: called, the binding or None.
    Pickled (``torch.save(model)``, ``copy.deepcopy``) as nothing: a loaded or copied model is
    bound to no DataParallel."""

    __slots__ = ("_ref",)

    def __init__(self, binding: Any) -> None:
        self._ref = weakref.ref(binding)

    def __call__(self) -> Any:
        return self._ref()

    def __reduce__(self) -> tuple:
        return type(None), ()


def check_unbound(params: list[Any]) -> None:
    """Raise ``ValueError`` if a parameter's ``p.grad`` is bound to a live DataParallel."""
    for i, p in enumerate(params):
        bound = getattr(p, _BINDING, None) if is_tensor(p) else None
        if bound is not None and bound() is not None:
            raise ValueError(f"params[{i}] already has its gradient bound to the buckets of "
                             "another DataParallel that is still alive: use one DataParallel "
                             "per model; to replace it (after unfreezing, say), drop every "
                             "reference to the old one first (`del dp`; a Join holds its "
                             "joinables only until it exits, a Join made but never entered "
                             "holds them until it is dropped)")


def frozen_mask(params: list[Any]) -> list[bool]:
    """Which of `params` are frozen: torch ``Parameter`` s with ``requires_grad=False``.

    A plain tensor that does not require gradients is not frozen: it is trained by hand,
    its gradient written into ``dp.grads``, as a NumPy array is.
    """
    torch = _torch()
    if torch is None:
        return [False] * len(params)
    return [isinstance(p, torch.nn.Parameter) and not p.requires_grad for p in params]


def _torch() -> Any:
    import sys
    return sys.modules.get("torch")


class TorchGradients:
    """The torch parameters of a DataParallel that need gradients, bound to `grads`.

    Parameters
    ----------
    params : list
        The caller's parameters: tensors that require gradients are bound, others ignored.
    grads : sequence of torch tensors
        ``dp.grads``: the views into the buckets, shaped like the parameters.
    on_accumulated : callable of (owner, index), optional
        Registered as the post-accumulate-grad hook of each bound parameter, called with
        `owner` (held weakly: a collected owner's hooks do nothing) and the parameter index.
    owner : object, optional
        What `on_accumulated` is called with.

    Attributes
    ----------
    has : numpy.ndarray of bool
        Per parameter of `params`: whether it has a gradient in torch's sense.  Parameters
        that are not bound are left True (their owner decides).
    """

    def __init__(self, params: list[Any], grads: Any,
                 on_accumulated: Callable[[Any, int], None] | None = None,
                 owner: Any = None) -> None:
        self._params = {i: p for i, p in enumerate(params) if is_tensor(p) and p.requires_grad}
        self._grads = grads
        self.has = np.ones(len(params), dtype=bool)
        self.bound = np.zeros(len(params), dtype=bool)
        self.bound[list(self._params)] = True
        self.point_grads_at_buckets(self._params)
        for p in self._params.values():
            setattr(p, _BINDING, _BoundTo(self))
        if on_accumulated is not None:
            ref = weakref.ref(owner)
            for i, p in self._params.items():
                p.register_post_accumulate_grad_hook(lambda _, i=i: _call(ref, on_accumulated, i))

    def __bool__(self) -> bool:
        return bool(self._params)

    def point_grads_at_buckets(self, indices: Iterable[int]) -> None:
        """Make ``p.grad`` the bucket view of each parameter in `indices` (those bound),
        keeping its value: ``None`` is zero, another tensor is copied in."""
        for i in indices:
            p = self._params.get(i)
            if p is None:
                continue
            grad, view = p.grad, self._grads[i]
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            self.has[i] = grad is not None
            p.grad = view

    def publish(self, used: np.ndarray) -> None:
        """After a synchronising step: ``p.grad`` is the (averaged) view where `used`, else
        ``None`` with the view zeroed (no rank produced a gradient)."""
        for i, p in self._params.items():
            view = self._grads[i]
            if used[i]:
                if p.grad is not view:
                    p.grad = view
            else:
                view.zero_()
                p.grad = None
        self.has[self.bound] = used[self.bound]

    def keep_local(self) -> None:
        """After a step that does not synchronise: ``p.grad`` is ``None`` where this rank has
        no gradient, as in a program without DataParallel."""
        for i, p in self._params.items():
            if not self.has[i] and p.grad is not None:
                p.grad = None


def _call(ref: weakref.ref, fn: Callable[[Any, int], None], index: int) -> None:
    owner = ref()
    if owner is not None:
        fn(owner, index)
