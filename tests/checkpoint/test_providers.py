"""Checkpoints of state providers, one call: ``save(directory, {"model": dp, "optimizer": opt,
"sampler": sampler, ...})`` at any rank count, against a serial NumPy (textbook Adam) or serial
torch replay of the same sample ids; each rank's own state through a provider; a resume at
another world size; state that differs across ranks, and objects that are no providers,
refused on every rank before anything is written."""

import os

import numpy as np
import pytest
from linear import gradient, initial_params, make_problem
from mpi4py import MPI
from textbook import HYPER, step

from tensorplay_mpi import (Adam, DataParallel, Join, ZeroRedundancyOptimizer, checkpoint,
                            clear_stop, request_stop)
from tensorplay_mpi.checkpoint import Consolidated, PerRank
from tensorplay_mpi.data import Sampler
from tensorplay_mpi.testing import assert_all, raises_everywhere

SAMPLES, BATCH, SKEW, SEED = 90, 4, 1.0, 3
NOISE = 1e-3  # each rank adds its own generator's draws to its gradient: a per-rank state
STOP_AT = 2  # the last rank asks to stop before this iteration of the first epoch
EPOCHS = 2


def shared_dir(comm, tmp_path):
    return comm.bcast(str(tmp_path))


# -- the reference: the same sample ids, serially, without the library --------------------------


def reference_batches(size, epoch):
    """Every rank's batches of `epoch` at `size` ranks: rank r's contiguous share (weight
    1 + SKEW * r) of the sample ids, permuted by default_rng([SEED, epoch, r])."""
    shares = 1.0 + SKEW * np.arange(size)
    bounds = np.rint(np.concatenate([[0.0], np.cumsum(shares)]) / shares.sum() * SAMPLES)
    out = []
    for r in range(size):
        ids = np.random.default_rng([SEED, epoch, r]).permutation(
            np.arange(int(bounds[r]), int(bounds[r + 1])))
        out.append([ids[i:i + BATCH] for i in range(0, ids.size, BATCH)])
    return out


def noise_rng(rank):
    return np.random.default_rng([17, rank])


def serial_replay(size, epochs=EPOCHS):
    """Textbook Adam on the gradient summed over the active ranks (each with its own noise)
    and divided by the world size, step by step: what every rank's parameters must be."""
    x, y = make_problem()
    params, states, t = initial_params(), [{}, {}], 0
    noise = [noise_rng(r) for r in range(size)]
    for epoch in range(1, epochs + 1):
        batches = reference_batches(size, epoch)
        for s in range(max(len(b) for b in batches)):
            total = [np.zeros_like(p) for p in params]
            for r in [r for r in range(size) if s < len(batches[r])]:
                ids = batches[r][s]
                for k, g in enumerate(gradient(params, x[ids], y[ids])):
                    total[k] += g + NOISE * noise[r].normal(size=g.shape)
            t += 1
            params = [step("adam", HYPER["adam"], p, g / size, st, t)
                      for p, g, st in zip(params, total, states)]
    return params


# -- the distributed run -----------------------------------------------------------------------


class Schedule:
    """A user's provider: replicated plain state (numbers, a string, an array)."""

    def __init__(self):
        self.epochs_done, self.name, self.history = 0, "fresh", np.zeros(0)

    def state_dict(self):
        return {"epochs_done": self.epochs_done, "name": self.name, "history": self.history}

    def load_state_dict(self, state):
        self.epochs_done, self.name = state["epochs_done"], state["name"]
        self.history = np.array(state["history"])

    def end_epoch(self, value):
        self.epochs_done += 1
        self.name = f"after epoch {self.epochs_done}"
        self.history = np.append(self.history, value)


def run(comm, kind, offset=0.0):
    """This rank's objects (parameters off the initial ones by `offset`)."""
    params = [p + offset for p in initial_params()]
    dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-6)
    opt = (ZeroRedundancyOptimizer(params, dp.grads, Adam, comm=comm, **HYPER["adam"])
           if kind != "adam" else Adam(params, dp.grads, **HYPER["adam"]))
    sampler = Sampler(SAMPLES, comm.rank, comm.size, batch_size=BATCH, seed=SEED, skew=SKEW)
    return params, dp, opt, sampler, noise_rng(comm.rank + 100), Schedule()


