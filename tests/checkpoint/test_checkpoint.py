"""Checkpoints in one process (COMM_SELF): round trips, exact resume, atomic writes, refusals;
under mpiexec, DataParallel with local and ZeRO optimizers, errors on every rank."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import gathered_equal
from linear import gradient, initial_params, make_problem, rank_batches
from mpi4py import MPI

from tensorplay_mpi import SGD, Adam, AdamW, DataParallel, Join, ZeroRedundancyOptimizer, checkpoint
from tensorplay_mpi.checkpoint import PerRank, rng_state, set_rng_state, _store as store
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

SELF = MPI.COMM_SELF


def params():
    rng = np.random.default_rng(3)
    return [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=3), np.array(0.5)]


def grads_of(ps):
    return [np.full_like(p, 0.1) for p in ps]


def steps(opt, grads, n, seed=5):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        for g in grads:
            g[...] = rng.normal(size=g.shape)
        opt.step()


def test_no_checkpoint_is_a_fresh_start(tmp_path):
    assert checkpoint.load(tmp_path / "none", params(), comm=SELF) is None


@pytest.mark.parametrize("make", [
    lambda p, g: SGD(p, g, lr=0.1, momentum=0.9, nesterov=True),
    lambda p, g: Adam(p, g, lr=np.float32(0.01), betas=(0.8, 0.9)),
    lambda p, g: AdamW(p, g, lr=lambda step: 0.01 / step, weight_decay=0.1),
], ids=["sgd_nesterov", "adam_float32_lr", "adamw_scheduled"])
def test_a_resumed_run_is_bitwise_the_run_never_stopped(tmp_path, make):
    ps, grads = params(), grads_of(params())
    opt = make(ps, grads)
    steps(opt, grads, 3)
    buffers = [np.arange(5.0)]
    saved = checkpoint.save(tmp_path, ps, buffers=buffers, optimizer=opt, step=3, epoch=2,
                            cursor=7, extra={"totals": np.array([1.5, 2.0])}, comm=SELF)
    assert saved.path == str(tmp_path / checkpoint.MANIFEST) and saved.nbytes > 0
    steps(opt, grads, 4, seed=9)  # the run never stopped

    fresh, fresh_grads, fresh_buffers = params(), grads_of(params()), [np.zeros(5)]
    for p in fresh:
        p += 1.0  # what is loaded must overwrite this
    resumed_opt = make(fresh, fresh_grads)
    resumed = checkpoint.load(tmp_path, fresh, buffers=fresh_buffers, optimizer=resumed_opt,
                              comm=SELF)
    assert (resumed.step, resumed.epoch, resumed.cursor, resumed.cursors) == (3, 2, 7, (7,))
    np.testing.assert_array_equal(resumed.extra["totals"], [1.5, 2.0])
    np.testing.assert_array_equal(fresh_buffers[0], np.arange(5.0))
    assert resumed_opt.steps == 3
    assert type(resumed_opt.param_groups[0]["lr"]) is type(opt.param_groups[0]["lr"])
    steps(resumed_opt, fresh_grads, 4, seed=9)
    for a, b in zip(ps, fresh):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ps = params()
    checkpoint.save(tmp_path, ps, step=1, comm=SELF)
    before = sorted(os.listdir(tmp_path))

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(tmp_path, [p + 1 for p in ps], step=2, comm=SELF)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == before  # no temporary file left behind
    loaded = params()
    assert checkpoint.load(tmp_path, loaded, comm=SELF).step == 1
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ps, loaded))


def test_a_process_killed_while_writing_keeps_the_previous_checkpoint(tmp_path):
    program = textwrap.dedent(f"""
        import os, signal
        import numpy as np
        from mpi4py import MPI
        from tensorplay_mpi import checkpoint
        checkpoint.save({str(tmp_path)!r}, [np.zeros(1000)], step=1, comm=MPI.COMM_SELF)
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # data written, not renamed
        checkpoint.save({str(tmp_path)!r}, [np.ones(1000)], step=2, comm=MPI.COMM_SELF)
    """)
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=60)
    assert result.returncode == -9, result.stderr
    assert any(".tmp-" in name for name in os.listdir(tmp_path))  # it was killed mid-write
    loaded = [np.full(1000, 7.0)]
    assert checkpoint.load(tmp_path, loaded, comm=SELF).step == 1
    assert not loaded[0].any()
    checkpoint.save(tmp_path, loaded, step=3, comm=SELF)
    assert not any(".tmp-" in name for name in os.listdir(tmp_path))  # the next save cleans up


def test_the_manifest_is_renamed_last_and_names_only_its_own_shards(tmp_path):
    checkpoint.save(tmp_path, params(), comm=SELF)
    assert os.listdir(tmp_path) == [checkpoint.MANIFEST]


@pytest.mark.parametrize("change, match", [
    (lambda ps: ps[:2], r"holds params \[\(4, 3\) <f4, \(3,\) <f8, \(\) <f8\], this job has"),
    (lambda ps: [ps[0].astype(np.float64), *ps[1:]], "holds params"),
    (lambda ps: [ps[0].reshape(3, 4), *ps[1:]], "holds params"),
])
def test_other_parameters_are_refused_and_nothing_is_loaded(tmp_path, change, match):
    checkpoint.save(tmp_path, params(), comm=SELF)
    mine = [np.full_like(p, 9.0) for p in change(params())]
    with pytest.raises(ValueError, match=match):
        checkpoint.load(tmp_path, mine, comm=SELF)
    assert all((p == 9.0).all() for p in mine)


def test_another_optimizer_or_none_is_refused(tmp_path):
    ps, grads = params(), grads_of(params())
    checkpoint.save(tmp_path, ps, optimizer=Adam(ps, grads), comm=SELF)
    with pytest.raises(ValueError, match="holds Adam state, the optimizer is SGD"):
        checkpoint.load(tmp_path, ps, optimizer=SGD(ps, grads, lr=0.1, momentum=0.5),
                        comm=SELF)
    with pytest.raises(ValueError, match="optimizer state of kind 'local', the optimizer given "
                                         "is none"):
        checkpoint.load(tmp_path, ps, comm=SELF)
    checkpoint.save(tmp_path, ps, comm=SELF)
    with pytest.raises(ValueError, match="of kind 'none', the optimizer given is Adam"):
        checkpoint.load(tmp_path, ps, optimizer=Adam(ps, grads), comm=SELF)


def test_another_format_is_refused(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, params(), comm=SELF)
    monkeypatch.setattr(store, "FORMAT", 2)
    with pytest.raises(ValueError, match="checkpoint format 1, this version reads format 2"):
        checkpoint.load(tmp_path, params(), comm=SELF)


def test_arguments_are_checked(tmp_path):
    ps = params()
    with pytest.raises(TypeError, match="optimizer must be a tensorplay_mpi optimizer"):
        checkpoint.save(tmp_path, ps, optimizer=object(), comm=SELF)
    opt = SGD(ps, grads_of(ps), lr=0.1)
    opt.param_groups[0]["lr"] = [0.1]
    with pytest.raises(TypeError, match=r"cannot save hyperparameter lr = \[0.1\]"):
        checkpoint.save(tmp_path, ps, optimizer=opt, comm=SELF)
    assert not (tmp_path / checkpoint.MANIFEST).exists()


def test_device_arrays_go_through_host_copies(tmp_path):
    from fake_device import Counters, on_device

    ps = [on_device(p) for p in params()]
    Counters.reset()
    checkpoint.save(tmp_path, ps, buffers=[on_device(np.arange(3.0))], comm=SELF)
    assert Counters.d2h == 4  # every array copied to the host, none read as device memory
    fresh, buffers = [on_device(np.zeros_like(p)) for p in params()], [on_device(np.zeros(3))]
    Counters.reset()
    checkpoint.load(tmp_path, fresh, buffers=buffers, comm=SELF)
    assert Counters.h2d == 4
    assert all(a.tobytes() == b.tobytes() for a, b in zip(ps, fresh))
    assert buffers[0].tolist() == [0.0, 1.0, 2.0]


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------

def shared_dir(comm, tmp_path):
    """Rank 0's tmp_path, on every rank (one file system here)."""
    return comm.bcast(str(tmp_path))


