"""Local optimizers against the textbook formulas, their state dicts, and the ZeRO partition."""

import numpy as np
import pytest

from tensorplay_mpi.optim import SGD, Adam, AdamW
from tensorplay_mpi.optim.zero import partition

STEPS = 4


def problem(seed=0):
    rng = np.random.default_rng(seed)
    params = [rng.normal(size=(3, 2)), rng.normal(size=4)]
    grads_per_step = [[rng.normal(size=p.shape) for p in params] for _ in range(STEPS)]
    return params, grads_per_step


def run(optimizer_class, **hyper):
    params, grads_per_step = problem()
    grads = [np.zeros_like(p) for p in params]
    optimizer = optimizer_class(params, grads, **hyper)
    for step_grads in grads_per_step:
        for g, new in zip(grads, step_grads):
            g[...] = new
        optimizer.step()
    return params


def textbook_sgd(lr, momentum=0.0, weight_decay=0.0, nesterov=False):
    params, grads_per_step = problem()
    out = []
    for i, p in enumerate(params):
        p, buf = p.copy(), None
        for step_grads in grads_per_step:
            g = step_grads[i] + weight_decay * p
            if momentum:
                buf = g.copy() if buf is None else momentum * buf + g
                g = g + momentum * buf if nesterov else buf
            p = p - lr * g
        out.append(p)
    return out


def textbook_adam(lr, betas, eps, weight_decay=0.0, decoupled=False):
    params, grads_per_step = problem()
    beta1, beta2 = betas
    out = []
    for i, p in enumerate(params):
        p, m, v = p.copy(), np.zeros_like(p), np.zeros_like(p)
        for t, step_grads in enumerate(grads_per_step, start=1):
            g = step_grads[i]
            if decoupled:
                p = p - lr * weight_decay * p
            else:
                g = g + weight_decay * p
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g ** 2
            m_hat, v_hat = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
            p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
        out.append(p)
    return out


def assert_params_close(actual, expected):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("hyper", [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.01},
])
def test_sgd_is_the_textbook_rule(hyper):
    assert_params_close(run(SGD, **hyper), textbook_sgd(**hyper))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_is_the_textbook_rule(weight_decay):
    hyper = {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    assert_params_close(run(Adam, **hyper), textbook_adam(**hyper))


def test_adamw_decays_the_weights_apart_from_the_gradient():
    hyper = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    assert_params_close(run(AdamW, **hyper), textbook_adam(**hyper, decoupled=True))


@pytest.mark.parametrize("optimizer_class, hyper", [
    (SGD, {"lr": 0.1, "momentum": 0.9}), (Adam, {"lr": 0.01}), (AdamW, {"lr": 0.01}),
])
def test_state_dict_round_trip_continues_exactly(optimizer_class, hyper):
    params, grads_per_step = problem()
    grads = [g.copy() for g in grads_per_step[0]]
    first = optimizer_class(params, grads, **hyper)
    first.step()
    first.step()
    clone = [p.copy() for p in params]
    second = optimizer_class(clone, grads, **hyper)
    second.load_state_dict(first.state_dict())
    first.step()
    second.step()
    for a, b in zip(params, clone):
        np.testing.assert_array_equal(a, b)
    assert second.steps == 3


def test_state_dict_is_a_copy():
    params, grads_per_step = problem()
    optimizer = Adam(params, grads_per_step[0])
    saved = optimizer.state_dict()
    optimizer.step()
    assert not saved["state"][0]["exp_avg"].any()


@pytest.mark.parametrize("make, error, match", [
    (lambda p, g: SGD(p, g[:1], lr=0.1), ValueError, "2 params but 1 grads"),
    (lambda p, g: SGD(p, [g[1], g[0]], lr=0.1), ValueError, r"grads\[0\] has shape"),
    (lambda p, g: SGD([x.astype(int) for x in p], g, lr=0.1), TypeError, "floating point"),
    (lambda p, g: SGD(p, g, lr=-1), ValueError, "lr must be >= 0"),
    (lambda p, g: SGD(p, g, lr=0.1, nesterov=True), ValueError, "nesterov"),
    (lambda p, g: Adam(p, g, betas=(0.9, 1.0)), ValueError, "betas"),
    (lambda p, g: Adam(p, g, eps=-1.0), ValueError, "eps"),
])
def test_bad_arguments(make, error, match):
    params, grads_per_step = problem()
    with pytest.raises(error, match=match):
        make(params, grads_per_step[0])


def test_loading_another_optimizers_state_is_a_value_error():
    params, grads_per_step = problem()
    with pytest.raises(ValueError, match="state dict of Adam loaded into SGD"):
        SGD(params, grads_per_step[0], lr=0.1, momentum=0.9).load_state_dict(
            Adam(params, grads_per_step[0]).state_dict())


def test_partition_is_deterministic_and_balanced():
    sizes = [800, 100, 400, 400, 300, 200, 100, 700]
    owners = partition(sizes, 3)
    assert owners == partition(list(sizes), 3)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(3)]
    assert sum(loads) == sum(sizes) and max(loads) - min(loads) <= max(sizes)
    assert loads == [1000, 1000, 1000]
    assert partition([5, 5], 4) == [0, 1]  # more ranks than parameters: some own nothing
