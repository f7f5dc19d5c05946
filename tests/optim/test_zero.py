"""ZeroRedundancyOptimizer under mpiexec: exact against local optimizers, uneven inputs."""

import numpy as np
import pytest
from mpi4py import MPI
from helpers import UNEVEN, gathered_equal
from linear import gradient, initial_params, make_problem, rank_batches

from tensorplay_mpi import SGD, Adam, AdamW, DataParallel, Join, ZeroRedundancyOptimizer
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

OPTIMIZERS = {
    "adam": (Adam, {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-8}),
    "sgd_momentum": (SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam_clipped": (Adam, {"lr": 0.05, "max_grad_norm": 0.5}),  # all grads, never a shard
}


def many_params():
    """Several parameters of different sizes, so that every rank owns a shard."""
    rng = np.random.default_rng(11)
    return [rng.normal(size=shape) for shape in [(4, 3), (3,), (6,), (2, 2), (5,), (1,)]]


def train(comm, inputs, optimizer, zero, copies=False, elastic=False):
    """DataParallel + (ZeRO or a local optimizer) on the linear problem; per-step history."""
    optimizer_class, hyper = OPTIMIZERS[optimizer]
    x, y = make_problem()
    params = initial_params()
    dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-6)
    if zero:
        opt = ZeroRedundancyOptimizer(params, dp.grads, optimizer_class, comm=comm,
                                      copies=copies, **hyper)
    else:
        opt = optimizer_class(params, dp.grads, **hyper)
    history = []
    with Join([dp, opt], elastic=elastic):
        for idx in rank_batches(inputs, comm.rank):
            with dp.step():
                for i, g in enumerate(gradient(params, x[idx], y[idx])):
                    dp.grads[i] = g
            opt.step()
            history.append([p.copy() for p in params])
    train.last = opt
    return params, history


def all_close(a, b, rtol=1e-12):
    return len(a) == len(b) and all(np.allclose(x, y, rtol=rtol, atol=1e-14) for x, y in zip(a, b))


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_dp_and_zero_equal_dp_and_a_local_optimizer_after_every_step(comm, pattern, optimizer):
    inputs = inputs_of(pattern, comm.size)
    params, history = train(comm, inputs, optimizer, zero=True)
    _, expected = train(comm, inputs, optimizer, zero=False)
    steps_match = all(all_close(a, b) for a, b in zip(history, expected))
    assert_all(len(history) == len(expected) == inputs[comm.rank] and steps_match,
               "ZeRO's parameters left the local optimizer's")
    assert_all(gathered_equal(params, comm), "parameters differ across ranks at exit")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_zero_alone_keeps_stepping_the_shards_of_joined_ranks(comm, pattern, optimizer):
    optimizer_class, hyper = OPTIMIZERS[optimizer]
    inputs = inputs_of(pattern, comm.size)
    params = many_params()
    grads = [np.sin(np.arange(p.size) + i).reshape(p.shape) for i, p in enumerate(params)]
    fresh = [g.copy() for g in grads]  # clipping scales the grads in place at every step
    zero = ZeroRedundancyOptimizer(params, grads, optimizer_class, comm=comm, **hyper)
    with Join([zero]):
        for _ in range(inputs[comm.rank]):
            zero.step()
    expected = many_params()
    reference = optimizer_class(expected, fresh, **hyper)
    for _ in range(max(inputs)):
        reference.step()
    assert_all(all_close(params, expected), "a shard fell behind")
    assert_all(gathered_equal(params, comm), "parameters differ across ranks at exit")


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_checkpoint_restores_on_a_different_world_size(comm, optimizer):
    optimizer_class, hyper = OPTIMIZERS[optimizer]
    params = many_params()
    grads = [np.zeros_like(p) for p in params]

    def set_grads(t):
        for i, g in enumerate(grads):
            g[...] = np.cos(np.arange(g.size) * (t + 1) + i).reshape(g.shape)

    zero = ZeroRedundancyOptimizer(params, grads, optimizer_class, comm=comm, **hyper)
    for t in range(3):
        set_grads(t)
        zero.step()
    zero.consolidate_state_dict(to=0)
    try:
        zero.state_dict()
        others_refused = comm.rank == 0
    except RuntimeError:
        others_refused = comm.rank != 0
    state = comm.bcast(zero.state_dict() if comm.rank == 0 else None, root=0)
    assert_all(others_refused, "state_dict() answered on a rank other than `to`")

    # continue on a communicator of another size: ranks 0..n-2 together, the last one alone
    sub = comm.Split(color=int(comm.rank == comm.size - 1 and comm.size > 1), key=comm.rank)
    restored = ZeroRedundancyOptimizer(params, grads, optimizer_class, comm=sub, **hyper)
    restored.load_state_dict(state)
    for t in range(3, 6):
        set_grads(t)
        restored.step()
    sub_size = sub.size
    sub.Free()

    expected = many_params()
    reference = optimizer_class(expected, grads, **hyper)
    for t in range(6):
        set_grads(t)
        reference.step()
    assert_all(all_close(params, expected),
               f"restored at size {sub_size}: params left the reference")


