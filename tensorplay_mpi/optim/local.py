"""Local optimizers over NumPy (and CuPy) arrays: SGD, Adam, AdamW.

Each updates `params` in place from the bound `grads` (for example ``dp.grads``) on
:meth:`Optimizer.step`.  The rules are PyTorch's (no dampening, no amsgrad), which are the
textbook ones.  State arrays are allocated at construction, shaped like their parameter, so a
state dict has the same layout before and after the first step.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..threads import limit_threads

__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]


class Optimizer:
    """Base class: bound params and grads, hyperparameters, per-parameter state arrays.

    Subclasses set :attr:`state_names` and implement :meth:`_update`.
    """

    state_names: tuple[str, ...] = ()

    def __init__(self, params: Sequence[Any], grads: Sequence[Any], **defaults: Any) -> None:
        self.params = list(params)
        self.grads = list(grads)
        if len(self.params) != len(self.grads):
            raise ValueError(f"got {len(self.params)} params but {len(self.grads)} grads")
        for i, (p, g) in enumerate(zip(self.params, self.grads)):
            if p.shape != g.shape:
                raise ValueError(f"grads[{i}] has shape {g.shape}, params[{i}] has {p.shape}")
            if p.dtype.kind != "f":
                raise TypeError(f"params[{i}] must be floating point, got {p.dtype}")
        for name in ("lr", "weight_decay", "momentum", "eps"):
            if name in defaults and not defaults[name] >= 0:
                raise ValueError(f"{name} must be >= 0, got {defaults[name]!r}")
        self.defaults = defaults
        self.steps = 0
        limit_threads()
        self.state = [{name: p * 0 for name in self.state_names} for p in self.params]

    def step(self) -> None:
        """Update every parameter in place from its gradient."""
        self.steps += 1
        for p, g, state in zip(self.params, self.grads, self.state):
            self._update(p, g, state)

    def _update(self, p: Any, g: Any, state: dict[str, Any]) -> None:
        raise NotImplementedError

    @property
    def state_nbytes(self) -> int:
        """Bytes held by the optimizer state of this rank."""
        return sum(a.nbytes for state in self.state for a in state.values())

    def state_dict(self) -> dict[str, Any]:
        """A copy of the state: ``{"optimizer", "defaults", "steps", "state": {i: {...}}}``."""
        return {
            "optimizer": type(self).__name__,
            "defaults": dict(self.defaults),
            "steps": self.steps,
            "state": {i: {k: a.copy() for k, a in s.items()} for i, s in enumerate(self.state)},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (copies it in; hyperparameters included).

        Raises
        ------
        ValueError
            If it is for another optimizer class, another number of parameters, or another
            state shape.
        """
        if state_dict["optimizer"] != type(self).__name__:
            raise ValueError(f"state dict of {state_dict['optimizer']} loaded into "
                             f"{type(self).__name__}")
        state = state_dict["state"]
        if sorted(state) != list(range(len(self.params))):
            raise ValueError(f"state dict holds parameters {sorted(state)}, this optimizer has "
                             f"{len(self.params)}")
        for i, mine in enumerate(self.state):
            for name, array in mine.items():
                if state[i][name].shape != array.shape:
                    raise ValueError(f"state[{i}][{name!r}] has shape {state[i][name].shape}, "
                                     f"expected {array.shape}")
        for i, mine in enumerate(self.state):
            for name, array in mine.items():
                array[...] = state[i][name]
        self.defaults = dict(state_dict["defaults"])
        self.steps = int(state_dict["steps"])


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, Nesterov and weight decay.

    ``g = grad + weight_decay * p``; with momentum ``b = momentum * b + g`` and
    ``g = g + momentum * b`` (Nesterov) or ``g = b``; then ``p -= lr * g``.
    """

    def __init__(self, params, grads, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        if nesterov and momentum <= 0:
            raise ValueError("nesterov=True needs momentum > 0")
        self.state_names = ("momentum_buffer",) if momentum else ()
        super().__init__(params, grads, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         nesterov=nesterov)

    def _update(self, p, g, state):
        lr, momentum, weight_decay, nesterov = (
            self.defaults[k] for k in ("lr", "momentum", "weight_decay", "nesterov"))
        if weight_decay:
            g = g + weight_decay * p
        if momentum:
            buf = state["momentum_buffer"]
            buf *= momentum
            buf += g
            g = g + momentum * buf if nesterov else buf
        p -= lr * g


class Adam(Optimizer):
    """Adam: ``p -= lr * m_hat / (sqrt(v_hat) + eps)`` with bias-corrected moments.

    ``weight_decay`` adds ``weight_decay * p`` to the gradient (L2, as PyTorch's Adam).
    """

    state_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, params, grads, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        super().__init__(params, grads, lr=lr, betas=tuple(betas), eps=eps,
                         weight_decay=weight_decay)

    def _update(self, p, g, state):
        lr, (beta1, beta2), eps, weight_decay = (
            self.defaults[k] for k in ("lr", "betas", "eps", "weight_decay"))
        if weight_decay and self.decoupled:
            p *= 1.0 - lr * weight_decay
        elif weight_decay:
            g = g + weight_decay * p
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m *= beta1
        m += (1.0 - beta1) * g
        v *= beta2
        v += (1.0 - beta2) * (g * g)
        m_hat = m / (1.0 - beta1 ** self.steps)
        v_hat = v / (1.0 - beta2 ** self.steps)
        p -= lr * m_hat / (v_hat ** 0.5 + eps)


class AdamW(Adam):
    """Adam with decoupled weight decay: ``p *= 1 - lr * weight_decay`` before the Adam step."""

    decoupled = True

    def __init__(self, params, grads, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, grads, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