def state_of(dp, opt, sampler, noise, schedule, kind):
    """The one mapping a save and a load take."""
    return {"model": dp, "optimizer": Consolidated(opt) if kind == "consolidated" else opt,
            "sampler": sampler, "noise": PerRank(noise), "schedule": schedule}


def epoch(comm, dp, opt, sampler, noise, used, stop_at=None):
    """The rest of the sampler's epoch (from its cursor), each rank's gradient with its own
    noise; the last rank asks to stop before its iteration `stop_at`."""
    x, y = make_problem()
    with Join([dp, opt]) as join:
        for i, idx in enumerate(sampler):
            if join.stopped:
                break
            if i == stop_at and comm.rank == comm.size - 1:
                request_stop("test")
            with dp.step():
                for k, g in enumerate(gradient(dp.params, x[idx], y[idx])):
                    dp.grads[k][...] = g + NOISE * noise.normal(size=g.shape)
            opt.step()
            used.append((sampler.epoch, idx.tolist()))
    clear_stop()
    return join.stopped


def train(comm, objects, used, first=1, stop=False):
    """Epochs `first`.. EPOCHS; with `stop`, the first one is stopped (returns True)."""
    params, dp, opt, sampler, noise, schedule = objects
    for e in range(first, EPOCHS + 1):
        sampler.set_epoch(e)
        if epoch(comm, dp, opt, sampler, noise, used, STOP_AT if stop else None):
            return True
        schedule.end_epoch(float(params[1][0]))
    return False


def ids_by_epoch(comm, used):
    """Every rank's sample ids per epoch, gathered: {epoch: sorted ids}."""
    out = {}
    for ids in comm.allgather(used):
        for e, batch in ids:
            out.setdefault(e, []).extend(batch)
    return {e: sorted(v) for e, v in out.items()}


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["adam", "zero", "consolidated"])
def test_a_run_stopped_saved_in_one_call_and_resumed_equals_the_serial_replay(comm, tmp_path,
                                                                                kind):
    directory = shared_dir(comm, tmp_path)
    expected = serial_replay(comm.size)
    plain = run(comm, kind)
    plain[4].bit_generator.state = noise_rng(comm.rank).bit_generator.state
    train(comm, plain, [])

    first = run(comm, kind)
    first[4].bit_generator.state = noise_rng(comm.rank).bit_generator.state
    used = []
    assert_all(train(comm, first, used, stop=True), "the first run did not stop")
    saved = checkpoint.save(directory, state_of(*first[1:], kind), comm=comm)
    cursor = first[3].cursor

    second = run(comm, kind, 5.0)  # other parameters, noise, cursor: all must come back
    resumed = checkpoint.load(directory, state_of(*second[1:], kind), comm=comm)
    ok = (resumed.epoch == 1 and resumed.cursor == cursor and second[3].cursor == cursor
          and second[1].steps == first[1].steps == resumed.step
          and second[5].state_dict()["name"] == "fresh" and second[3].epoch == 1)
    train(comm, second, used, first=1)
    params = second[0]
    assert_all(ok, f"counters {resumed.step, resumed.epoch, resumed.cursor}, cursor {cursor}")
    assert_all(all(np.allclose(p, e, rtol=1e-12, atol=1e-14) for p, e in zip(params, expected)),
               "the resumed run left the serial replay")
    assert_all(all(a.tobytes() == b.tobytes() for a, b in zip(params, plain[0])),
               "the resumed run is not bitwise the run never stopped")
    reference = {e: sorted(int(i) for b in reference_batches(comm.size, e) for ids in b
                           for i in ids) for e in (1, 2)}
    assert_all(ids_by_epoch(comm, used) == reference == {e: list(range(SAMPLES)) for e in (1, 2)},
               "the sample ids are not the replay's, each once per epoch")
    assert_all(second[5].history.tobytes() == plain[5].history.tobytes()
               and second[5].epochs_done == 2, "the user's provider did not come back")
    files = sorted(os.listdir(directory))
    assert_all(saved.path == os.path.join(directory, checkpoint.MANIFEST)
               and sum(f.startswith("optimizer-shard-") for f in files)
               == (comm.size if kind == "zero" else 0)
               and sum(f.startswith("per-rank-") for f in files) == comm.size, str(files))


