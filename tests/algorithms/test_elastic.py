"""Join(elastic=True) where no rank is lost (any MPI): refusals, the protocol unchanged, the
settle of an interrupted step.  Losses themselves need ULFM: ``make test-elastic``."""

import pickle

import numpy as np
import pytest
from mpi4py import MPI
from toys import AllReducer, Stepper

from tensorplay_mpi import (SGD, Adam, DataParallel, ElasticJoinable, Join, JoinableComm, JoinHook,
                            ZeroRedundancyOptimizer)
from tensorplay_mpi.algorithms import _elastic as elastic
from tensorplay_mpi.comm import iallreduce
from tensorplay_mpi.testing import assert_all, raises_everywhere


@pytest.mark.mpi
def test_joinables_that_cannot_go_on_are_refused_on_every_rank(comm):
    params = [np.zeros(4)]
    dp = DataParallel(params, comm=comm)
    zero = ZeroRedundancyOptimizer(params, dp.grads, Adam, comm=comm)
    with raises_everywhere(ValueError, match="only with copies=True"):
        Join([dp, zero], elastic=True)
    Join([dp, zero])  # without elastic: as before
    with raises_everywhere(ValueError, match="AllReducer cannot go on"):
        Join([AllReducer(comm)], elastic=True)
    with raises_everywhere(ValueError, match="needs the joinable that applies the step"):
        Join([DataParallel([np.zeros(2)], comm=comm)], elastic=True)
    with raises_everywhere(TypeError, match="elastic must be True or False"):
        Join([JoinableComm(comm)], elastic="no")
    Join([JoinableComm(comm)], elastic=True)  # nothing to settle: a validation's Join




@pytest.mark.mpi
def test_an_update_the_settle_cannot_see_is_refused_on_every_rank(comm):
    """A function or lambda (what it advances is invisible), or ZeRO's step (sharded: it goes
    in the Join, with copies)."""
    params = [np.zeros(4)]
    dp = DataParallel(params, comm=comm, update=lambda: opt.update())
    opt = SGD(params, dp.grads, lr=1.0)
    with raises_everywhere(ValueError, match="not a bound method of an object with state_dict"):
        Join([dp], elastic=True)
    Join([dp])  # without elastic: as before
    zero_params = [np.zeros(4)]  # made first, with gradients of its own: a bound method
    zero = ZeroRedundancyOptimizer(zero_params, [np.zeros(4)], Adam, comm=comm)
    zero_dp = DataParallel(zero_params, comm=comm, update=zero.step)
    with raises_everywhere(ValueError, match="ZeroRedundancyOptimizer, which cannot be settled"):
        Join([zero_dp], elastic=True)


def dp_and_sgd(comm):
    """A DataParallel over one array of 3 zeros, and SGD (lr 1) stepping with its gradients."""
    dp = DataParallel([np.zeros(3)], comm=comm)
    return dp, SGD(dp.params, dp.grads, lr=1.0)


@pytest.mark.mpi
def test_no_sync_in_an_elastic_join_is_refused_on_every_rank(comm):
    dp, opt = dp_and_sgd(comm)
    with raises_everywhere(RuntimeError, match="no_sync\\(\\) inside an elastic Join"):
        with Join([dp, opt], elastic=True):
            with dp.no_sync(), dp.step():
                dp.grads[0][...] = 1.0


