"""Serial torch replays for the exactness tests of torch training under a Join.

A global step ``t`` takes the batches of every rank still active at ``t`` (rank ``r`` has
``inputs[r]`` steps), each of ``micro`` micro-batches; the reference sums their gradients in
one model, divides by the world size, and runs the same update as the distributed loop.  A
parameter that no active rank's loss reaches in a step keeps ``p.grad is None``, as in any
torch program, so torch.optim skips it: the behaviour DataParallel must reproduce.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch


class Branchy(torch.nn.Module):
    """A two-layer MLP with a side branch that a step may leave out (float64)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, 3)
        self.branch = torch.nn.Linear(5, 3)
        self.double()

    def forward(self, x: torch.Tensor, branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        return self.head(h) + self.branch(h) if branch else self.head(h)


def batch(rank: int, t: int, m: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch `m` of step `t`: the same wherever it is computed."""
    g = torch.Generator().manual_seed(10_000 * rank + 100 * t + m)
    return (torch.randn(4, 6, generator=g, dtype=torch.float64),
            torch.randn(4, 3, generator=g, dtype=torch.float64))


def always(rank: int, t: int) -> bool:
    return True


def on_host(x):
    """The default `place`: models and tensors stay where they are made (the CPU)."""
    return x


def loss_of(model: Branchy, rank: int, t: int, m: int = 0,
            uses: Callable[[int, int], bool] = always, place: Callable = on_host) -> torch.Tensor:
    x, y = batch(rank, t, m)
    return torch.nn.functional.mse_loss(model(place(x), uses(rank, t)), place(y))


def serial(make_update: Callable[[Branchy], Callable[[], None]], inputs: list[int],
           uses: Callable[[int, int], bool] = always,
           micro: int | Callable[[int, int], int] = 1,
           prepare: Callable[[Branchy], None] = lambda model: None,
           place: Callable = on_host) -> Branchy:
    """The global steps replayed serially on one model; `make_update(model)` gives the step.

    `micro` is the number of micro-batches of each step, or a function of (rank, step) giving
    it; `prepare(model)` runs first (freezing a layer, say); `place` moves the model and the
    batches to a device (``lambda x: x.to("cuda")``).
    """
    micro_of = micro if callable(micro) else (lambda rank, t: micro)
    model = place(Branchy())
    prepare(model)
    update = make_update(model)
    for t in range(max(inputs, default=0)):
        model.zero_grad(set_to_none=True)
        for rank in range(len(inputs)):
            if inputs[rank] > t:
                for m in range(micro_of(rank, t)):
                    loss_of(model, rank, t, m, uses, place).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= len(inputs)
        update()
    return model


def adamw_onecycle_clip(model: torch.nn.Module, total_steps: int) -> tuple:
    """AdamW + OneCycleLR over `total_steps` + clip_grad_norm_, one update: (update, optimizer,
    scheduler)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=total_steps)

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        opt.step()
        sched.step()
    return update, opt, sched


def arrays(model: torch.nn.Module) -> list[np.ndarray]:
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def close(got: list[np.ndarray], expected: list[np.ndarray], tol: float = 1e-12) -> str:
    """Empty if `got` equals `expected` to `tol` (relative and absolute), else what differs."""
    bad = [f"param {i}: off by {np.max(np.abs(g - e)):.3g}"
           for i, (g, e) in enumerate(zip(got, expected))
           if not np.allclose(g, e, rtol=tol, atol=tol)]
    return "; ".join(bad)


def same_everywhere(values: list[np.ndarray], comm) -> bool:
    """True on every rank iff every rank holds bitwise the same arrays."""
    every = comm.allgather([np.ascontiguousarray(v).tobytes() for v in values])
    return all(b == every[0] for b in every)
