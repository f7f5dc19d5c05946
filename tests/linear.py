"""Linear least squares with SGD: a DataParallel run and its serial replay, for the tests."""

import contextlib

import numpy as np

from tensorplay_mpi import DataParallel, Join

IN, OUT = 5, 3


def make_problem(seed=0, samples=640, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, IN)).astype(dtype)
    y = (x @ rng.normal(size=(IN, OUT)) + 0.1 * rng.normal(size=(samples, OUT))).astype(dtype)
    return x, y


def initial_params(dtypes=(np.float64, np.float64)):
    rng = np.random.default_rng(7)
    return [rng.normal(size=(IN, OUT)).astype(dtypes[0]), rng.normal(size=OUT).astype(dtypes[1])]


def gradient(params, x, y):
    """Gradient of 0.5 * mean squared error of ``x @ w + b`` over the batch."""
    w, b = params
    residual = x @ w + b - y
    return [x.T @ residual / len(x), residual.sum(axis=0) / len(x)]


def rank_batches(inputs, rank, batch=8):
    """Rank `rank`'s batches as index arrays: rank r has `inputs[r]` batches, disjoint."""
    start = sum(inputs[:rank]) * batch
    return [np.arange(start + i * batch, start + (i + 1) * batch) for i in range(inputs[rank])]


def train(comm, data, inputs, lr=0.1, divide_by_initial_world_size=True, sync_every=1,
          overlap=False, bucket_cap_mb=25.0, dtypes=(np.float64, np.float64), device=None,
          make_join=None):
    """The distributed run on this rank; returns (params, dp).

    `device` (optional) moves arrays to a device: the params and the data; `make_join`
    (optional) makes the Join from `dp` instead of ``Join([dp], divide_by_...)``.
    """
    x, y = data if device is None else (device(data[0]), device(data[1]))
    params = initial_params(dtypes)
    if device is not None:
        params = [device(p) for p in params]
    params[0] += comm.rank  # the constructor broadcast from rank 0 must repair this
    dp = DataParallel(params, comm=comm, bucket_cap_mb=bucket_cap_mb)
    batches = rank_batches(inputs, comm.rank)
    if make_join is None:
        join = Join([dp], divide_by_initial_world_size=divide_by_initial_world_size)
    else:
        join = make_join(dp)
    with join:
        for t, idx in enumerate(batches):
            syncs = (t + 1) % sync_every == 0
            if t % sync_every == 0:
                dp.zero_grad()
            with contextlib.ExitStack() as stack:
                if not syncs:
                    stack.enter_context(dp.no_sync())
                stack.enter_context(dp.step())
                for i, g in reversed(list(enumerate(gradient(params, x[idx], y[idx])))):
                    dp.grads[i] += g
                    if overlap:
                        dp.mark_ready(i)
            if syncs:
                for p, g in zip(params, dp.grads):
                    p -= lr * g
    return params, dp


def replay(data, inputs, lr=0.1, divide_by_initial_world_size=True, sync_every=1,
           dtypes=(np.float64, np.float64)):
    """The same training, serially: the averaged-gradient sequence every rank should see."""
    x, y = data
    params = initial_params(dtypes)
    size = len(inputs)
    batches = [rank_batches(inputs, r) for r in range(size)]
    accumulated = [None] * size
    for t in range(max(inputs, default=0)):
        active = [r for r in range(size) if inputs[r] > t]
        for r in active:
            g = gradient(params, x[batches[r][t]], y[batches[r][t]])
            if t % sync_every:
                g = [a + b for a, b in zip(accumulated[r], g)]
            accumulated[r] = g
        if (t + 1) % sync_every:
            continue
        divisor = size if divide_by_initial_world_size else len(active)
        for i, p in enumerate(params):
            p -= lr * (sum(accumulated[r][i] for r in active) / divisor)
    return params
