"""Local optimizers as Joinables under mpiexec: Join([dp, opt]) against a serial replay."""

import numpy as np
import pytest
from helpers import UNEVEN
from linear import gradient, initial_params, make_problem, rank_batches
from textbook import optimizer, step

from tensorplay_mpi import Adam, DataParallel, Join, ZeroRedundancyOptimizer
from tensorplay_mpi.optim import SGD, clip_grad_norm
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

KINDS = ["sgd_momentum", "sgd_nesterov", "adam", "adamw"]


def snapshot(params, opt):
    """Params, every state array and the step count, as bytes."""
    state = b"".join(a.tobytes() for s in opt.state for a in s.values())
    return b"".join(p.tobytes() for p in params) + state + str(opt.steps).encode()


def recording(cls):
    """`cls` whose every step, active or in the join hook, appends a snapshot to `history`."""
    class Recording(cls):
        def update(self):
            super().update()
            self.history.append(snapshot(self.params, self))
    return Recording


def train(comm, kind, inputs, divide=True, shape=None, clip=None):
    """Join([dp, opt]) on the linear problem; returns (params, opt)."""
    cls, hyper = optimizer(kind)
    x, y = make_problem()
    params = initial_params()
    if shape is not None:  # the bias as separate parameters of this shape
        params = [params[0]] + [np.full(shape, b) for b in params[1]]
    dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-6)
    opt = recording(cls)(params, dp.grads, **hyper, max_grad_norm=clip)
    opt.history = []
    with Join([dp, opt], divide_by_initial_world_size=divide):
        for idx in rank_batches(inputs, comm.rank):
            with dp.step():
                w_grad, b_grad = gradient(flat(params), x[idx], y[idx])
                dp.grads[0] = w_grad
                for i, g in enumerate(b_grad if shape is not None else [b_grad]):
                    dp.grads[1 + i] = np.reshape(g, dp.grads[1 + i].shape)
            opt.step()
    return params, opt


def replay(kind, inputs, divide=True, clip=None):
    """Serially: one textbook step per global iteration with the averaged gradient."""
    _, hyper = optimizer(kind)
    x, y = make_problem()
    params = initial_params()
    size = len(inputs)
    batches = [rank_batches(inputs, r) for r in range(size)]
    states = [{}, {}]
    for t in range(max(inputs, default=0)):
        active = [r for r in range(size) if inputs[r] > t]
        divisor = size if divide else len(active)
        grads = [sum(gradient(params, x[batches[r][t]], y[batches[r][t]])[i] for r in active)
                 / divisor for i in range(2)]
        if clip is not None:
            norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
            grads = [g * min(1.0, clip / (norm + 1e-6)) for g in grads]
        params = [step(kind, hyper, p, g, s, t + 1) for p, g, s in zip(params, grads, states)]
    return params


def flat(params):
    return [params[0], np.hstack([np.reshape(b, -1) for b in params[1:]])]


def histories_agree(opt, comm, steps):
    """Every rank stepped `steps` times, each step bitwise the same on every rank."""
    every = comm.allgather(opt.history)
    return all(len(h) == steps for h in every) and all(h == every[0] for h in every)


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN + ["even"])
@pytest.mark.parametrize("kind", KINDS)
def test_join_dp_opt_equals_the_serial_replay_bitwise_on_every_rank(comm, pattern, kind):
    inputs = inputs_of(pattern, comm.size)
    params, opt = train(comm, kind, inputs)
    expected = replay(kind, inputs)
    close = all(np.allclose(a, e, rtol=1e-10, atol=1e-13)
                for a, e in zip(flat(params), expected))
    assert_all(close, f"params {params} != replay {expected}")
    assert_all(opt.steps == max(inputs), f"{opt.steps} steps, expected {max(inputs)}")
    assert_all(histories_agree(opt, comm, max(inputs)),
               "params or state differed across ranks after some iteration")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
