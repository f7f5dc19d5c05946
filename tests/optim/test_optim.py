"""Local optimizers against the textbook formulas, their state dicts, and the ZeRO partition;
then, under mpiexec, local optimizers as Joinables: Join([dp, opt]) against a serial replay."""

import math
import os
import sys

import numpy as np
import pytest
from helpers import UNEVEN
from linear import gradient, initial_params, make_problem, rank_batches
from textbook import HYPER, optimizer, step

from tensorplay_mpi import DataParallel, Join, ZeroRedundancyOptimizer
from tensorplay_mpi.optim import SGD, Adam, AdamW, clip_grad_norm, _rules as rules
from tensorplay_mpi.optim._zero import partition
from tensorplay_mpi.testing import (assert_all, inputs_of, raises_everywhere,
                                    reset_process_state)

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


def textbook(kind, hyper, params=None, grads_per_step=None):
    """The textbook rule on `params` (default: problem()), one step per gradient set."""
    if params is None:
        params, grads_per_step = problem()
    out = []
    for i, p in enumerate(params):
        p, state = p.copy(), {}
        for t, step_grads in enumerate(grads_per_step, start=1):
            p = step(kind, hyper, p, step_grads[i], state, t)
        out.append(p)
    return out


def assert_params_close(actual, expected, rtol=1e-12):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=1e-15)


@pytest.mark.parametrize("hyper", [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.1, "momentum": 0.9, "nesterov": True},
    {"lr": 0.05, "momentum": 0.5, "weight_decay": 0.01},
])
def test_sgd_is_the_textbook_rule(hyper):
    assert_params_close(run(SGD, **hyper), textbook("sgd", hyper))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_is_the_textbook_rule(weight_decay):
    hyper = {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    assert_params_close(run(Adam, **hyper), textbook("adam", hyper))


def test_adamw_decays_the_weights_apart_from_the_gradient():
    hyper = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    assert_params_close(run(AdamW, **hyper), textbook("adamw", hyper))


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


def read_only(array):
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("make, error, match", [
    (lambda p, g: SGD(p, g[:1], lr=0.1), ValueError, "2 params but 1 grads"),
    (lambda p, g: SGD(p, [g[1], g[0]], lr=0.1), ValueError, r"grads\[0\] has shape"),
    (lambda p, g: SGD([x.astype(int) for x in p], g, lr=0.1), TypeError, "floating point"),
    (lambda p, g: SGD(p, g, lr=-1), ValueError, "lr must be >= 0"),
    (lambda p, g: SGD(p, g, lr=0.1, nesterov=True), ValueError, "nesterov"),
    (lambda p, g: SGD([x.T for x in p], [x.T for x in g], lr=0.1), ValueError, "C-contiguous"),
    (lambda p, g: SGD([read_only(x) for x in p], g, lr=0.1), ValueError, "writable"),
    (lambda p, g: Adam(p, g, betas=(0.9, 1.0)), ValueError, "betas"),
    (lambda p, g: Adam(p, g, eps=-1.0), ValueError, "eps"),
])
def test_bad_arguments(make, error, match):
    params, grads_per_step = problem()
    with pytest.raises(error, match=match):
        make(params, grads_per_step[0])


def test_loading_another_optimizers_state_is_a_value_error():
    params, grads_per_step = problem()
    with pytest.raises(ValueError, match="the state dict holds Adam state, the optimizer is SGD"):
        SGD(params, grads_per_step[0], lr=0.1, momentum=0.9).load_state_dict(
            Adam(params, grads_per_step[0]).state_dict())


def test_loading_a_torch_optimizers_state_is_a_value_error():
    torch = pytest.importorskip("torch")
    weights = torch.nn.Parameter(torch.ones(3))
    theirs = torch.optim.Adam([weights])
    weights.grad = torch.ones(3)
    theirs.step()
    params, grads_per_step = problem()
    with pytest.raises(ValueError, match="no state dict of this library's optimizers"):
        Adam(params, grads_per_step[0]).load_state_dict(theirs.state_dict())


def test_partition_is_deterministic_and_balanced():
    sizes = [800, 100, 400, 400, 300, 200, 100, 700]
    owners = partition(sizes, 3)
    assert owners == partition(list(sizes), 3)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(3)]
    assert sum(loads) == sum(sizes) and max(loads) - min(loads) <= max(sizes)
    assert loads == [1000, 1000, 1000]
    assert partition([5, 5], 4) == [0, 1]  # more ranks than parameters: some own nothing