class Tally:
    """A provider with state of each rank's own (``PerRank`` values) beside replicated state."""

    def __init__(self, mine, shared):
        self.mine, self.shared = mine, shared

    def state_dict(self):
        return {"mine": PerRank(self.mine), "shared": self.shared,
                "nested": {"count": PerRank(int(self.mine.sum())), "label": "t"}}

    def load_state_dict(self, state):
        self.loaded = state
        self.shared = state["shared"]
        self.mine = state["mine"] if "mine" in state else None


class Counter:
    """Each rank's own plain counts: numbers in its state differ across ranks."""

    def __init__(self, count):
        self.count = count

    def state_dict(self):
        return {"count": self.count, "log": [self.count, "x"]}

    def load_state_dict(self, state):
        self.count = state["count"]


@pytest.mark.mpi
def test_each_rank_s_state_comes_back_to_it_through_a_provider(comm, tmp_path):
    directory = shared_dir(comm, tmp_path)
    rng = np.random.default_rng([5, comm.rank])
    rng.normal(size=3)
    tally = Tally(np.arange(comm.rank + 2) * 10 + comm.rank, np.array([1.5, 2.5]))
    state = {"tally": tally, "counter": PerRank(Counter(comm.rank + 40)),
             "rng": PerRank(rng), "shared_rng": np.random.default_rng(9)}
    checkpoint.save(directory, state, comm=comm)
    expected = rng.normal(size=4).tobytes()  # what this rank's generator draws next
    fresh_rng = np.random.default_rng(1234)
    fresh = {"tally": Tally(np.zeros(1), np.zeros(2)), "counter": PerRank(Counter(-1)),
             "rng": PerRank(fresh_rng), "shared_rng": np.random.default_rng(0)}
    checkpoint.load(directory, fresh, comm=comm)
    got = fresh["tally"]
    ok = (got.mine.tolist() == (np.arange(comm.rank + 2) * 10 + comm.rank).tolist()
          and got.shared.tolist() == [1.5, 2.5]
          and int(got.loaded["nested"]["count"]) == int(tally.mine.sum())
          and got.loaded["nested"]["label"] == "t"
          and fresh["counter"].value.count == comm.rank + 40
          and fresh_rng.normal(size=4).tobytes() == expected
          and fresh["shared_rng"].normal() == np.random.default_rng(9).normal())
    assert_all(ok, f"rank {comm.rank}: {got.loaded}, counter {fresh['counter'].value.count}")
    assert_all(len(set(comm.allgather(expected))) == comm.size, "the ranks' draws coincide")


def sub_comm(comm, size):
    return comm.Split(0 if comm.rank < size else MPI.UNDEFINED, comm.rank)