def test_dividing_by_the_active_ranks(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    params, opt = train(comm, "adam", inputs, divide=False)
    expected = replay("adam", inputs, divide=False)
    close = all(np.allclose(a, e, rtol=1e-10, atol=1e-13)
                for a, e in zip(flat(params), expected))
    assert_all(close and histories_agree(opt, comm, max(inputs)), "active-ranks divide")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
def test_max_grad_norm_clips_on_joined_ranks_too(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    params, opt = train(comm, "sgd_momentum", inputs, clip=0.05)
    expected = replay("sgd_momentum", inputs, clip=0.05)
    close = all(np.allclose(a, e, rtol=1e-10, atol=1e-13)
                for a, e in zip(flat(params), expected))
    assert_all(close and histories_agree(opt, comm, max(inputs)), f"{params} != {expected}")


@pytest.mark.mpi
def test_clip_grad_norm_after_dp_step_gives_one_norm_on_every_rank(comm):
    params = [np.ones((3, 2)), np.ones(())]
    dp = DataParallel(params, comm=comm)
    with dp.step():
        dp.grads[0][...] = comm.rank + 1.0
        dp.grads[1][...] = -(comm.rank + 1.0)
    mean = (comm.size + 1) / 2
    norm = clip_grad_norm(dp.grads, 1.0)
    every = comm.allgather((norm, b"".join(g.tobytes() for g in dp.grads)))
    assert_all(all(e == every[0] for e in every), "norms or clipped grads differ across ranks")
    assert_all(np.isclose(norm, mean * np.sqrt(7), rtol=1e-12), f"norm {norm}")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
@pytest.mark.parametrize("kind", ["sgd_momentum", "adamw"])
def test_0d_params_under_join_equal_shape_1(comm, pattern, kind):
    inputs = inputs_of(pattern, comm.size)
    scalar, opt0 = train(comm, kind, inputs, shape=())
    vector, opt1 = train(comm, kind, inputs, shape=(1,))
    same = all(np.array_equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(scalar, vector))
    assert_all(same and all(p.shape == () for p in scalar[1:]), "0-d differs from shape (1,)")
    expected = replay(kind, inputs)
    close = all(np.allclose(a, e, rtol=1e-10, atol=1e-13)
                for a, e in zip(flat(scalar), expected))
    assert_all(close and histories_agree(opt0, comm, max(inputs)), "0-d params left the replay")


def run_join(comm, joinables, dp, inputs, opts=()):
    """Each rank's loop; returns the error text this rank got, or None."""
    try:
        with Join(joinables):
            for _ in range(inputs[comm.rank]):
                with dp.step():
                    dp.grads[0][...] = comm.rank
                for opt in opts:
                    opt.step()
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["rank0_zero", "three_plus_rank", "even"])
@pytest.mark.parametrize("missing", ["adam", "zero"])
def test_a_stateful_optimizer_missing_from_the_join_raises_on_every_rank(comm, pattern, missing):
    params = [np.ones(4)]
    dp = DataParallel(params, comm=comm)
    if missing == "adam":
        opt = Adam(params, dp.grads)
    else:
        opt = ZeroRedundancyOptimizer(params, dp.grads, Adam, comm=comm)
    error = run_join(comm, [dp], dp, inputs_of(pattern, comm.size), [opt])
    name = type(opt).__name__
    assert_all(error is not None and f"{name} holds optimizer state" in error
               and "Join([dp, opt])" in error, f"got {error!r}")
    # the fix works on the same objects
    assert_all(run_join(comm, [dp, opt], dp, inputs_of(pattern, comm.size), [opt]) is None,
               "Join([dp, opt]) failed")
    every = comm.allgather(params[0].tobytes())
    assert_all(all(b == every[0] for b in every), "params differ after Join([dp, opt])")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["rank0_zero", "three_plus_rank"])
def test_the_optimizer_before_dataparallel_raises_on_every_rank(comm, pattern):
    params = [np.ones(4)]
    dp = DataParallel(params, comm=comm)
    opt = Adam(params, dp.grads)
    error = run_join(comm, [opt, dp], dp, inputs_of(pattern, comm.size), [opt])
    assert_all(error is not None and "Join([dp" in error, f"got {error!r}")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
def test_stateless_sgd_may_stay_out_of_the_join(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    params = [np.ones(4)]
    dp = DataParallel(params, comm=comm)
    sgd = SGD(params, dp.grads, lr=0.1)
    error = run_join(comm, [dp], dp, inputs, [sgd])
    average = [sum(r for r in range(comm.size) if inputs[r] > t) / comm.size
               for t in range(max(inputs))]
    expected = 1.0 - 0.1 * sum(average)
    assert_all(error is None and np.allclose(params[0], expected, rtol=1e-12),
               f"{error!r}, {params[0]} != {expected}")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN + ["even"])
@pytest.mark.parametrize("bucket_cap_mb", [1e-6, 25.0])
def test_dataparallel_averages_0d_params(comm, pattern, bucket_cap_mb):
    inputs = inputs_of(pattern, comm.size)
    params = [np.array(1.0 + comm.rank), np.ones(2), np.array(3.0)]
    dp = DataParallel(params, comm=comm, bucket_cap_mb=bucket_cap_mb)
    got = []
    with Join([dp]):
        for t in range(inputs[comm.rank]):
            with dp.step():
                for i, g in enumerate(dp.grads):
                    g[...] = (comm.rank + 1) * (i + 1) * (t + 1)
            got.append([g.copy() for g in dp.grads])
    ok = params[0].shape == () and params[0] == 1.0 and all(g.shape == () for g in got[0][::2]) \
        if got else params[0] == 1.0
    for t, grads in enumerate(got):
        active = sum(r + 1 for r in range(comm.size) if inputs[r] > t)
        for i, g in enumerate(grads):
            ok = ok and np.allclose(g, active * (i + 1) * (t + 1) / comm.size, rtol=1e-14)
    assert_all(ok, f"averages {got}")


@pytest.mark.mpi(min_size=2)
def test_no_sync_with_a_stateful_optimizer_once_a_rank_joined_raises_everywhere(comm):
    """Joined ranks step the optimizer every round, so accumulating with no_sync would make
    its state diverge: every rank raises at the first such step."""
    params = [np.ones(3)]
    dp = DataParallel(params, comm=comm)
    opt = Adam(params, dp.grads, lr=0.1)
    with raises_everywhere(RuntimeError, match="no_sync.* in the Join.*micro_batches=K"):
        with Join([dp, opt]):
            for _ in range(1 if comm.rank == 0 else 3):  # rank 0 joins after one step
                with dp.no_sync():
                    with dp.step():
                        dp.grads[0][...] = 1.0
                with dp.step():
                    dp.grads[0][...] = 1.0
                opt.step()