# -- scalar (0-d) parameters ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(HYPER))
def test_a_0d_param_steps_as_the_same_param_of_shape_1(kind):
    cls, hyper = optimizer(kind)
    scalar, vector = np.array(1.0), np.array([1.0])
    grads = [[np.array(0.5 - 0.1 * t)] for t in range(5)]
    g0, g1 = np.array(0.0), np.array([0.0])
    opt0, opt1 = cls([scalar], [g0], **hyper), cls([vector], [g1], **hyper)
    for (g,) in grads:
        g0[...], g1[...] = g, g
        opt0.step()
        opt1.step()
    assert scalar.shape == () and np.array_equal(scalar.reshape(1), vector)
    assert_params_close([vector], textbook(kind, hyper, [np.array([1.0])], grads))
    state0, state1 = opt0.state_dict(), opt1.state_dict()
    for name, array in state1["state"][0].items():
        assert state0["state"][0][name].shape == ()
        assert np.array_equal(state0["state"][0][name].reshape(1), array)
    again = cls([scalar.copy()], [g0], **hyper)
    again.load_state_dict(state0)  # a TypeError before: the state were NumPy scalars
    loaded = again.state_dict()["state"][0]
    assert again.steps == 5 and loaded.keys() == state0["state"][0].keys()
    assert all(np.array_equal(a, state0["state"][0][k]) and a.shape == ()
               for k, a in loaded.items())


# -- hyperparameters between steps, blocks, no temporaries ----------------------------------------

@pytest.mark.parametrize("kind", ["sgd_momentum", "adamw"])
def test_param_groups_schedule_the_learning_rate(kind):
    cls, hyper = optimizer(kind)
    params, grads_per_step = problem()
    rates = [hyper["lr"] / (t + 1) for t in range(STEPS)]
    expected = []
    for i, p in enumerate(params):
        p, state = p.copy(), {}
        for t, step_grads in enumerate(grads_per_step, start=1):
            p = step(kind, dict(hyper, lr=rates[t - 1]), p, step_grads[i], state, t)
        expected.append(p)
    set_by_hand, as_callable = [p.copy() for p in params], [p.copy() for p in params]
    grads = [np.zeros_like(p) for p in params]
    by_hand = cls(set_by_hand, grads, **hyper)
    scheduled = cls(as_callable, grads, **dict(hyper, lr=lambda t: hyper["lr"] / t))
    for t, step_grads in enumerate(grads_per_step):
        for g, new in zip(grads, step_grads):
            g[...] = new
        by_hand.param_groups[0]["lr"] = rates[t]
        by_hand.step()
        scheduled.step()
    assert_params_close(set_by_hand, expected)
    assert_params_close(as_callable, expected)
    assert by_hand.state_dict()["param_groups"][0]["lr"] == rates[-1]


def test_bad_hyperparameters_set_between_steps_raise_at_the_step():
    params, grads_per_step = problem()
    sgd = SGD(params, grads_per_step[0], lr=0.1)
    sgd.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr must be >= 0, got -1.0"):
        sgd.step()
    sgd.param_groups[0]["lr"] = 0.1
    sgd.param_groups.append({"lr": 0.5})  # a second group, as torch's add_param_group makes
    with pytest.raises(ValueError, match="one parameter group"):
        sgd.step()
    sgd.param_groups.pop()
    sgd.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match="made without momentum"):
        sgd.step()
    adam = Adam(params, grads_per_step[0])
    adam.param_groups[0]["betas"] = lambda t: (0.9, 1.0)
    with pytest.raises(ValueError, match="betas"):
        adam.step()
    assert sgd.steps == 0


@pytest.mark.parametrize("kind", ["sgd_nesterov", "adam_l2", "adamw"])
def test_parameters_spanning_several_blocks(kind, monkeypatch):
    monkeypatch.setattr(rules, "BLOCK_BYTES", 24)  # 3 float64 per block, a partial last one
    cls, hyper = optimizer(kind)
    params, grads_per_step = problem()
    grads = [np.zeros_like(p) for p in params]
    opt = cls(params, grads, **hyper)
    for step_grads in grads_per_step:
        for g, new in zip(grads, step_grads):
            g[...] = new
        opt.step()
    assert_params_close(params, textbook(kind, hyper))


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam", "adamw"])
def test_a_step_allocates_no_array(kind):
    import tracemalloc
    cls, hyper = optimizer(kind)
    params = [np.ones(200_000), np.ones(3000, np.float32)]
    grads = [np.full_like(p, 0.5) for p in params]
    opt = cls(params, grads, **hyper)
    opt.step()  # scratch is made in the first step
    tracemalloc.start()
    opt.step()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 10_000, f"a step allocated {peak} bytes"


