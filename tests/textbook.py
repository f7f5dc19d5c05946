"""The optimizers' rules written out directly (temporaries, no blocks): the tests' reference."""

import numpy as np

HYPER = {
    "sgd": {"lr": 0.1},
    "sgd_momentum": {"lr": 0.1, "momentum": 0.9},
    "sgd_nesterov": {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.01, "nesterov": True},
    "adam": {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-8},
    "adam_l2": {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.1},
    "adamw": {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1},
    "sgd_maximize": {"lr": 0.1, "maximize": True},
    "sgd_nesterov_maximize": {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.01,
                              "nesterov": True, "maximize": True},
    "adam_maximize": {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-8, "maximize": True},
    "adam_l2_maximize": {"lr": 0.01, "eps": 1e-6, "weight_decay": 0.1, "maximize": True},
    "adamw_maximize": {"lr": 0.01, "weight_decay": 0.1, "maximize": True},
}


def step(kind, hyper, p, g, state, t):
    """Step number `t` (from 1) of optimizer `kind` ("sgd*", "adam*", "adamw*"): new p.

    `state` is a dict this function fills (momentum buffer, moments).
    """
    if hyper.get("maximize"):
        g = -g
    if kind.startswith("sgd"):
        momentum = hyper.get("momentum", 0.0)
        d = g + hyper.get("weight_decay", 0.0) * p
        if momentum:
            buf = state["b"] = d.copy() if "b" not in state else momentum * state["b"] + d
            d = d + momentum * buf if hyper.get("nesterov") else buf
        return p - hyper["lr"] * d
    lr, (beta1, beta2), eps = hyper["lr"], hyper.get("betas", (0.9, 0.999)), hyper.get("eps", 1e-8)
    weight_decay = hyper.get("weight_decay", 0.0)
    if kind.startswith("adamw"):
        p = p - lr * weight_decay * p
    else:
        g = g + weight_decay * p
    m = state["m"] = beta1 * state.get("m", 0 * p) + (1 - beta1) * g
    v = state["v"] = beta2 * state.get("v", 0 * p) + (1 - beta2) * g ** 2
    m_hat, v_hat = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
    return p - lr * m_hat / (np.sqrt(v_hat) + eps)


def optimizer(kind):
    """The library's class and hyperparameters for `kind`."""
    from tensorplay_mpi import SGD, Adam, AdamW
    cls = SGD if kind.startswith("sgd") else AdamW if kind.startswith("adamw") else Adam
    return cls, dict(HYPER[kind])
