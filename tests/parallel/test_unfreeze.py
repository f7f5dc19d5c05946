"""Fine-tuning as the docs write it: a layer frozen, a Join; then unfrozen, `del dp`, a new
DataParallel over the same parameters and a new Join; against serial torch.optim."""

import copy
import gc
import weakref

import pytest

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.testing import assert_all, inputs_of

torch = pytest.importorskip("torch")
from torch_reference import Branchy, arrays, close, loss_of, same_everywhere  # noqa: E402

PHASES = 2  # frozen, then unfrozen


def set_frozen(model, frozen):
    for p in model.first.parameters():
        p.requires_grad_(not frozen)


def serial(inputs):
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for phase in range(PHASES):
        set_frozen(model, phase == 0)
        for t in range(max(inputs)):
            model.zero_grad(set_to_none=True)
            for rank in range(len(inputs)):
                if inputs[rank] > t:
                    loss_of(model, rank, 10 * phase + t).backward()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad /= len(inputs)
            opt.step()
    return model


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["three_plus_rank", "rank0_zero"])
def test_a_new_data_parallel_after_unfreezing_trains_as_serial(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    old = None
    for phase in range(PHASES):
        set_frozen(model, phase == 0)
        if phase:
            del dp  # the documented way: the exited Join keeps no reference  # noqa: F821
            assert_all(old() is None, "the old DataParallel is still alive")
        dp = DataParallel(model.parameters(), comm=comm, update=opt.step)
        old = weakref.ref(dp)
        with Join([dp]) as join:
            for t in range(inputs[comm.rank]):
                model.zero_grad()
                with dp.step():
                    loss_of(model, comm.rank, 10 * phase + t).backward()
        assert_all(join.joinables == () and not join.stopped)
    expected = arrays(serial(inputs))
    assert_all(not close(arrays(model), expected), close(arrays(model), expected))
    assert_all(same_everywhere(arrays(model), comm), "the ranks differ")


@pytest.mark.mpi
def test_a_refusal_names_what_may_still_hold_the_old_one(comm):
    model = Branchy()
    dp = DataParallel(model.parameters(), comm=comm)
    forgotten = Join([dp])  # made, never entered: it holds dp
    del dp
    gc.collect()
    with pytest.raises(ValueError, match="a Join made but never entered"):
        DataParallel(model.parameters(), comm=comm)
    del forgotten
    gc.collect()  # the forgotten Join and its DataParallel reference each other
    DataParallel(model.parameters(), comm=comm)  # accepted once nothing holds the old one


@pytest.mark.mpi
def test_a_whole_model_saved_after_training_loads_unbound(comm, tmp_path_factory):
    """torch.save(model) after a DataParallel trained it (the parameters' link to their
    binding pickled a weak reference: TypeError); the loaded model and a deep copy are bound
    to nothing, so a DataParallel over them is accepted while the first is alive."""
    model = Branchy()
    dp = DataParallel(model.parameters(), comm=comm)
    with Join([dp]):
        with dp.step():
            loss_of(model, comm.rank, 0).backward()
    path = tmp_path_factory.mktemp(f"whole-{comm.rank}") / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    copied = copy.deepcopy(model)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))
    for other in (loaded, copied):
        DataParallel(other.parameters(), comm=comm)
    assert_all(same and dp.steps == 1, "the loaded model differs")