def test_float32_params_stay_float32_and_follow_the_rule():
    params, grads_per_step = problem()
    single = [p.astype(np.float32) for p in params]
    grads = [np.zeros_like(p) for p in single]
    opt = Adam(single, grads, **HYPER["adam"])
    for step_grads in grads_per_step:
        for g, new in zip(grads, step_grads):
            g[...] = new
        opt.step()
    assert all(p.dtype == np.float32 for p in single)
    assert all(a.dtype == np.float32 for s in opt.state for a in s.values())
    assert_params_close(single, textbook("adam", HYPER["adam"]), rtol=1e-5)


# -- clipping ---------------------------------------------------------------------------------

@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_grad_norm_returns_the_total_norm_and_scales_in_place(max_norm):
    _, grads_per_step = problem()
    grads = grads_per_step[0] + [np.array(2.0)]
    original = [g.copy() for g in grads]
    norm = math.sqrt(sum(float(np.sum(g ** 2)) for g in original))
    assert clip_grad_norm(grads, max_norm) == pytest.approx(norm, rel=1e-12)
    factor = min(1.0, max_norm / (norm + 1e-6))
    for g, o in zip(grads, original):
        np.testing.assert_allclose(g, o * factor, rtol=1e-12)
    clipped = math.sqrt(sum(float(np.sum(g ** 2)) for g in grads))
    assert clipped == pytest.approx(min(norm, max_norm), rel=1e-5)
    assert grads[-1].shape == ()


def test_clip_grad_norm_rejects_a_negative_max_norm():
    with pytest.raises(ValueError, match="max_norm must be >= 0, got -1"):
        clip_grad_norm([np.ones(2)], -1)


# -- optimizers as Joinables (one rank; the MPI tests cover 2-4) ----------------------------------

def test_join_needs_dataparallel_before_the_optimizer():
    params = [np.ones(3)]
    dp = DataParallel(params)
    opt = Adam(params, dp.grads)
    with pytest.raises(RuntimeError, match=r"Join\(\[dp, opt\]\)"):
        with Join([opt, dp]):
            pass
    with pytest.raises(RuntimeError, match=r"Join\(\[dp, opt\]\)"):
        with Join([Adam(params, [np.ones(3)])]):
            pass


def test_a_stateful_optimizer_on_dp_grads_missing_from_the_join_raises():
    params = [np.ones(3)]
    dp = DataParallel(params)
    opt = Adam(params, dp.grads)
    with pytest.raises(RuntimeError, match=r"Adam holds optimizer state .* Join\(\[dp, opt\]\)"):
        with Join([dp]):
            with dp.step():
                pass
    stateless = SGD(params, dp.grads, lr=0.1)
    del opt
    with Join([dp]):  # a collected optimizer and a stateless one are fine
        with dp.step():
            dp.grads[0][...] = 1.0
        stateless.step()
    assert np.array_equal(params[0], np.full(3, 0.9))


# -- CuPy: one fused kernel per rule (make gpu-check) -----------------------------------------

