"""Local optimizers over NumPy (and CuPy) arrays: SGD, Adam, AdamW — Joinables beside DataParallel.

Each updates `params` in place from the bound `grads` (for example ``dp.grads``) on
:meth:`Optimizer.step`.  Both may be torch tensors (``model.parameters()``, and ``dp.grads``
of a DataParallel over them): the optimizer works on NumPy views of their memory, or on CUDA
the CuPy views (its fused kernels).  The rules are PyTorch's (``maximize`` included; no
dampening, no amsgrad), which are the textbook ones; the arithmetic lives in
:mod:`tensorplay_mpi.optim._rules`, shared with
:class:`~tensorplay_mpi.optim.ZeroRedundancyOptimizer`.  State arrays are allocated at
construction, shaped like their parameter (0-d included), so a state dict has the same layout
before and after the first step.

Under ``Join([dp, opt])`` a rank that has run out of inputs keeps stepping `opt` once per round,
with the averaged gradients DataParallel's hook wrote into ``dp.grads``: params and state (step
counts included) stay bitwise identical on every rank.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from ..algorithms.join import ElasticJoinable, Join
from ..comm._buffers import device_of, zeros_like
from ..comm._collectives import check_comm
from ..comm import _torch_cuda as torch_cuda
from ..comm._tensors import as_arrays
from .._process import set_up
from . import _rules as rules
from ._clip import clip_grad_norm
from ._linked import LinkedOptimizer
from ._protocol import OptimizerState, check_params, refuse_bfloat16, check_state


def _values(group: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters of `group` that are values, not schedules (callables)."""
    return {k: v for k, v in group.items() if not callable(v)}


def _zeros_like(p: Any) -> Any:
    return rules.aligned_zeros(p.shape, p.dtype) if type(p) is np.ndarray else zeros_like(p)