def model(comm, zero):
    params = initial_params()
    dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-6)
    opt = (ZeroRedundancyOptimizer(params, dp.grads, Adam, comm=comm, lr=0.05)
           if zero else Adam(params, dp.grads, lr=0.05))
    return params, dp, opt


def epoch(dp, opt, batches, data):
    x, y = data
    with Join([dp, opt]):
        for idx in batches:
            with dp.step():
                for i, g in enumerate(gradient(dp.params, x[idx], y[idx])):
                    dp.grads[i] = g
            opt.step()


@pytest.mark.mpi
@pytest.mark.parametrize("zero", [None, "sharded", "consolidated"])
def test_a_resumed_run_equals_the_run_never_stopped(comm, tmp_path, zero):
    directory, data = shared_dir(comm, tmp_path), make_problem()
    batches = rank_batches(inputs_of("three_plus_rank", comm.size), comm.rank)
    params, dp, opt = model(comm, zero)
    epoch(dp, opt, batches, data)
    saved = checkpoint.save(directory, params, optimizer=opt, step=1, epoch=2,
                            cursor=comm.rank, zero=zero or "sharded", comm=comm)
    files = sorted(os.listdir(directory))
    epoch(dp, opt, batches, data)

    fresh, dp2, opt2 = model(comm, zero)
    resumed = checkpoint.load(directory, fresh, optimizer=opt2, comm=comm)
    epoch(dp2, opt2, batches, data)
    exact = all(a.tobytes() == b.tobytes() for a, b in zip(params, fresh))
    assert_all(exact, "the resumed run left the one never stopped")
    assert_all(resumed.cursors == tuple(range(comm.size)) and resumed.cursor == comm.rank
               and (resumed.step, resumed.epoch) == (1, 2), str(resumed))
    shards = [f for f in files if f.startswith("optimizer-shard-")]
    assert_all(len(shards) == (comm.size if zero == "sharded" else 0), str(files))
    assert_all(saved.nbytes == sum(os.path.getsize(os.path.join(directory, f))
                                   for f in files), f"{saved.nbytes} bytes, files {files}")
    assert_all(gathered_equal(fresh, comm), "parameters differ across ranks")