@pytest.mark.mpi
@pytest.mark.parametrize("owner", ["optimizer", "update"])
def test_an_elastic_join_with_uneven_inputs_equals_a_plain_one(comm, owner):
    def train(elastic_join):
        params = [np.linspace(0, 1, 6).reshape(2, 3), np.ones(3)]
        stepper = Stepper()
        dp = DataParallel(params, comm=comm,  # the optimizer steps with these gradients
                          update=stepper.step if owner == "update" else None)
        opt = stepper.opt = Adam(params, dp.grads, lr=0.1)
        joinables = [dp] if owner == "update" else [dp, opt]
        with Join(joinables, elastic=elastic_join):
            for step in range(2 + comm.rank):
                with dp.step():
                    dp.grads[0][...] = step + comm.rank
                    dp.grads[1][...] = -1.0
                if owner == "optimizer":
                    opt.step()
        return [p.copy() for p in params] + [opt.steps]

    plain, elastic_run = train(False), train(True)
    same = all(np.array_equal(a, b) for a, b in zip(plain, elastic_run))
    longest = comm.size + 1  # every rank steps as often as the one with the most inputs
    moved = not np.array_equal(plain[0], np.linspace(0, 1, 6).reshape(2, 3))
    assert_all(same and moved and plain[2] == longest,
               f"rank {comm.rank}: {elastic_run} != {plain}, or no step ({plain[2]} steps)")


@pytest.mark.mpi
def test_an_exception_in_an_elastic_join_propagates_unchanged(comm):
    dp, opt = dp_and_sgd(comm)
    with raises_everywhere(KeyError, match="mine"):
        with Join([dp, opt], elastic=True):
            with dp.step():
                dp.grads[0][...] = 1.0
            opt.step()
            raise KeyError("mine")
    with Join([dp, opt], elastic=True):  # the communicator stays usable
        with dp.step():
            dp.grads[0][...] = 1.0
        opt.step()
    assert_all(bool((dp.params[0] == -2.0).all()), f"rank {comm.rank}: {dp.params[0]}")


@pytest.mark.mpi(min_size=2)
def test_the_settle_gives_the_state_of_the_lowest_rank_that_applied_the_step(comm):
    """A survivor one update behind receives the parameters, the optimizer state and the
    counts of the lowest survivor that applied it (what an interrupted step leaves)."""
    params = [np.zeros(3)]
    dp = DataParallel(params, comm=comm)
    opt = Adam(params, dp.grads, lr=0.1)
    with Join([dp, opt]):
        for _ in range(2):
            with dp.step():
                dp.grads[0][...] = 1.0
            opt.step()
    ahead = comm.rank % 2 == 1  # ranks 1, 3: the interrupted step applied here only
    if ahead:
        dp.grads[0][...] = 5.0
        opt.update()
    expected = [a.copy() for a in opt.elastic_state()]
    for array in expected:  # rank 1's: the lowest rank ahead
        comm.Bcast(array, root=1)
    step, root = elastic.settle(comm, [dp, opt], 60.0)
    ok = (step, root) == (3, 1) and opt.steps == 3 and dp.steps == 2 and all(
        np.array_equal(a, e) for a, e in zip(opt.elastic_state(), expected))
    assert_all(ok, f"rank {comm.rank}: settled at {step} from {root}, params {params[0]} "
                   f"(rank 1's {expected[0]}), steps {opt.steps}/{dp.steps}")


@pytest.mark.mpi(min_size=2)
def test_survivors_more_than_one_update_apart_are_refused_on_every_rank(comm):
    with raises_everywhere(RuntimeError, match="more than the one an interrupted step"):
        elastic._settled_step(comm, 2 * comm.rank, 60.0)