class Optimizer(LinkedOptimizer, ElasticJoinable, OptimizerState):
    """Base class: bound params and grads, one group of hyperparameters, per-parameter state.

    Subclasses set :attr:`state_names` and implement :meth:`_update` and :meth:`_checked`.

    Attributes
    ----------
    comm : mpi4py.MPI.Intracomm
        The :attr:`join_process_group`: the `comm` argument, else that of the DataParallel
        whose ``dp.grads`` are the `grads`, else ``MPI.COMM_WORLD``.  A local optimizer never
        communicates.
    param_groups : list of dict
        One group holding every parameter: its hyperparameters (``"lr"``, ...), read at each
        step, so a schedule sets ``opt.param_groups[0]["lr"] = ...`` between steps (the same
        value on every rank).  A value may also be a callable of the step number (from 1),
        evaluated at each step: that is the way to schedule inside a Join, where a joined
        rank's hook steps without the loop's code.  :attr:`defaults` keeps the constructor's
        values.
    steps : int
        Steps taken (what a callable hyperparameter is evaluated at).
    param_steps : numpy.ndarray of int64
        Per parameter, the steps that updated it (the ``t`` of Adam's bias correction).

    Notes
    -----
    Parameters without a gradient are skipped as torch.optim skips a ``p.grad`` of None: with
    ``dp.grads``, a parameter for which ``dp.used`` is False after the step (frozen, or no rank
    produced a gradient) gets no weight decay, no momentum or moment update and no step of
    its own counted.

    Notes
    -----
    Every optimizer takes ``max_grad_norm`` (default None): when set, each step first clips the
    gradients to that total norm (:func:`~tensorplay_mpi.optim.clip_grad_norm`).  Inside a
    Join use it rather than clipping in the loop: a joined rank's hook steps without the loop's
    code, so only clipping done by the optimizer happens there too.
    """

    state_names: tuple[str, ...] = ()

    _announces_blocks = True  # its step: one announced block (no collective)

    def __init__(self, params: Sequence[Any], grads: Sequence[Any],
                 comm: MPI.Intracomm | None = None, **defaults: Any) -> None:
        super().__init__()
        self.comm = check_comm(self._link_grads(grads, comm))
        self.params = as_arrays(refuse_bfloat16(params), "params")  # torch tensors: NumPy views
        self.grads = as_arrays(grads, "grads")
        check_params(self.params, self.grads)
        self.defaults = dict(defaults)
        self.param_groups = [dict(defaults)]
        self.steps = 0
        self.param_steps = np.zeros(len(self.params), dtype=np.int64)
        self._counter = np.zeros(1, dtype=np.int64)  # what an elastic settle broadcasts
        set_up()
        self._hyper(1)
        rules.warm_up(self.params)  # the fused kernels compile here, not in the first step
        self.state = [{name: _zeros_like(p) for name in self.state_names} for p in self.params]
        self._flat = [p.reshape(-1) for p in self.params]  # views: a 0-d param is (1,)
        self._flat_state = [{k: a.reshape(-1) for k, a in s.items()} for s in self.state]
        self._scratch = rules.Scratch()
        self._step_with_link(must_join=bool(self.state_names))

    def step(self) -> None:
        """Update every parameter in place from its gradient (local: no communication)."""
        Join.notify_join_context(self)
        self.update()

    def update(self, used: Any = None) -> None:
        """One update from the bound gradients, without telling a Join: what :meth:`step` does
        after its heartbeat, and what a joined rank's hook and a ZeroRedundancyOptimizer (for
        its shard) call.

        `used` (bool per parameter) says which have a gradient; by default ``dp.used`` of the
        DataParallel owning the gradients, else all.
        """
        if used is None:
            used = self._used()
        # torch CUDA tensors: the kernels after torch's writes (a clip, say), torch's after ours
        with torch_cuda.handed():
            hyper = self._hyper(self.steps + 1)
            self.steps += 1
            if hyper.get("max_grad_norm") is not None:
                clip_grad_norm(self.grads, hyper["max_grad_norm"])
            every = used is None or used.all()
            for i, g in enumerate(self.grads):
                if every or used[i]:
                    self.param_steps[i] += 1
                    self._update(i, g.reshape(-1), hyper)

    def _hyper(self, step: int) -> dict[str, Any]:
        """The hyperparameters of step number `step`, callables evaluated, validated."""
        if len(self.param_groups) != 1:  # an appended group (torch's habit) is never ignored
            raise ValueError(
                f"{type(self).__name__} has one parameter group (every parameter of its "
                f"grads), got {len(self.param_groups)} in param_groups; set hyperparameters "
                "in param_groups[0], or make one optimizer per set of parameters")
        group = {k: v(step) if callable(v) else v for k, v in self.param_groups[0].items()}
        return self._checked(group)

    def _checked(self, group: dict[str, Any]) -> dict[str, Any]:
        """Validate the hyperparameters of `group` and return it."""
        for name in ("lr", "weight_decay", "momentum", "eps", "max_grad_norm"):
            if group.get(name) is not None and not group[name] >= 0:
                raise ValueError(f"{name} must be >= 0, got {group[name]!r}")
        if not isinstance(group.setdefault("maximize", False), (bool, np.bool_)):
            raise TypeError(f"maximize must be a bool, got {group['maximize']!r}")
        return group

    def _update(self, i: int, g: Any, hyper: dict[str, Any]) -> None:
        raise NotImplementedError

    @property
    def state_nbytes(self) -> int:
        """Bytes held by the optimizer state of this rank."""
        return sum(a.nbytes for state in self.state for a in state.values())

    def state_dict(self) -> dict[str, Any]:
        """A copy: ``{"optimizer", "defaults", "param_groups", "schedules", "steps", "state":
        {i: {...}}}``.

        A callable hyperparameter (a schedule, ``lr=lambda step: ...``) is code, not state: it
        is left out, so that the state dict pickles, and named in ``"schedules"``;
        :meth:`load_state_dict` keeps the loading optimizer's own schedule for it.
        """
        groups = [self.defaults, *self.param_groups]
        return {
            "optimizer": type(self).__name__,
            "defaults": _values(self.defaults),
            "param_groups": [_values(group) for group in self.param_groups],
            "schedules": sorted({k for group in groups for k, v in group.items() if callable(v)}),
            "steps": self.steps,
            "param_steps": self.param_steps.copy(),
            "state": {i: {k: a.copy() for k, a in s.items()} for i, s in enumerate(self.state)},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (copies it in; hyperparameters included, except the
        schedules, which stay this optimizer's own).

        Raises
        ------
        ValueError
            If it is for another optimizer class, another number of parameters, or another
            state shape, or it names a schedule that this optimizer does not have.
        """
        self.check_state_dict(state_dict)
        schedules = {k: v for k, v in self.param_groups[0].items() if callable(v)}
        state = state_dict["state"]
        for i, mine in enumerate(self.state):
            for name, array in mine.items():
                array[...] = state[i][name]
        own_defaults = {k: v for k, v in self.defaults.items() if callable(v)}
        self.defaults = {**state_dict["defaults"], **own_defaults}
        self.param_groups = [{**g, **schedules}
                             for g in state_dict.get("param_groups", [self.defaults])]
        self.steps = int(state_dict["steps"])
        param_steps = state_dict.get("param_steps")  # absent before per-parameter counts
        self.param_steps[...] = self.steps if param_steps is None else param_steps

    def check_state_dict(self, state_dict: dict[str, Any], shard: bool = False,
                         source: str = "the state dict") -> None:
        """Raise ``ValueError`` unless `state_dict` fits: this optimizer class, one entry per
        parameter shaped like it, and no schedule (a callable) that this optimizer lacks.
        `shard` makes no difference: a local optimizer's part is its whole state."""
        check_state(state_dict, type(self).__name__, self.state_names,
                    [p.shape for p in self.params], source)
        schedules = [k for k, v in self.param_groups[0].items() if callable(v)]
        missing = [k for k in state_dict.get("schedules", ()) if k not in schedules]
        if missing:
            raise ValueError(f"{source} was saved with a schedule (a callable) for "
                             f"{missing}, which a state dict does not store: construct this "
                             "optimizer with the same schedule, then load")

    def set_hyperparameter(self, name: str, value: Any) -> None:
        """Set `name` to `value` in :attr:`defaults` and in every group of :attr:`param_groups`."""
        for group in [self.defaults, *self.param_groups]:
            group[name] = value

    # -- Joinable ------------------------------------------------------------------------------

    def replicated_state(self) -> list[Any]:
        """The state and the step counts: the same on every rank."""
        return [*(a for s in self.state for a in s.values()), np.array([self.steps]),
                self.param_steps]

    def replicated_arrays(self) -> list[Any]:
        """The parameters, the state and the step counts: the same on every rank."""
        return [*self.params, *self.replicated_state()]

    # -- ElasticJoinable: an elastic Join's settle ------------------------------------------

    def elastic_progress(self) -> int | None:
        """The steps applied on this rank."""
        return self.steps

    def elastic_state(self) -> list[Any]:
        """The parameters, the state arrays, the per-parameter step counts and the step count."""
        self._counter[0] = self.steps
        return [*self.params, *(a for s in self.state for a in s.values()), self.param_steps,
                self._counter]

    def elastic_restore(self) -> None:
        """Read the step count back."""
        self.steps = int(self._counter[0])

    def move_to(self, comm: MPI.Intracomm) -> None:
        """Work on `comm` from now on."""
        self.comm = comm

    @property
    def join_device(self) -> str:
        return device_of(self.params[0]) if self.params else "cpu"

    @property
    def join_process_group(self) -> MPI.Intracomm:
        return self.comm

    def _shadow_step(self) -> None:
        """A joined rank's step: with the averaged gradients the earlier joinable's hook
        wrote."""
        self.update()


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, Nesterov and weight decay.

    ``g = grad + weight_decay * p``; with momentum ``b = momentum * b + g`` and
    ``g = g + momentum * b`` (Nesterov) or ``g = b``; then ``p -= lr * g``.  Without momentum
    it holds no state.  ``maximize=True`` starts from ``-grad`` (ascent), as torch.optim.
    """

    def __init__(self, params, grads, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False,
                 max_grad_norm: float | None = None, comm: MPI.Intracomm | None = None) -> None:
        self.state_names = ("momentum_buffer",) if momentum else ()
        super().__init__(params, grads, comm, lr=lr, momentum=momentum,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                         max_grad_norm=max_grad_norm)

    def _checked(self, group):
        super()._checked(group)
        if group["nesterov"] and group["momentum"] <= 0:
            raise ValueError("nesterov=True needs momentum > 0")
        if group["momentum"] and not self.state_names:
            raise ValueError(f"momentum {group['momentum']!r} set on an SGD made without "
                             "momentum (it has no momentum buffer): construct it with momentum")
        return group

    def _update(self, i, g, hyper):
        buf = self._flat_state[i]["momentum_buffer"] if hyper["momentum"] else None
        rules.sgd(self._flat[i], g, buf, self._scratch, hyper["lr"], hyper["momentum"],
                  hyper["weight_decay"], hyper["nesterov"], hyper["maximize"])


class Adam(Optimizer):
    """Adam: ``p -= lr * m_hat / (sqrt(v_hat) + eps)`` with bias-corrected moments.

    ``weight_decay`` adds ``weight_decay * p`` to the gradient (L2, as PyTorch's Adam);
    ``maximize=True`` negates the gradient first (ascent), as torch.optim.
    """

    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, params, grads, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, maximize: bool = False,
                 max_grad_norm: float | None = None, comm: MPI.Intracomm | None = None) -> None:
        super().__init__(params, grads, comm, lr=lr,
                         betas=betas if callable(betas) else tuple(betas), eps=eps,
                         weight_decay=weight_decay, maximize=maximize,
                         max_grad_norm=max_grad_norm)

    def _checked(self, group):
        super()._checked(group)
        betas = tuple(group["betas"])
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {group['betas']!r}")
        return group

    def _update(self, i, g, hyper):
        state = self._flat_state[i]
        beta1, beta2 = hyper["betas"]
        rules.adam(self._flat[i], g, state["exp_avg"], state["exp_avg_sq"], self._scratch,
                   hyper["lr"], beta1, beta2, hyper["eps"], hyper["weight_decay"],
                   self.decoupled, int(self.param_steps[i]), hyper["maximize"])


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p *= 1 - lr * weight_decay`` before the Adam step."""

    decoupled = True

    def __init__(self, params, grads, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, maximize: bool = False,
                 max_grad_norm: float | None = None, comm: MPI.Intracomm | None = None) -> None:
        super().__init__(params, grads, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         maximize=maximize, max_grad_norm=max_grad_norm, comm=comm)