@pytest.mark.mpi
def test_a_consolidated_zero_state_loads_into_a_local_optimizer_and_back(comm, tmp_path):
    directory, data = shared_dir(comm, tmp_path), make_problem()
    batches = rank_batches(inputs_of("last_zero", comm.size), comm.rank)
    params, dp, zero = model(comm, zero=True)
    epoch(dp, zero, batches, data)
    checkpoint.save(directory, params, optimizer=zero, zero="consolidated", comm=comm)
    local_params, dp2, local = model(comm, zero=False)
    checkpoint.load(directory, local_params, optimizer=local, comm=comm)
    epoch(dp, zero, batches, data)
    epoch(dp2, local, batches, data)
    assert_all(all(np.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(params, local_params)),
               "a local optimizer resumed from ZeRO's full state left it")


@pytest.mark.mpi(min_size=2)
def test_another_world_size_is_refused_on_every_rank(comm, tmp_path):
    directory = shared_dir(comm, tmp_path)
    alone = comm.Split(comm.rank, 0)  # each rank in a world of its own
    params = initial_params()
    if comm.rank == 0:
        checkpoint.save(directory, params, comm=alone)
    comm.Barrier()
    alone.Free()
    with raises_everywhere(ValueError, match=rf"saved at 1 ranks, this job has {comm.size}"):
        checkpoint.load(directory, params, comm=comm)