def torch_sgd_run(comm, steps, extra):
    """Linear(3, 2) + BatchNorm1d(2), float64, trained by torch SGD with momentum through
    ``update=opt.step`` in an elastic Join for `steps` steps, every rank active; then `extra`
    more updates on this rank only (with gradient 5), as an interrupted step leaves a survivor
    that completed it.  Returns (model, opt, dp)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers(), update=opt.step)
    x = torch.arange(24, dtype=torch.float64).reshape(8, 3).sin()
    with Join([dp], elastic=True):
        for _ in range(steps):
            with dp.step():
                model(x).square().mean().backward()
    for _ in range(extra):
        for p in model.parameters():
            p.grad.fill_(5.0)
        opt.step()
    return model, opt, dp


class Applied:
    """A joinable's side of an elastic settle that says how many updates this rank applied
    (the step owner's count, as an interrupted step leaves it), with no state of its own."""

    def __init__(self, updates):
        self.updates = updates

    def elastic_progress(self):
        return self.updates

    def elastic_state(self):
        return []

    def elastic_restore(self):
        pass

    def elastic_companions(self):
        return []


def torch_state(model, opt):
    """The model's parameters and buffers and the optimizer's momentum buffers, as arrays."""
    tensors = [*model.state_dict().values()]
    tensors += [s["momentum_buffer"] for s in opt.state.values()]
    return [t.detach().numpy().copy() for t in tensors]


@pytest.mark.mpi(min_size=2)
def test_the_settle_gives_update_s_torch_optimizer_the_state_of_the_rank_it_adopts(comm):
    """A survivor behind adopts the momentum of the lowest survivor that applied the step (a
    serial torch run of the same updates), not only its parameters."""
    ahead = comm.rank % 2 == 1  # ranks 1, 3: the interrupted step completed here only
    model, opt, dp = torch_sgd_run(comm, 2, int(ahead))
    serial_model, serial_opt, _ = torch_sgd_run(comm.Split(comm.rank, 0), 2, 1)
    expected = torch_state(serial_model, serial_opt)
    step, root = elastic.settle(comm, [dp, Applied(2 + int(ahead))], 60.0)
    got = torch_state(model, opt)
    ok = (step, root) == (3, 1) and all(np.allclose(g, e, rtol=0, atol=1e-12)
                                        for g, e in zip(got, expected))
    assert_all(ok, f"rank {comm.rank}: settled at {step} from {root}; momentum "
                   f"{got[-2:]} against the serial {expected[-2:]}")


@pytest.mark.mpi
def test_a_redone_step_starts_from_the_buffers_of_the_last_completed_step(comm):
    """The forward pass of a step nobody completed moved the running statistics and
    num_batches_tracked; the settle gives back those of the last completed step."""
    torch = pytest.importorskip("torch")
    model, opt, dp = torch_sgd_run(comm, 2, 0)
    before = [t.clone() for t in model.buffers()]  # after 2 steps
    model(torch.ones(4, 3, dtype=torch.float64))  # the interrupted step's forward pass
    elastic.settle(comm, [dp], 60.0)
    after = list(model.buffers())
    ok = int(after[-1]) == 2 and all(bool((a == b).all()) for a, b in zip(after, before))
    assert_all(ok, f"rank {comm.rank}: buffers {after} after the settle, {before} before the "
                   "interrupted forward pass")


def test_update_is_a_torch_optimizers_step_that_a_scheduler_wrapped(comm):
    """Making an LR scheduler replaces ``opt.step`` with a function (torch's wrapper, holding a
    weak reference to the optimizer): it is still the optimizer's step, settled with it."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.optim.lr_scheduler.StepLR(opt, 1)
    owner = elastic.update_owner(opt.step)
    dp = DataParallel(model.parameters(), comm=comm, update=opt.step)
    with Join([dp], elastic=True):
        pass
    assert_all(owner is opt, f"the owner of the wrapped step is {owner!r}")


class Owner:
    """update='s owner whose state_dict() (on rank `bad_save`) or load_state_dict() (on rank
    `bad_load`) fails, as a user's object may on one survivor only."""

    def __init__(self, rank, bad_save=-1, bad_load=-1):
        self.rank, self.bad_save, self.bad_load, self.count = rank, bad_save, bad_load, 0

    def step(self):
        self.count += 1

    def state_dict(self):
        return {"count": self.count, "f": (lambda: 0) if self.rank == self.bad_save else 0}

    def load_state_dict(self, state):
        if self.rank == self.bad_load:
            raise ValueError("this owner's state does not load here")
        self.count = state["count"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("failing", ["state_dict", "load_state_dict"])
def test_an_owner_state_that_fails_on_one_survivor_raises_on_every_survivor(comm, failing):
    """The adopted survivor (rank 1) cannot pickle its owner's state, or another survivor
    (rank 0) cannot load it: every survivor raises at once (no survivor waits for a broadcast
    that never comes, none goes on with replicas that differ)."""
    bad = {"bad_save": 1} if failing == "state_dict" else {"bad_load": 0}
    owner = Owner(comm.rank, **bad)
    dp = DataParallel([np.zeros(3)], comm=comm, update=owner.step)
    ahead = comm.rank == 1
    if failing == "state_dict":
        expected = (AttributeError, TypeError, pickle.PicklingError) if ahead else RuntimeError
    else:
        expected = ValueError
    with raises_everywhere(expected):
        elastic.settle(comm, [dp, Applied(1 + int(ahead))], 60.0)


class RunningSum(ElasticJoinable):
    """A user's elastic joinable, written from the documented protocol only: each step sums one
    value over the ranks (a joined rank adds 0) and adds it to a total every rank holds."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm
        self.total = np.zeros(1)  # the replicated state
        self.count = np.zeros(1, np.int64)  # the steps applied, an array: a settle writes it

    def step(self, value):
        Join.notify_join_context(self)
        self.apply(self.reduce(value))

    def reduce(self, value):
        buf = np.array([float(value)])
        iallreduce(self.comm, MPI.IN_PLACE, buf, MPI.SUM).wait()
        return buf[0]

    def apply(self, summed):
        self.total += summed
        self.count += 1

    def elastic_progress(self):
        return int(self.count[0])

    def elastic_state(self):
        return [self.total, self.count]

    def move_to(self, comm):
        self.comm = comm

    def join_hook(self, **kwargs):
        summer = self

        class Shadow(JoinHook):
            def main_hook(self):
                summer.apply(summer.reduce(0.0))
        return Shadow()

    @property
    def join_device(self):
        return "cpu"

    @property
    def join_process_group(self):
        return self.comm


@pytest.mark.mpi
def test_a_users_elastic_joinable_runs_uneven_inputs_and_settles_from_the_rank_ahead(comm):
    """The public protocol (ElasticJoinable): accepted by Join(elastic=True), exact on uneven
    inputs (against the closed-form sum), and settled from the lowest rank that applied one
    more update (what a step interrupted by a lost rank leaves)."""
    summer = RunningSum(comm)
    steps = [2 + r for r in range(comm.size)]  # rank r steps 2 + r times, with value r + 1
    with Join([summer], elastic=True):
        for _ in range(steps[comm.rank]):
            summer.step(comm.rank + 1)
    expected = sum((r + 1) * n for r, n in enumerate(steps))
    ok = summer.total[0] == expected and summer.count[0] == max(steps)
    ahead = comm.rank % 2 == 1  # ranks 1, 3: an interrupted step applied here only
    if ahead:
        summer.apply(100.0 * comm.rank)
    step, root = elastic.settle(comm, [summer], 60.0)
    settled = expected + 100.0 if comm.size > 1 else expected
    if comm.size > 1:
        ok = ok and (step, root) == (max(steps) + 1, 1)
    ok = ok and summer.total[0] == settled and summer.count[0] == step
    assert_all(ok, f"rank {comm.rank}: total {summer.total[0]} (expected {expected}, then "
                   f"{settled}), count {summer.count[0]}, settled {step} from {root}")


@pytest.mark.mpi
def test_an_elastic_joinable_without_move_to_cannot_be_made(comm):
    class NoMove(ElasticJoinable):
        def __init__(self):
            super().__init__()

        def join_hook(self, **kwargs):
            return JoinHook()

        join_device = "cpu"
        join_process_group = comm

    with raises_everywhere(TypeError, match="move_to"):
        NoMove()


@pytest.mark.mpi(min_size=2)
def test_elastic_states_laid_out_differently_raise_on_every_survivor(comm):
    """elastic_state() arrays of another shape on one rank would be received in part, or
    truncate: the settle compares their layout first (ValueError on every rank)."""
    summer = RunningSum(comm)
    if comm.rank == 1:
        summer.total = np.zeros(3)
    with raises_everywhere(ValueError, match="elastic_state.. arrays differ"):
        elastic.settle(comm, [summer], 60.0)