PAIRS = [(2, 3), (3, 2), (4, 2), (1, 2), (2, 1)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{n}to{m}" for n, m in PAIRS])
def test_a_resize_through_providers_uses_every_sample_once_and_reshards_zero(comm, tmp_path,
                                                                             pair):
    n, m = pair
    if max(pair) > comm.size:
        pytest.skip(f"needs {max(pair)} ranks")
    directory = shared_dir(comm, tmp_path)
    used, stopped, saved = [], True, None
    sub = sub_comm(comm, n)
    if sub != MPI.COMM_NULL:
        objects = run(sub, "zero")
        stopped = train(sub, objects, used, stop=True)
        tally = Tally(np.array([sub.rank]), np.array([7.0]))
        checkpoint.save(directory, {**state_of(*objects[1:], "zero"), "tally": tally}, comm=sub)
        saved = objects[0][0].copy()
        objects[2].consolidate_state_dict(to=0)
        moments = objects[2].state_dict()["state"] if sub.rank == 0 else None
        sub.Free()
    assert_all(stopped, "the run at N ranks did not stop")
    saved, moments = comm.bcast((saved, moments) if comm.rank == 0 else None)

    sub = sub_comm(comm, m)
    ok, detail = True, ""
    if sub != MPI.COMM_NULL:
        objects = run(sub, "zero", 5.0)
        noise_before = objects[4].bit_generator.state
        tally = Tally(np.zeros(1), np.zeros(1))
        resumed = checkpoint.load(directory, {**state_of(*objects[1:], "zero"), "tally": tally},
                                  comm=sub, resize=True)
        opt = objects[2]
        opt.consolidate_state_dict(to=0)
        if sub.rank == 0:
            state = opt.state_dict()["state"]
            ok = all(state[i][k].tobytes() == moments[i][k].tobytes()
                     for i in moments for k in moments[i])
        ok = ok and objects[0][0].tobytes() == saved.tobytes() and resumed.world_size == n
        ok = ok and objects[4].bit_generator.state == noise_before  # per-rank: kept as it was
        try:
            tally.loaded["mine"]
            ok, detail = False, "a per-rank value came back at another world size"
        except KeyError as missing:
            detail = str(missing)
            ok = ok and f"at {n} ranks and this job has {m}" in detail
        ok = ok and "mine" not in tally.loaded and tally.shared.tolist() == [7.0]
        train(sub, objects, used, first=1)
        sub.Free()
    assert_all(ok, detail)
    every = ids_by_epoch(comm, used)
    assert_all(every == {1: list(range(SAMPLES)), 2: list(range(SAMPLES))},
               "a sample was used other than once per epoch")


class Differs:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["array", "number", "per_rank_on_rank0_only"])
def test_provider_state_that_differs_across_ranks_is_refused_on_every_rank(comm, tmp_path,
                                                                         case):
    directory = shared_dir(comm, tmp_path)
    params = initial_params()
    dp = DataParallel(params, comm=comm)
    if case == "array":
        state, match = {"model": dp, "gen": np.random.default_rng([1, comm.rank])}, \
            r"state \['gen'\] differ.* across ranks.*PerRank"
    elif case == "number":
        state, match = {"model": dp, "tally": Differs({"n": comm.rank, "same": 1})}, \
            r"state \['tally'\] differ.* across ranks.*PerRank"
    else:
        tally = Differs({"n": np.arange(3)})
        state, match = ({"model": dp, "tally": PerRank(tally) if comm.rank == 0 else tally},
                        r"different state entries, or per-rank ones on some ranks only")
    with raises_everywhere(ValueError, match=match):
        checkpoint.save(directory, state, comm=comm)
    assert_all(os.listdir(directory) == [], str(os.listdir(directory)))


class NoLoad:
    def state_dict(self):
        return {"x": np.zeros(2)}


class Unsavable:
    def state_dict(self):
        return {"f": print}

    def load_state_dict(self, state):
        pass


@pytest.mark.mpi
@pytest.mark.parametrize("bad, match", [
    (object(), r"state\['bad'\] .*object.*not a state provider.*state_dict\(\)"),
    (NoLoad(), r"state\['bad'\] .*NoLoad.*has state_dict\(\) but no load_state_dict\(\)"),
    (Unsavable(), r"state\['bad'\]\.state_dict\(\)\['f'\] = .* cannot be saved"),
    (PerRank(DataParallel), r"state\['bad'\]: checkpoint\.PerRank"),
], ids=["object", "no_load_state_dict", "unsavable_value", "per_rank_class"])
def test_a_bad_provider_is_refused_on_every_rank_before_anything_is_written(comm, tmp_path, bad,
                                                                         match):
    directory = shared_dir(comm, tmp_path)
    params = initial_params()
    dp = DataParallel(params, comm=comm)
    with raises_everywhere(TypeError, match=match):
        checkpoint.save(directory, {"model": dp, "bad": bad}, comm=comm)
    assert_all(not os.path.exists(directory) or os.listdir(directory) == [],
               str(os.path.exists(directory) and os.listdir(directory)))
    if not isinstance(bad, Unsavable):  # the same kind on every rank: a load refuses it too
        with raises_everywhere(TypeError, match=match):
            checkpoint.load(directory, {"model": dp, "bad": bad}, comm=comm)