@pytest.mark.mpi
def test_state_is_sharded(comm):
    params = [np.zeros(1000) for _ in range(12)]
    zero = ZeroRedundancyOptimizer(params, [p.copy() for p in params], Adam, comm=comm)
    local = Adam(params, [p.copy() for p in params])
    share = zero.state_nbytes / local.state_nbytes
    total = comm.allreduce(zero.state_nbytes)
    assert_all(share <= 1 / comm.size + 0.05, f"this rank holds {share:.3f} of the state")
    assert_all(total == local.state_nbytes, f"shards add up to {total}")


LAYOUTS = {  # what rank 1 passes instead of many_params(); every rank must raise ValueError
    "order": lambda params: params[::-1],
    "size": lambda params: params[:-1] + [np.zeros(2)],
    "count": lambda params: params[:-1],
    "dtype": lambda params: params[:-1] + [np.zeros(1, np.float32)],
    "integer": lambda params: params[:-1] + [np.zeros(1, np.int64)],
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("change", sorted(LAYOUTS))
def test_different_layouts_raise_on_every_rank(comm, change):
    params = many_params()
    if comm.rank == 1:
        params = LAYOUTS[change](params)
    with raises_everywhere(ValueError, match="ranks passed different parameters"):
        ZeroRedundancyOptimizer(params, [p.copy() for p in params], Adam, comm=comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("settings", [(SGD, {"lr": 0.1}), (Adam, {"lr": 0.2})])
def test_different_optimizer_settings_raise_on_every_rank(comm, settings):
    optimizer_class, hyper = settings if comm.rank == 1 else (Adam, {"lr": 0.1})
    params = many_params()
    with raises_everywhere(ValueError, match="optimizer settings"):
        ZeroRedundancyOptimizer(params, [p.copy() for p in params], optimizer_class, comm=comm,
                                **hyper)


@pytest.mark.mpi(min_size=2)
def test_a_read_only_param_on_one_rank_raises_on_every_rank(comm):
    params = many_params()
    params[0].flags.writeable = comm.rank != 1
    with raises_everywhere(ValueError, match="different parameters"):
        ZeroRedundancyOptimizer(params, [p.copy() for p in params], Adam, comm=comm)


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_0d_params_shard_step_and_consolidate_as_shape_1(comm, optimizer):
    optimizer_class, hyper = OPTIMIZERS[optimizer]
    results = []
    for shape in [(), (1,)]:
        params = [np.full(shape, 1.0 + i) for i in range(2 * comm.size)]
        grads = [np.full(shape, 0.5 - 0.1 * i) for i in range(len(params))]
        zero = ZeroRedundancyOptimizer(params, grads, optimizer_class, comm=comm, **hyper)
        for _ in range(5):
            zero.step()
        zero.consolidate_state_dict(to=comm.size - 1)
        state = zero.state_dict() if comm.rank == comm.size - 1 else None
        state = comm.bcast(state, root=comm.size - 1)
        restored = ZeroRedundancyOptimizer(params, grads, optimizer_class, comm=comm, **hyper)
        restored.load_state_dict(state)
        restored.step()
        results.append((params, state))
    (p0, s0), (p1, s1) = results
    same_params = all(a.shape == () and np.array_equal(a.reshape(1), b) for a, b in zip(p0, p1))
    same_state = all(s0["state"][i][k].shape == () and
                     np.array_equal(s0["state"][i][k].reshape(1), s1["state"][i][k])
                     for i in s1["state"] for k in s1["state"][i])
    assert_all(same_params and same_state and s0["steps"] == 5, "0-d differs from shape (1,)")


def odd_params():
    """0-d, zero-size, mixed dtypes, and one parameter large enough to travel on its own."""
    rng = np.random.default_rng(3)
    shapes = [((), np.float64), ((0,), np.float32), ((3,), np.float32), ((5, 2), np.float64),
              ((300_000,), np.float32), ((2,), np.float32), ((0, 4), np.float64)]
    return [rng.normal(size=shape).astype(dtype) for shape, dtype in shapes]


def zero_and_local(comm, params, optimizer, steps=4):
    """`steps` ZeRO steps on `params` and local steps on a copy: both lists of results."""
    optimizer_class, hyper = OPTIMIZERS[optimizer]
    copies = [p.copy() for p in params]
    rng = np.random.default_rng(5)
    grads = [np.zeros_like(p) for p in params]
    local_grads = [np.zeros_like(p) for p in params]  # clipping scales the grads in place
    zero = ZeroRedundancyOptimizer(params, grads, optimizer_class, comm=comm, **hyper)
    local = optimizer_class(copies, local_grads, **hyper)
    for _ in range(steps):
        for g, local_g in zip(grads, local_grads):
            g[...] = local_g[...] = rng.normal(size=g.shape)
        zero.step()
        local.step()
    return params, copies


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_0d_zero_size_mixed_dtype_and_large_params_equal_the_local_optimizer_bitwise(
        comm, optimizer):
    params, expected = zero_and_local(comm, odd_params(), optimizer)
    assert_all(all(p.dtype == e.dtype and np.array_equal(p, e) for p, e in zip(params, expected)),
               "ZeRO left the local optimizer")


def shared(case, params):
    """`params` with two of them sharing memory."""
    buf = np.zeros(20)
    return {"same array twice": params + [params[1]],
            "overlapping views": params + [buf[:6], buf[4:10]],
            "large array twice": params + [np.zeros(300_000)] * 2}[case]


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["same array twice", "overlapping views", "large array twice"])
@pytest.mark.parametrize("where", ["every rank", "the last rank"])
def test_params_sharing_memory_are_refused_on_every_rank(comm, case, where):
    params = many_params()
    if where == "every rank" or comm.rank == comm.size - 1:
        params = shared(case, params)
    else:  # the same shapes, no sharing
        params = [p.copy() for p in shared(case, params)]
    with raises_everywhere(ValueError, match="share memory|argument check failed on rank"):
        ZeroRedundancyOptimizer(params, [np.zeros_like(p) for p in params], Adam, comm=comm)


@pytest.mark.mpi
def test_a_step_broadcasts_once_per_owner_for_small_params(comm, monkeypatch):
    from tensorplay_mpi.optim import _zero as zero_module
    params = [np.ones(10, np.float32) for _ in range(200)] + [np.ones(300_000, np.float32)]
    opt = ZeroRedundancyOptimizer(params, [np.ones_like(p) for p in params], SGD, comm=comm,
                                  lr=0.1)
    started = []
    real = zero_module.ibcast
    monkeypatch.setattr(zero_module, "ibcast", lambda *args: started.append(1) or real(*args))
    opt.step()
    owners = len(set(opt.owners[:200]))
    assert_all(len(started) == owners + 1, f"{len(started)} broadcasts for {owners} owners")
    assert_all(all(np.all(p == 0.9) for p in params), "a parameter missed its step")


@pytest.mark.mpi
def test_a_consolidated_state_keeps_the_clipping_a_local_optimizer_loads(comm):
    """ZeRO clips all gradients itself, its shard optimizer never; the consolidated state's
    groups carry ZeRO's max_grad_norm, so a local optimizer loading it keeps clipping."""
    params, grads = [np.ones(4), np.ones(3)], [np.full(4, 100.0), np.full(3, 100.0)]
    zero = ZeroRedundancyOptimizer(params, grads, optimizer_class=AdamW, comm=comm, lr=0.1,
                                   max_grad_norm=1.0)
    zero.step()
    zero.consolidate_state_dict(0)
    clipped = None
    if comm.rank == 0:
        local = AdamW([np.ones(4), np.ones(3)], [np.zeros(4), np.zeros(3)], lr=0.1)
        local.load_state_dict(zero.state_dict())
        clipped = local.param_groups[0]["max_grad_norm"]
    assert_all(comm.rank != 0 or clipped == 1.0, f"max_grad_norm after the load: {clipped}")


# -- copies (copies=True): each shard's state also on the next rank, for an elastic Join -----

def previous_ranks_shard(zero, comm):
    """The shard state of the previous rank (mod the size), as that rank holds it."""
    states = comm.allgather(zero.shard_state_dict())
    return states[(comm.rank - 1) % comm.size]


def same_state(a, b):
    """Bitwise the same moments and step counts."""
    return (a["steps"] == b["steps"] and np.array_equal(a["param_steps"], b["param_steps"])
            and a["state"].keys() == b["state"].keys()
            and all(np.array_equal(a["state"][k][n], b["state"][k][n])
                    for k in a["state"] for n in a["state"][k]))


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_copies_in_an_elastic_join_equal_a_local_optimizer_and_their_owners(comm, pattern,
                                                                            optimizer):
    """Uneven inputs, no loss: the same parameters as a local optimizer after every step, and
    each rank's copy bitwise its previous rank's shard state (joined ranks' hooks included)."""
    inputs = inputs_of(pattern, comm.size)
    params, history = train(comm, inputs, optimizer, zero=True, copies=True, elastic=True)
    zero = train.last
    _, expected = train(comm, inputs, optimizer, zero=False)
    steps_match = all(all_close(a, b) for a, b in zip(history, expected))
    assert_all(len(history) == inputs[comm.rank] and steps_match,
               "ZeRO with copies left the local optimizer's parameters")
    copy_ok = zero._copy is None if comm.size == 1 else same_state(
        zero._copy.state_dict(), previous_ranks_shard(zero, comm))
    assert_all(copy_ok, "a copy differs from its owner's shard state")


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_loading_a_state_fills_the_copies(comm, optimizer):
    """A full state dict, and each rank's shard (a checkpoint at the same size: collective)."""
    optimizer_class, hyper = OPTIMIZERS[optimizer]
    params = many_params()
    grads = [np.cos(np.arange(p.size) + i).reshape(p.shape) for i, p in enumerate(params)]
    source = ZeroRedundancyOptimizer(params, grads, optimizer_class, comm=comm, **hyper)
    for _ in range(3):
        source.step()
    shard = source.shard_state_dict()
    source.consolidate_state_dict(to=0)
    full = comm.bcast(source.state_dict() if comm.rank == 0 else None, root=0)
    for load in ("full", "shard"):
        zero = ZeroRedundancyOptimizer(many_params(), grads, optimizer_class, comm=comm,
                                       copies=True, **hyper)
        if load == "full":
            zero.load_state_dict(full)
        else:
            zero.load_shard_state_dict(shard)
        copy_ok = zero._copy is None if comm.size == 1 else same_state(
            zero._copy.state_dict(), previous_ranks_shard(source, comm))
        assert_all(copy_ok, f"after a {load} load a copy differs from its owner's shard")


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_moving_to_fewer_ranks_takes_the_lost_shard_from_its_copy(comm, optimizer):
    """The last rank leaves (a communicator without it, as after a loss outside the steps):
    the others re-shard from their shards and the copy of the last one's, and go on exactly
    as a local optimizer, per-parameter step counts included (one parameter unused at times)."""
    if comm.size == 1:
        pytest.skip("needs a rank to leave")
    optimizer_class, hyper = OPTIMIZERS[optimizer]
    params, expected = many_params(), many_params()
    grads, reference_grads = ([np.zeros_like(p) for p in params] for _ in range(2))
    dp = DataParallel(params, comm=comm)
    zero = ZeroRedundancyOptimizer(params, dp.grads, optimizer_class, comm=comm, copies=True,
                                   **hyper)
    reference = optimizer_class(expected, reference_grads, **hyper)

    def step(t, zero, dp):
        unused = [1] if t % 2 else []
        with dp.step(unused=unused):
            for i, g in enumerate(grads):
                if i not in unused:
                    dp.grads[i][...] = np.cos(np.arange(g.size) * (t + 1) + i).reshape(g.shape)
                    dp.mark_ready(i)
        for mine, averaged in zip(reference_grads, dp.grads):
            mine[...] = averaged
        zero.step()
        used = np.ones(len(params), bool)
        used[unused] = False
        reference.update(used)

    with Join([dp, zero]):
        for t in range(3):
            step(t, zero, dp)
    sub = comm.Split(MPI.UNDEFINED if comm.rank == comm.size - 1 else 0, comm.rank)
    ok = True
    if sub != MPI.COMM_NULL:
        dp.move_to(sub)
        zero.move_to(sub)
        with Join([dp, zero]):
            for t in range(3, 6):
                step(t, zero, dp)
        zero.consolidate_state_dict(to=0)
        ok = all_close(params, expected, rtol=0)
        if sub.rank == 0:
            ok = ok and same_state(zero.state_dict(), reference.state_dict())
    assert_all(ok, "the re-sharded state left the reference")


@pytest.mark.mpi
@pytest.mark.parametrize("copies", [False, True])
def test_moving_to_a_communicator_of_the_same_ranks_keeps_the_shards(comm, copies):
    optimizer_class, hyper = OPTIMIZERS["adam"]
    params, expected = many_params(), many_params()
    grads = [np.sin(np.arange(p.size) + i).reshape(p.shape) for i, p in enumerate(params)]
    zero = ZeroRedundancyOptimizer(params, grads, optimizer_class, comm=comm, copies=copies,
                                   **hyper)
    reference = optimizer_class(expected, [g.copy() for g in grads], **hyper)
    other = comm.Dup()
    for t in range(4):
        if t == 2:
            zero.move_to(other)
        zero.step()
        reference.step()
    assert_all(all_close(params, expected, rtol=0), "the moved shards left the reference")
    other.Free()