@pytest.mark.mpi(min_size=2)
def test_a_sharded_zero_state_needs_a_zero_optimizer_on_every_rank(comm, tmp_path):
    directory = shared_dir(comm, tmp_path)
    params, dp, zero = model(comm, zero=True)
    checkpoint.save(directory, params, optimizer=zero, comm=comm)
    _, _, local = model(comm, zero=False)
    with raises_everywhere(ValueError, match="of kind 'zero-sharded', the optimizer given is Adam"):
        checkpoint.load(directory, params, optimizer=local, comm=comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", ["sharded", "consolidated"])
def test_a_write_error_on_one_rank_is_an_error_on_every_rank(comm, tmp_path, monkeypatch, zero):
    directory = shared_dir(comm, tmp_path)
    params, dp, opt = model(comm, zero=True)
    checkpoint.save(directory, params, optimizer=opt, step=1, zero=zero, comm=comm)
    before = sorted(os.listdir(directory))
    failing = 0 if zero == "consolidated" else comm.size - 1  # who writes what
    if comm.rank == failing:
        def full_disk(path, arrays):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(store, "write_arrays", full_disk)
    with raises_everywhere(OSError, match="No space left on device") as raised:
        checkpoint.save(directory, [p + 1 for p in params], optimizer=opt, step=2, zero=zero,
                        comm=comm)
    if comm.rank != failing:
        assert_all(f"failed on rank(s) [{failing}]" in str(raised.value), str(raised.value))
    else:
        assert_all(True)
    monkeypatch.undo()
    assert_all(sorted(os.listdir(directory)) == before, "the previous checkpoint was touched")
    loaded = initial_params()
    assert_all(checkpoint.load(directory, loaded, optimizer=opt, comm=comm).step == 1)


@pytest.mark.mpi(min_size=2)
def test_a_read_error_on_one_rank_is_an_error_everywhere_and_loads_nothing(comm, tmp_path,
                                                                          monkeypatch):
    directory = shared_dir(comm, tmp_path)
    checkpoint.save(directory, initial_params(), comm=comm)
    if comm.rank == comm.size - 1:
        def unreadable(path):
            raise PermissionError(13, "Permission denied", path)
        monkeypatch.setattr(store, "read_arrays", unreadable)
    mine = [np.full_like(p, 9.0) for p in initial_params()]
    with raises_everywhere(OSError, match="Permission denied"):
        checkpoint.load(directory, mine, comm=comm)
    assert_all(all((p == 9.0).all() for p in mine), "a rank loaded although another failed")


@pytest.mark.mpi(min_size=2)
def test_a_checkpoint_only_some_ranks_see_is_refused(comm, tmp_path):
    directory = str(tmp_path)  # each rank's own: rank 0's alone holds a checkpoint
    alone = comm.Split(comm.rank, 0)
    if comm.rank == 0:
        checkpoint.save(directory, initial_params(), comm=alone)
    alone.Free()
    with raises_everywhere(ValueError, match=r"visible on rank\(s\) \[0\] only"):
        checkpoint.load(directory, initial_params(), comm=comm)


@pytest.mark.mpi(min_size=2)
def test_different_counters_are_refused_on_every_rank(comm, tmp_path):
    directory = shared_dir(comm, tmp_path)
    with raises_everywhere(ValueError, match="different step/epoch counters"):
        checkpoint.save(directory, initial_params(), step=comm.rank, comm=comm)
    assert_all(not os.path.exists(os.path.join(directory, checkpoint.MANIFEST)))


def generators(seed):
    """A NumPy and a torch generator of `seed`, advanced a little."""
    torch = pytest.importorskip("torch")
    rng, gen = np.random.default_rng([11, seed]), torch.Generator().manual_seed(100 + seed)
    rng.normal(size=3), torch.rand(2, generator=gen)
    return rng, gen


def next_draws(rng, gen):
    """The generators' next draws, as bytes."""
    torch = pytest.importorskip("torch")
    return rng.normal(size=4).tobytes() + torch.rand(4, generator=gen).numpy().tobytes()


def per_rank_files(directory):
    return sorted(f for f in os.listdir(directory) if f.startswith("per-rank-"))


@pytest.mark.mpi
def test_each_rank_s_generators_come_back_to_their_own_rank_bitwise(comm, tmp_path):
    """Before: extra kept rank 0's arrays, so every rank resumed rank 0's random draws."""
    directory = shared_dir(comm, tmp_path)
    rng, gen = generators(comm.rank)
    extra = {"numpy": PerRank(rng_state(rng)), "torch": PerRank(rng_state(gen)),
             "shared": np.arange(3)}
    for step in (1, 2):  # the second save replaces the first one's per-rank files
        checkpoint.save(directory, initial_params(), step=step, extra=extra, comm=comm)
    expected = next_draws(rng, gen)  # what the generators draw next, the run never stopped
    fresh, fresh_gen = generators(comm.size + comm.rank)  # somewhere else
    resumed = checkpoint.load(directory, initial_params(), comm=comm)
    set_rng_state(fresh, resumed.extra["numpy"])
    set_rng_state(fresh_gen, resumed.extra["torch"])
    got = next_draws(fresh, fresh_gen)
    assert_all(got == expected, "this rank's generators did not come back to it")
    assert_all(len(set(comm.allgather(expected))) == comm.size, "the ranks' draws coincide")
    assert_all(resumed.extra["shared"].tolist() == [0, 1, 2] and resumed.step == 2,
               str(resumed.extra))
    files = per_rank_files(directory)
    assert_all(len(files) == comm.size and all(f".{comm.size}." not in f for f in files)
               and {f.split("-")[2] for f in files} == {str(r) for r in range(comm.size)},
               str(files))


@pytest.mark.mpi(min_size=2)
def test_extra_values_that_differ_across_ranks_are_refused_unless_per_rank(comm, tmp_path):
    """Before: saved silently as rank 0's, so every rank would resume rank 0's generator."""
    directory = shared_dir(comm, tmp_path)
    state = rng_state(np.random.default_rng([11, comm.rank]))
    with raises_everywhere(ValueError, match=r"extra values differ across ranks .*\['rng'\].*"
                                             r"checkpoint\.PerRank"):
        checkpoint.save(directory, initial_params(), extra={"rng": state}, comm=comm)
    marked = {"rng": PerRank(state) if comm.rank == 0 else state}
    with raises_everywhere(ValueError, match=r"different extra keys.*per-rank keys.*PerRank"):
        checkpoint.save(directory, initial_params(), extra=marked, comm=comm)
    assert_all(os.listdir(directory) == [], str(os.listdir(directory)))


@pytest.mark.mpi(min_size=2)
def test_a_per_rank_write_error_on_one_rank_keeps_the_previous_checkpoint(comm, tmp_path,
                                                                        monkeypatch):
    directory = shared_dir(comm, tmp_path)
    mine = np.array([comm.rank, 1])
    checkpoint.save(directory, initial_params(), step=1, extra={"x": PerRank(mine)}, comm=comm)
    before = sorted(os.listdir(directory))
    if comm.rank == comm.size - 1:
        def full_disk(path, arrays):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(store, "write_arrays", full_disk)
    with raises_everywhere(OSError, match="No space left on device"):
        checkpoint.save(directory, initial_params(), step=2, extra={"x": PerRank(mine + 1)},
                        comm=comm)
    monkeypatch.undo()
    assert_all(sorted(os.listdir(directory)) == before, "the previous checkpoint was touched")
    resumed = checkpoint.load(directory, initial_params(), comm=comm)
    assert_all(resumed.step == 1 and resumed.extra["x"].tolist() == [comm.rank, 1],
               str(resumed.extra))
