"""Checkpoints written before the optimizer protocol (fixtures/checkpoints-v1 beside this file,
made at 2 ranks by tests/programs/checkpoint_fixtures.py) load at any world size, and one more step
gives bitwise what the version that wrote them gave."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from helpers import PROGRAMS

from tensorplay_mpi import checkpoint
from tensorplay_mpi.testing import assert_all

DATA = Path(__file__).parent / "fixtures" / "checkpoints-v1"
_spec = importlib.util.spec_from_file_location(
    "checkpoint_fixtures", PROGRAMS / "checkpoint_fixtures.py")
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)


@pytest.mark.mpi
@pytest.mark.parametrize("kind, zero", fixtures.KINDS)
def test_a_checkpoint_of_the_previous_version_loads_and_steps_bitwise(comm, kind, zero):
    params = [np.zeros(s) for s in fixtures.SHAPES]
    grads = [np.zeros(s) for s in fixtures.SHAPES]
    opt = fixtures.make(kind, params, grads, comm)
    resumed = checkpoint.load(DATA / f"{kind}-{zero}", params, optimizer=opt, comm=comm,
                              resize=True)
    fixtures.step(opt, grads, fixtures.STEPS)
    with np.load(DATA / f"{kind}-{zero}-after.npz") as after:
        expected = [after[f"arr_{i}"] for i in range(len(params))]
    ok = resumed is not None and resumed.step == fixtures.STEPS and resumed.world_size == 2 \
        and all(np.array_equal(p, e) for p, e in zip(params, expected))
    assert_all(ok, f"resumed {resumed}; params {params} != {expected}")