def _gpu():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except cupy.cuda.runtime.CUDARuntimeError:
        pass
    pytest.skip("no CUDA GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(HYPER))
def test_cupy_kernels_follow_the_rule(kind):
    cupy = _gpu()
    cls, hyper = optimizer(kind)
    params, grads_per_step = problem()
    params = [cupy.asarray(p) for p in params] + [cupy.asarray(np.array(0.7))]
    grads = [cupy.zeros_like(p) for p in params]
    opt = cls(params, grads, **hyper)
    for step_grads in grads_per_step:
        for g, new in zip(grads, step_grads + [np.array(0.3)]):
            g[...] = cupy.asarray(new)
        opt.step()
    host, host_grads = problem()
    expected = textbook(kind, hyper, host + [np.array(0.7)],
                        [s + [np.array(0.3)] for s in host_grads])
    assert all(type(p) is cupy.ndarray for p in params)
    assert_params_close([cupy.asnumpy(p) for p in params], expected)


def test_only_dp_grads_itself_links_an_optimizer_to_its_dataparallel():
    params = [np.ones(3), np.ones(2)]
    dp = DataParallel(params)
    Adam(params, list(dp.grads))  # the same views in a plain list: no link, not checked
    with Join([dp]):
        with dp.step():
            pass
    opt = Adam(params, dp.grads)  # linked: its DataParallel checks its Joins
    with pytest.raises(RuntimeError, match=r"Adam holds optimizer state .* Join\(\[dp, opt\]\)"):
        with Join([dp]):
            with dp.step():
                pass
    with Join([dp, opt]):  # listed: fine
        with dp.step():
            dp.grads[0][...] = 1.0
        opt.step()
    assert opt.steps == 1


# -- the fused kernels (numba, the `fused` extra) against the NumPy rules ----------------------

@pytest.fixture
def fused_setting(monkeypatch):
    """Set TENSORPLAY_MPI_FUSED for the test; the settings are read again after it."""
    from tensorplay_mpi.settings import settings

    def use(value):
        monkeypatch.setenv("TENSORPLAY_MPI_FUSED", value)
        settings.cache_clear()
    yield use
    monkeypatch.undo()
    settings.cache_clear()


def run_fused_or_not(fused_setting, value, kind, dtype):
    """Five steps of optimizer `kind` on 0-d, zero-size, scalar-like and large params."""
    fused_setting(value)
    rng = np.random.default_rng(5)
    params = [rng.normal(size=shape).astype(dtype) for shape in [(), (0,), (1,), (300, 7)]]
    grads = [np.zeros_like(p) for p in params]
    cls, hyper = optimizer(kind)
    opt = cls(params, grads, **dict(hyper, lr=np.float64(hyper["lr"])))  # a NumPy scalar too
    for _ in range(5):
        for g in grads:
            g[...] = rng.normal(size=g.shape)
        opt.step()
    return params


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", sorted(HYPER))
def test_fused_kernels_equal_the_numpy_rules_bitwise(fused_setting, kind, dtype):
    pytest.importorskip("numba")
    fused = run_fused_or_not(fused_setting, "1", kind, dtype)
    numpy = run_fused_or_not(fused_setting, "0", kind, dtype)
    assert all(a.dtype == dtype and a.tobytes() == b.tobytes() for a, b in zip(fused, numpy))


@pytest.mark.parametrize("value, expected", [("1", True), ("auto", True), ("0", False)])
def test_the_fused_setting_chooses_the_kernels(fused_setting, monkeypatch, value, expected):
    pytest.importorskip("numba")
    from tensorplay_mpi.optim import _fused as fused
    fused_setting(value)
    params = [np.ones(3, np.float32), np.ones(2, np.float16)]  # float16: always NumPy
    adam = Adam(params, [np.ones_like(p) for p in params])
    calls = []
    monkeypatch.setattr(fused, "adam", lambda *args: calls.append(args))
    adam.step()
    assert len(calls) == expected and np.all(params[1] < 1)
    assert np.all(params[0] < 1) != expected  # the stand-in kernel did nothing


def test_fused_required_without_numba_is_a_runtime_error(fused_setting, monkeypatch):
    import tensorplay_mpi.optim
    try:
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, "tensorplay_mpi.optim._fused", None)  # cannot be imported
            patch.delattr(tensorplay_mpi.optim, "_fused", raising=False)
            reset_process_state()  # the import is tried again (its registered reset)
            fused_setting("1")
            with pytest.raises(RuntimeError, match=r"TENSORPLAY_MPI_FUSED=1 but numba .*\[fused\]"):
                SGD([np.ones(2)], [np.ones(2)], lr=0.1)
            fused_setting("auto")
            SGD([np.ones(2)], [np.ones(2)], lr=0.1).step()  # auto: the NumPy rules
    finally:
        reset_process_state()  # the kernels back for the tests after this one


def test_a_bad_fused_setting_is_a_value_error(fused_setting):
    fused_setting("sometimes")
    with pytest.raises(ValueError, match="TENSORPLAY_MPI_FUSED must be one of auto, 0, 1"):
        SGD([np.ones(2)], [np.ones(2)], lr=0.1)


def test_the_fused_steps_start_no_threads(fused_setting):
    pytest.importorskip("numba")
    fused_setting("1")
    params = [np.ones(100_000, np.float32), np.ones(10)]
    opt = AdamW(params, [np.ones_like(p) for p in params])  # compiles (LLVM may add a thread)
    before = os.listdir("/proc/self/task")
    for _ in range(3):
        opt.step()
    assert os.listdir("/proc/self/task") == before and np.all(params[0] < 1)  # no thread pool


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------

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
