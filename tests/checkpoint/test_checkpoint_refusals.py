"""What load could not read is never written, and a resume checks the run's configuration:
refusals on every rank, the previous checkpoint whole."""

import os

import numpy as np
import pytest

from tensorplay_mpi import checkpoint
from tensorplay_mpi.testing import assert_all, raises_everywhere

CONFIG = {"batch_size": 16, "seed": 0, "lr": 0.2, "hidden": [64], "divide": "world"}


def previous(comm, tmp_path, **kwargs):
    """A good checkpoint in rank 0's tmp_path; (directory, its manifest's bytes)."""
    directory = comm.bcast(str(tmp_path))
    checkpoint.save(directory, [np.arange(3.0)], comm=comm, **kwargs)
    with open(os.path.join(directory, checkpoint.MANIFEST), "rb") as f:
        return directory, f.read()


def assert_whole(comm, directory, manifest):
    with open(os.path.join(directory, checkpoint.MANIFEST), "rb") as f:
        same = f.read() == manifest
    files = sorted(os.listdir(directory))
    assert_all(same and files == [checkpoint.MANIFEST], f"the checkpoint changed: {files}")
    params = [np.zeros(3)]
    checkpoint.load(directory, params, comm=comm)
    assert_all(params[0].tolist() == [0.0, 1.0, 2.0], "the previous checkpoint does not load")


@pytest.mark.mpi
@pytest.mark.parametrize("bad", ["rng dict", "object array", "ragged list"])
def test_save_refuses_what_load_cannot_read_on_every_rank_before_writing(comm, tmp_path, bad):
    directory, manifest = previous(comm, tmp_path)
    odd = comm.rank == comm.size - 1  # only the last rank passes the bad value
    value = {"rng dict": np.random.default_rng(0).bit_generator.state,
             "object array": np.array([1, "a", None], dtype=object),
             "ragged list": [[1, 2], [3]]}[bad] if odd else np.zeros(2)
    with raises_everywhere(TypeError, match=r"cannot save extra\['state'\]"):
        checkpoint.save(directory, [np.full(3, 9.0)], extra={"state": value}, comm=comm)
    assert_whole(comm, directory, manifest)


@pytest.mark.mpi
def test_save_refuses_object_parameters_on_every_rank(comm, tmp_path):
    directory, manifest = previous(comm, tmp_path)
    with raises_everywhere(TypeError, match=r"cannot save params\[1\]: dtype object"):
        checkpoint.save(directory, [np.zeros(3), np.array([None, 1])], comm=comm)
    assert_whole(comm, directory, manifest)


@pytest.mark.mpi
def test_load_refuses_another_configuration_naming_the_keys_that_differ(comm, tmp_path):
    directory, _ = previous(comm, tmp_path, config=CONFIG)
    params = [np.zeros(3)]
    changed = {**CONFIG, "batch_size": 32, "seed": 1}
    with raises_everywhere(ValueError, match=r"another configuration \(batch_size: saved 16, now "
                                             r"32; seed: saved 0, now 1\)"):
        checkpoint.load(directory, params, config=changed, comm=comm)
    assert_all(not params[0].any(), "a refused load modified the parameters")
    with raises_everywhere(ValueError, match=r"extra: saved \(absent\), now 1"):
        checkpoint.load(directory, params, config={**CONFIG, "extra": 1}, comm=comm)
    resumed = checkpoint.load(directory, params, config=dict(CONFIG), comm=comm)
    assert_all(resumed is not None and params[0].tolist() == [0.0, 1.0, 2.0], str(resumed))
    assert_all(checkpoint.load(directory, [np.zeros(3)], comm=comm) is not None,
               "config=None checks nothing")


@pytest.mark.mpi
def test_a_checkpoint_without_configuration_is_refused_when_one_is_given(comm, tmp_path):
    directory, _ = previous(comm, tmp_path)
    with raises_everywhere(ValueError, match="records no configuration"):
        checkpoint.load(directory, [np.zeros(3)], config=CONFIG, comm=comm)


@pytest.mark.mpi
def test_a_configuration_that_is_not_plain_data_is_refused_before_writing(comm, tmp_path):
    directory, manifest = previous(comm, tmp_path)
    with raises_everywhere(TypeError, match=r"config 'shape' = .* cannot be recorded"):
        checkpoint.save(directory, [np.full(3, 9.0)], config={"shape": object()}, comm=comm)
    assert_whole(comm, directory, manifest)