@pytest.mark.mpi(min_size=2)
def test_a_bad_provider_on_one_rank_is_refused_on_every_rank(comm, tmp_path):
    directory = shared_dir(comm, tmp_path)
    dp = DataParallel(initial_params(), comm=comm)
    bad = object() if comm.rank == comm.size - 1 else Schedule()
    with raises_everywhere(TypeError, match="not a state provider|failed on rank"):
        checkpoint.save(directory, {"model": dp, "schedule": bad}, comm=comm)
    assert_all(not os.path.exists(directory) or os.listdir(directory) == [])


@pytest.mark.mpi(min_size=2)
def test_a_mapping_on_some_ranks_and_arrays_on_others_is_refused_on_every_rank(comm, tmp_path):
    directory = shared_dir(comm, tmp_path)
    params = initial_params()
    dp = DataParallel(params, comm=comm)
    state = {"model": dp} if comm.rank == 0 else params
    for call in (checkpoint.save, checkpoint.load):
        with raises_everywhere(ValueError, match=r"a mapping of objects on rank\(s\) \[0\] "
                                                 r"and arrays on the others"):
            call(directory, state, comm=comm)
    assert_all(not os.path.exists(directory) or os.listdir(directory) == [])


@pytest.mark.mpi
def test_a_load_of_state_the_checkpoint_lacks_is_refused_and_loads_nothing(comm, tmp_path):
    directory = shared_dir(comm, tmp_path)
    params = initial_params()
    dp = DataParallel(params, comm=comm)
    checkpoint.save(directory, {"model": dp, "schedule": Schedule()}, comm=comm)
    mine = [np.full_like(p, 9.0) for p in params]
    dp2 = DataParallel(mine, comm=comm)
    sampler = Sampler(SAMPLES, comm.rank, comm.size, batch_size=BATCH)
    with raises_everywhere(ValueError, match=r"holds no state for 'sampler'.*model.*schedule"):
        checkpoint.load(directory, {"model": dp2, "sampler": sampler}, comm=comm)
    with raises_everywhere(ValueError,
                           match=r"state\['schedule'\] was saved from a provider, given a Sampler"):
        checkpoint.load(directory, {"model": dp2, "schedule": sampler}, comm=comm)
    assert_all(all((p == 9.0).all() for p in mine), "a refused load modified the parameters")
    resumed = checkpoint.load(directory, {"schedule": Schedule()}, comm=comm)  # a part only
    assert_all(resumed is not None and all((p == 9.0).all() for p in mine))


class FailsOnLoad(Schedule):
    def load_state_dict(self, state):
        if MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1:
            raise RuntimeError("this provider cannot take it")
        super().load_state_dict(state)


@pytest.mark.mpi
def test_a_provider_that_fails_to_load_on_one_rank_raises_on_every_rank(comm, tmp_path):
    directory = shared_dir(comm, tmp_path)
    checkpoint.save(directory, {"schedule": Schedule()}, comm=comm)
    with raises_everywhere(RuntimeError, match="this provider cannot take it|failed on rank"):
        checkpoint.load(directory, {"schedule": FailsOnLoad()}, comm=comm)


def test_the_provider_form_takes_none_of_the_array_form_s_keywords(tmp_path):
    with pytest.raises(TypeError, match=r"the provider form .* takes no optimizer="):
        checkpoint.save(str(tmp_path), {"schedule": Schedule()}, optimizer=object())
    assert os.listdir(tmp_path) == []


