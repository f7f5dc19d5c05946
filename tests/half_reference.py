"""A small torch model, its float64 serial replay, and how far a 16-bit run may be from it.

Shared by the tests of half-precision models (tests/parallel/test_half.py) and of compressed
reduction (tests/parallel/test_compress.py).
"""

import numpy as np
import torch
from torch_reference import batch


class Small(torch.nn.Module):
    """Linear, tanh, linear: 6 inputs, 5 hidden, 3 outputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.first(x)))


LR, STEPS = 0.05, 6


def loss_of(model, rank, t):
    dtype = next(model.parameters()).dtype
    x, y = batch(rank, t)
    return torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))


def train(comm, model, dp, inputs):
    """`model` trained through `dp` in one Join, this rank's `inputs[rank]` steps; then the
    float64 replay's model and largest gradients (:func:`replay`)."""
    from tensorplay_mpi import Join
    with Join([dp]):
        for t in range(inputs[comm.rank]):
            model.zero_grad()
            with dp.step():
                loss_of(model, comm.rank, t).backward()
    return replay(inputs, comm.size)


def replay(inputs, size):
    """The float64 model trained serially: each global step averages the active ranks'
    gradients over `size`; also, per parameter, the largest |gradient| of any step."""
    model = Small().double()
    largest = [torch.zeros(()) for _ in model.parameters()]
    for t in range(max(inputs)):
        model.zero_grad()
        for rank in range(size):
            if inputs[rank] > t:
                loss_of(model, rank, t).backward()
        with torch.no_grad():
            for k, p in enumerate(model.parameters()):
                p.grad /= size
                largest[k] = torch.maximum(largest[k], p.grad.abs().max())
                p -= LR * p.grad
    return model, largest


def training_tolerance(u, expected, largest, steps, u_grad=None):
    """First-order bound of a 16-bit run's distance to the float64 replay.

    The start and every update round a parameter once (``u |w|`` each, ``steps + 1`` times;
    `u`: the parameters' unit roundoff); a gradient element depends on 2 (6 + 5) + 12 rounded
    operations (two dot products, their inputs, biases, tanh, the loss and its backward pass,
    the average: its division, compression and sums included), each within `u_grad` (default
    `u`) of its exact result, and the error in ``w`` carried from earlier steps moves it by at
    most as much again: ``lr * 2 * 34 u_grad * max|g|`` per step.
    """
    u_grad = u if u_grad is None else u_grad
    return (steps + 1) * u * np.abs(expected) + steps * LR * 2 * 34 * u_grad * largest
