"""Checkpoints in one process (COMM_SELF): round trips, exact resume, atomic writes, refusals."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import SGD, Adam, AdamW, checkpoint
from tensorplay_mpi.checkpoint import _store as store

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
