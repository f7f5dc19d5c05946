"""tensorplay_mpi.checkpoint._rng: a generator's state as a plain array, through a checkpoint,
exactly (each rank's own, as a PerRank value: tests/checkpoint/test_checkpoint.py at
several ranks)."""

import os

import numpy as np
import pytest

from tensorplay_mpi import checkpoint
from tensorplay_mpi.checkpoint import PerRank
from tensorplay_mpi.checkpoint._rng import rng_state, set_rng_state

NUMPY_GENERATORS = {
    "Generator(PCG64)": lambda: np.random.default_rng(5),
    "Generator(Philox)": lambda: np.random.Generator(np.random.Philox(5)),
    "MT19937": lambda: np.random.MT19937(5),
    "RandomState": lambda: np.random.RandomState(5),
}


def draw(generator):
    if isinstance(generator, np.random.BitGenerator):
        return generator.random_raw(5)
    if isinstance(generator, np.random.RandomState):
        return generator.normal(size=5)
    return generator.normal(size=5)


@pytest.mark.parametrize("make", NUMPY_GENERATORS.values(), ids=NUMPY_GENERATORS)
def test_a_numpy_generator_resumes_its_draws_through_a_checkpoint(tmp_path, make):
    generator = make()
    draw(generator)
    state = rng_state(generator)
    assert state.dtype == np.uint8 and state.ndim == 1
    checkpoint.save(tmp_path, [np.zeros(1)], extra={"rng": state})
    expected = draw(generator)  # what the run never stopped draws next

    fresh = make()
    draw(fresh), draw(fresh)  # somewhere else
    set_rng_state(fresh, checkpoint.load(tmp_path, [np.zeros(1)]).extra["rng"])
    assert draw(fresh).tobytes() == expected.tobytes()


def test_a_torch_generator_resumes_its_draws_through_a_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(3)
    torch.rand(4, generator=generator)
    checkpoint.save(tmp_path, [np.zeros(1)], extra={"rng": rng_state(generator)})
    expected = torch.rand(4, generator=generator)
    fresh = torch.Generator().manual_seed(9)
    set_rng_state(fresh, checkpoint.load(tmp_path, [np.zeros(1)]).extra["rng"])
    assert torch.equal(torch.rand(4, generator=fresh), expected)


def test_states_of_another_kind_or_not_states_are_refused():
    with pytest.raises(ValueError, match="one of a PCG64 bit generator, this generator's is "
                                         "MT19937"):
        set_rng_state(np.random.MT19937(1), rng_state(np.random.default_rng(1)))
    with pytest.raises(TypeError, match="1-d uint8 array"):
        set_rng_state(np.random.default_rng(1), np.zeros(3))
    with pytest.raises(TypeError, match="got dict"):
        rng_state({"state": 1})


@pytest.mark.parametrize("make", NUMPY_GENERATORS.values(), ids=NUMPY_GENERATORS)
def test_a_per_rank_generator_state_resumes_its_draws(tmp_path, make):
    generator = make()
    draw(generator)
    checkpoint.save(tmp_path, [np.zeros(1)], extra={"rng": PerRank(rng_state(generator))})
    expected = draw(generator)
    fresh = make()
    draw(fresh)
    resumed = checkpoint.load(tmp_path, [np.zeros(1)])
    set_rng_state(fresh, resumed.extra["rng"])
    assert draw(fresh).tobytes() == expected.tobytes()
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("per-rank-"))[0].startswith(
        "per-rank-0-of-1.")


@pytest.mark.parametrize("value, match", [
    ({"state": 1}, r"extra\['rng'\] \(dict\)"),
    (np.array([None]), r"extra\['rng'\] \(ndarray\): dtype object"),
    (PerRank(np.zeros(1)), r"extra\['rng'\] \(PerRank\)")])
def test_a_per_rank_value_is_checked_as_a_plain_one(tmp_path, value, match):
    with pytest.raises(TypeError, match=match):
        checkpoint.save(tmp_path, [np.zeros(1)], extra={"rng": PerRank(value)})
    assert not os.listdir(tmp_path)