@pytest.mark.mpi
def test_a_torch_model_optimizer_and_scheduler_resume_as_serial_torch(comm, tmp_path):
    """DataParallel over a torch model, torch.optim.SGD (momentum) and StepLR as providers:
    stopped after epoch 1, saved in one call, resumed by fresh objects; against serial torch
    on the same sample ids (the mean over the ranks of each rank's batch mean)."""
    torch = pytest.importorskip("torch")
    directory = shared_dir(comm, tmp_path)
    x, y = (torch.from_numpy(a) for a in make_problem())

    def objects():
        torch.manual_seed(0)
        model = torch.nn.Linear(x.shape[1], y.shape[1], dtype=torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

        def update():
            opt.step()
            sched.step()
        dp = DataParallel(model.parameters(), comm=comm, update=update)
        sampler = Sampler(SAMPLES, comm.rank, comm.size, batch_size=BATCH, seed=SEED,
                          skew=SKEW)
        return model, {"model": dp, "optimizer": opt, "scheduler": sched, "sampler": sampler}

    def epochs(model, state, first, last):
        dp, sampler = state["model"], state["sampler"]
        for e in range(first, last + 1):
            sampler.set_epoch(e)
            with Join([dp]):
                for idx in sampler:
                    model.zero_grad()
                    with dp.step():
                        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()

    model, state = objects()
    epochs(model, state, 1, 1)
    checkpoint.save(directory, state, comm=comm)
    model, state = objects()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)  # the load must overwrite
    checkpoint.load(directory, state, comm=comm)
    epochs(model, state, 1, 2)  # epoch 1 is complete: its cursor says so

    torch.manual_seed(0)
    serial = torch.nn.Linear(x.shape[1], y.shape[1], dtype=torch.float64)
    opt = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for e in (1, 2):
        batches = reference_batches(comm.size, e)
        for s in range(max(len(b) for b in batches)):
            serial.zero_grad()
            for r in [r for r in range(comm.size) if s < len(batches[r])]:
                ids = torch.from_numpy(batches[r][s])
                torch.nn.functional.mse_loss(serial(x[ids]), y[ids]).backward()
            with torch.no_grad():
                for p in serial.parameters():
                    p.grad /= comm.size
            opt.step()
            sched.step()
    ok = all(torch.allclose(a, b, rtol=1e-12, atol=1e-14)
             for a, b in zip(model.parameters(), serial.parameters()))
    assert_all(ok and sched.last_epoch == state["scheduler"].last_epoch,
               "the resumed torch run left serial torch")


@pytest.mark.mpi
def test_either_form_reads_the_other_s_checkpoint(comm, tmp_path):
    """An array-form checkpoint (extras written by torch_state and sampler.state()) loads into
    providers, and a provider-form one into arrays: the same format."""
    from tensorplay_mpi.checkpoint import _torch_state as torch_state

    directory = shared_dir(comm, tmp_path)
    objects = run(comm, "adam")
    params, dp, opt, sampler, _, schedule = objects
    train(comm, objects, [], stop=True)
    schedule.end_epoch(0.5)
    expected = ([p.copy() for p in params], opt.state_dict(), sampler.cursor, dp.steps)

    def same(params2, opt2, sampler2, schedule2):
        state = opt2.state_dict()["state"]
        return (all(a.tobytes() == b.tobytes() for a, b in zip(params2, expected[0]))
                and all(state[i][k].tobytes() == expected[1]["state"][i][k].tobytes()
                        for i in state for k in state[i])
                and sampler2.cursor == expected[2] and sampler2.epoch == 1
                and schedule2.state_dict()["name"] == "after epoch 1")

    checkpoint.save(f"{directory}/arrays", params, optimizer=opt, step=dp.steps,
                    epoch=sampler.epoch, cursor=sampler.cursor, comm=comm,
                    extra={"sampler": sampler.state(),
                           **torch_state.state_arrays(schedule, "schedule")})
    params2, dp2, opt2, sampler2, _, schedule2 = run(comm, "adam", 5.0)
    resumed = checkpoint.load(f"{directory}/arrays", {"model": dp2, "optimizer": opt2,
                                                      "sampler": sampler2,
                                                      "schedule": schedule2}, comm=comm)
    ok = same(params2, opt2, sampler2, schedule2) and dp2.steps == expected[3]
    ok = ok and sorted(resumed.extra) == []

    checkpoint.save(f"{directory}/providers", {"model": dp, "optimizer": opt,
                                               "sampler": sampler, "schedule": schedule,
                                               "totals": np.arange(3.0)}, comm=comm)
    params3, _, opt3, sampler3, _, schedule3 = run(comm, "adam", 5.0)
    resumed = checkpoint.load(f"{directory}/providers", params3, optimizer=opt3, comm=comm)
    sampler3.resume(resumed.epoch, resumed.cursors, resumed.extra["sampler"])
    torch_state.load_state_arrays(schedule3, resumed.extra, "schedule")
    ok = ok and same(params3, opt3, sampler3, schedule3) and resumed.step == expected[3]
    ok = ok and resumed.extra["totals"].tolist() == [0.0, 1.0, 2.0]
    assert_all(ok, "a checkpoint of one form did not load through the other")
