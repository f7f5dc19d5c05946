"""data.Sampler: without MPI, the demo's order at one world size, and every sample of an epoch
exactly once across resumes at other world sizes (the ranks simulated); under mpiexec, as a
torch DataLoader's ``batch_sampler`` with worker processes (which take batches from the sampler
ahead of the loop): a run stopped after some batches, saved and resumed, at the same world size
or another, uses every sample of the epoch exactly once (the sample ids the loop saw, gathered,
against the data set's own ids)."""

import collections

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join, checkpoint, clear_stop, request_stop
from tensorplay_mpi.data import Sampler, batches, shard
from tensorplay_mpi.testing import assert_all

N, BATCH = 101, 4


def samplers(size, **kwargs):
    return [Sampler(N, r, size, batch_size=BATCH, seed=3, skew=1.0, **kwargs)
            for r in range(size)]


def consume(ranks, counts, used):
    """Rank r consumes counts[r] batches (or all when None), logging the sample ids."""
    for sampler, count in zip(ranks, counts):
        for k, batch in enumerate(sampler):
            if count is not None and k == count:
                break  # the loop's break: this batch is not consumed
            used.extend(batch.tolist())


def test_the_order_at_one_world_size_is_the_shards_permuted_per_epoch_and_rank():
    for sampler in samplers(3):
        sampler.set_epoch(2)
        rng = np.random.default_rng([3, 2, sampler.rank])
        expected = batches(shard(N, sampler.rank, 3, 1.0), BATCH, rng)
        assert [b.tolist() for b in sampler.batches()] == [b.tolist() for b in expected]


@pytest.mark.parametrize("sizes", [(2, 3), (3, 2), (4, 2), (1, 4), (3, 2, 4), (4, 4)])
def test_every_sample_of_an_interrupted_epoch_is_used_exactly_once(sizes):
    used = []
    ranks = samplers(sizes[0])
    for size in sizes[1:]:
        for s in ranks:
            s.set_epoch(2)
        consume(ranks, [s.rank % 3 + 1 for s in ranks], used)  # uneven cursors
        cursors, state = [s.cursor for s in ranks], ranks[0].state()
        ranks = samplers(size)
        for s in ranks:
            s.resume(2, cursors, state)
    consume(ranks, [None] * len(ranks), used)
    assert sorted(used) == list(range(N)), collections.Counter(used).most_common(3)
    for s in ranks:  # the next epoch: the new world size's own split
        s.set_epoch(3)
        fresh = Sampler(N, s.rank, s.size, batch_size=BATCH, seed=3, skew=1.0)
        fresh.set_epoch(3)
        assert s.cursor == 0
        assert [b.tolist() for b in s.batches()] == [b.tolist() for b in fresh.batches()]


def test_a_resume_at_the_same_size_goes_on_with_each_rank_s_own_shard():
    ranks = samplers(3)
    expected = [s.batches() for s in ranks]
    consume(ranks, [1, 2, 0], [])
    cursors, state = [s.cursor for s in ranks], ranks[0].state()
    for s, mine in zip(samplers(3), expected):
        s.resume(1, cursors, state)
        assert s.cursor == cursors[s.rank]
        assert [b.tolist() for b in s] == [b.tolist() for b in mine[cursors[s.rank]:]]


def test_data_that_cannot_be_re_split_is_refused_with_the_reason():
    ranks = samplers(3)
    consume(ranks, [1, 1, 1], [])
    cursors, state = [s.cursor for s in ranks], ranks[0].state()
    with pytest.raises(ValueError, match="batches of 4, this one 101 in batches of 8"):
        Sampler(N, 0, 2, batch_size=8).resume(1, cursors, state)
    with pytest.raises(ValueError, match="holds no sampler state .* 3 ranks' cursors cannot be "
                                         "re-split over 2 ranks"):
        Sampler(N, 0, 2, batch_size=BATCH).resume(1, cursors, None)
    with pytest.raises(ValueError, match="cursor 99 is beyond"):
        samplers(2)[0].resume(1, [99, 1, 1], state)
    with pytest.raises(ValueError, match="of epoch 1 at 3 ranks, the checkpoint's cursors of "
                                         "epoch 2"):
        samplers(2)[0].resume(2, cursors, state)


@pytest.mark.parametrize("bad", [{"num_samples": 10.5}, {"batch_size": 1.5},
                                 {"batch_size": "2"}, {"rank": 0.0}, {"size": True},
                                 {"seed": 1.5}])
def test_arguments_that_are_not_ints_are_a_type_error(bad):
    """Before: 10.5 samples gave batches of ids 0..9, a float batch size a bare range() error."""
    args = {"num_samples": N, "rank": 0, "size": 2, "batch_size": BATCH} | bad
    name = next(iter(bad))
    with pytest.raises(TypeError, match=f"Sampler: {name} must be an int"):
        Sampler(args.pop("num_samples"), args.pop("rank"), args.pop("size"), **args)
    Sampler(np.int64(N), np.int32(0), np.int64(2), batch_size=np.int64(BATCH))  # NumPy ints


def weights_of(size):
    """Per-site shares: explicit sizes at 3 ranks (40/35/26 of 101), proportions elsewhere."""
    return {3: [40, 35, 26], 2: [0.6, 0.4], 4: [1, 2, 3, 4]}.get(size, [1.0] * size)


def weighted(size):
    return [Sampler(N, r, size, batch_size=BATCH, seed=3, weights=weights_of(size))
            for r in range(size)]


def test_explicit_sizes_are_the_shards_and_weights_split_proportionally():
    assert [sum(map(len, s.batches())) for s in weighted(3)] == [40, 35, 26]
    assert [sum(map(len, s.batches())) for s in weighted(2)] == [61, 40]  # 0.6 and 0.4 of 101
    with pytest.raises(ValueError, match="3 finite numbers >= 0"):
        Sampler(N, 0, 3, batch_size=BATCH, weights=[1, 2])
    with pytest.raises(ValueError, match="skew or weights"):
        Sampler(N, 0, 2, batch_size=BATCH, skew=1.0, weights=[1, 1])


@pytest.mark.parametrize("sizes", [(3, 2), (2, 4, 3), (3, 3), (4, 1, 2), (3, 2, 3)])
@pytest.mark.parametrize("change", [False, True])
def test_weighted_shards_keep_every_sample_exactly_once_across_resizes(sizes, change):
    """`change`: the resumed sampler brings other weights for its world size."""
    used = []
    ranks = weighted(sizes[0])
    for size in sizes[1:]:
        for s in ranks:
            s.set_epoch(2)
        consume(ranks, [s.rank % 3 + 1 for s in ranks], used)
        cursors, state = [s.cursor for s in ranks], ranks[0].state()
        ranks = weighted(size)
        if change:
            ranks = [Sampler(N, r, size, batch_size=BATCH, seed=3,
                             weights=list(range(1, size + 1))) for r in range(size)]
        for s in ranks:
            s.resume(2, cursors, state)
    consume(ranks, [None] * len(ranks), used)
    assert sorted(used) == list(range(N)), collections.Counter(used).most_common(3)


def lockstep(ranks, steps, used):
    """`steps` steps of a Join: each rank with batches left consumes one per step."""
    iterators = [iter(s) for s in ranks]
    for _ in range(steps):
        for it in iterators:
            batch = next(it, None)
            if batch is not None:
                used.extend(batch.tolist())


@pytest.mark.parametrize("lost, steps", [([1], 3), ([0], 5), ([2], 0), ([0, 2], 4),
                                         ([1], 100)])
def test_a_shrink_re_splits_what_no_rank_consumed_each_sample_once(lost, steps):
    used = []
    ranks = samplers(3)
    lockstep(ranks, steps, used)
    gone_ids = []
    for s in ranks:
        if s.rank not in lost:
            gone_ids = s.shrink(lost, steps).tolist()
    survivors = [s for s in ranks if s.size == 3 - len(lost)]
    assert [s.rank for s in survivors] == list(range(3 - len(lost)))
    # the lost ranks' consumed samples are what they took in those steps
    lost_used = [i for s in samplers(3) if s.rank in lost
                 for b in s.batches()[:steps] for i in b.tolist()]
    assert sorted(gone_ids) == sorted(lost_used)
    survivors_used = [i for i in used if i not in set(lost_used)]
    consume(survivors, [None] * len(survivors), survivors_used)
    assert sorted(survivors_used + lost_used) == list(range(N))


def test_two_shrinks_and_a_checkpoint_state_between_them_keep_each_sample_once():
    used = []
    ranks = samplers(4)
    lockstep(ranks, 2, used)
    lost_first = [i for b in samplers(4)[3].batches()[:2] for i in b.tolist()]
    ranks = [s for s in ranks[:3]]
    for s in ranks:
        s.shrink([3], 2)
    lockstep(ranks, 3, used)
    state, cursors = ranks[0].state(), [s.cursor for s in ranks]
    lost_second = [i for b in ranks[1].batches()[:3] for i in b.tolist()]
    for s in (ranks[0], ranks[2]):
        s.shrink([1], 3)
    used = [i for i in used if i not in set(lost_first) | set(lost_second)]
    consume([ranks[0], ranks[2]], [None, None], used)
    assert sorted(used + lost_first + lost_second) == list(range(N))
    resumed = [Sampler(N, r, 3, batch_size=BATCH, seed=3, skew=1.0) for r in range(3)]
    for s in resumed:  # the state written between the shrinks resumes at the same size
        s.resume(1, cursors, state)
    assert [s.cursor for s in resumed] == cursors


@pytest.mark.parametrize("lost, steps, places", [([1], 3, [1]), ([0], 5, [0]),
                                                 ([0, 2], 4, [0, 2]), ([0, 2], 4, [0])])
def test_spares_admitted_after_a_shrink_take_the_unused_samples_each_once(lost, steps,
                                                                            places):
    used = []
    ranks = samplers(3)
    lockstep(ranks, steps, used)
    lost_used = [i for s in samplers(3) if s.rank in lost
                 for b in s.batches()[:steps] for i in b.tolist()]
    survivors = [s for s in ranks if s.rank not in lost]
    for s in survivors:
        s.shrink(lost, steps)
    state = survivors[0].state()
    width = len(survivors) + len(places)  # places: of the 3, those the spares take
    held = sorted(set(range(3)) - set(lost)) + sorted(places)
    new_rank = {old: i for i, old in enumerate(sorted(held))}
    spares = [Sampler(N, 0, 1, batch_size=BATCH, seed=3, skew=1.0) for _ in places]
    for s, old in zip(survivors, sorted(set(range(3)) - set(lost))):
        s.admit(new_rank[old], width, state)
    for s, place in zip(spares, sorted(places)):
        s.admit(new_rank[place], width, state)
    everyone = sorted(survivors + spares, key=lambda s: s.rank)
    assert [(s.rank, s.size) for s in everyone] == [(r, width) for r in range(width)]
    used = [i for i in used if i not in set(lost_used)]
    consume(everyone, [None] * width, used)
    assert sorted(used + lost_used) == list(range(N))
    assert all(s.batches() for s in spares)  # the spares got a share


def test_admit_refuses_a_begun_split_weights_and_a_bad_rank():
    ranks = samplers(3)
    lockstep(ranks, 2, [])
    state = ranks[0].state()
    with pytest.raises(ValueError, match="has begun"):
        ranks[0].admit(0, 4, state)
    with pytest.raises(ValueError, match="0 <= rank < size"):
        Sampler(N, 0, 1, batch_size=BATCH).admit(4, 4, state)
    weighted = Sampler(N, 0, 2, batch_size=BATCH, weights=[1, 2])
    with pytest.raises(ValueError, match="weights"):
        weighted.admit(0, 3, weighted.state())


@pytest.mark.parametrize("lost, steps, match", [([], 1, "lost must name"),
                                                ([3], 1, "lost must name"),
                                                ([0], 1, "other than this rank"),
                                                ([1], -1, "steps must be"),
                                                ([1.7], 1, "must be ranks"),
                                                (["1"], 1, "must be ranks"),
                                                ([1], 1.5, "steps must be")])
def test_a_bad_shrink_is_a_value_error(lost, steps, match):
    with pytest.raises(ValueError, match=match):
        samplers(3)[0].shrink(lost, steps)


def test_a_shrink_after_the_split_is_done_leaves_nothing_and_names_the_lost_samples():
    ranks = samplers(3)
    for s in ranks:
        list(s)
    gone = ranks[0].shrink([1])
    ranks[2].shrink([1])
    assert sorted(gone.tolist()) == sorted(i for b in samplers(3)[1].batches()
                                           for i in b.tolist())
    assert list(ranks[0]) == [] and list(ranks[2]) == []
    assert (ranks[2].rank, ranks[2].size) == (1, 2)


def id_loader(sampler, **kwargs):
    """A torch DataLoader whose sample ``i`` is ``i``, over `sampler` as its batch_sampler."""
    torch = pytest.importorskip("torch")
    ids = torch.utils.data.TensorDataset(torch.arange(N))
    return torch.utils.data.DataLoader(ids, batch_sampler=sampler,
                                       collate_fn=lambda rows: [int(r[0]) for r in rows],
                                       **kwargs)


LOADERS = {"main-process": {}, "2-workers": {"num_workers": 2},
           "2-persistent-workers": {"num_workers": 2, "persistent_workers": True,
                                    "prefetch_factor": 3}}


@pytest.mark.parametrize("kwargs", LOADERS.values(), ids=LOADERS)
def test_a_dataloader_s_cursor_counts_what_the_loop_consumed_and_resumes_each_sample_once(
        kwargs):
    """Before: with 2 workers the cursor was 6 (the batches the workers took) after the loop
    consumed 3, so the resume skipped samples. Three ranks (simulated) stop after 1, 2 and 3
    batches, go on through the same loader, stop again, and resume at 2 ranks."""
    used = []
    ranks = samplers(3)
    loaders = [id_loader(s, **kwargs) for s in ranks]
    for stops in ([1, 2, 3], [2, 0, 1]):  # the second goes on through the same loaders
        for sampler, loader, count in zip(ranks, loaders, stops):
            before = sampler.cursor
            for k, batch in enumerate(sampler.track(loader)):
                if k == count:
                    break
                used.extend(batch)
            assert sampler.cursor == before + count
    cursors, state = [s.cursor for s in ranks], ranks[0].state()
    assert cursors == [3, 2, 4]
    resumed = samplers(2)
    for sampler in resumed:
        sampler.resume(1, cursors, state)
        used.extend(i for batch in sampler.track(id_loader(sampler, **kwargs)) for i in batch)
    assert sorted(used) == list(range(N)), collections.Counter(used).most_common(3)


@pytest.mark.parametrize("kwargs", LOADERS.values(), ids=LOADERS)
def test_a_dataloader_iterating_the_sampler_outside_track_is_refused(kwargs):
    """Before: the loader ran, and its cursor counted the batches its workers took."""
    sampler = samplers(2)[0]
    with pytest.raises(RuntimeError, match=r"outside sampler.track\(loader\).*would skip"):
        next(iter(id_loader(sampler, **kwargs)))
    assert sampler.cursor == 0  # and the sampler itself still iterates
    assert [b.tolist() for b in sampler] == [b.tolist() for b in samplers(2)[0].batches()]


def test_track_refuses_a_loader_that_is_not_this_sampler_s():
    sampler, other = samplers(2)
    with pytest.raises(TypeError, match="expected a torch DataLoader .* got list"):
        sampler.track([[1, 2]])
    with pytest.raises(ValueError, match="batch_sampler is another Sampler, not this sampler"):
        sampler.track(id_loader(other))
    with pytest.raises(ValueError, match="in_order=False"):
        sampler.track(id_loader(sampler, num_workers=2, in_order=False))


def test_len_is_the_batches_left_and_a_loader_built_on_the_sampler_has_it():
    """len(loader) (tqdm, OneCycleLR(total_steps=len(loader))) is this rank's batches from the
    cursor on: what a loop over the tracked loader yields."""
    sampler = samplers(3)[1]
    loader = id_loader(sampler)
    before = len(loader)
    assert before == len(list(sampler.batches())) > 1
    for k, _ in enumerate(sampler.track(loader)):
        if k == 1:
            break
    assert len(loader) == len(sampler) == before - 1 == len(list(sampler.track(loader)))


def test_two_tracks_of_one_sampler_at_once_are_refused():
    """Each would count the same cursor (it reached 21 for 11 batches)."""
    sampler = samplers(2)[0]
    first = sampler.track(id_loader(sampler))
    next(first)
    with pytest.raises(RuntimeError, match="another track"):
        next(sampler.track(id_loader(sampler)))
    first.close()
    assert len(list(sampler.track(id_loader(sampler)))) == len(sampler.batches())  # uncounted


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------

SAMPLES, LOADER_BATCH, SKEW = 53, 3, 1.0


class Ids:
    """Sample ``i`` is its own id: what a batch holds is what the loop consumed (a map-style data
    set as torch's DataLoader takes it, without torch at import; collated into a tensor)."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return i


def loader(sampler):
    """The DataLoader recipe of docs/stopping.md: two workers, pinned memory where there is an
    accelerator to pin it for."""
    torch = pytest.importorskip("torch")
    return torch.utils.data.DataLoader(Ids(), batch_sampler=sampler, num_workers=2,
                                       pin_memory=torch.cuda.is_available())


def epoch(comm, sampler, used, stop_at=None):
    """The epoch from the sampler's cursor on; the last rank asks to stop at its iteration
    `stop_at` (every rank then leaves at one iteration, the batch in hand unconsumed)."""
    params = [np.zeros(1)]
    dp = DataParallel(params, comm=comm)
    with Join([dp]) as join:
        for i, batch in enumerate(sampler.track(loader(sampler))):
            if join.stopped:
                break
            if i == stop_at and comm.rank == comm.size - 1:
                request_stop("test")
            with dp.step():
                dp.grads[0][...] = float(batch.sum())
            used.extend((sampler.epoch, int(s)) for s in batch)
    clear_stop()
    return join.stopped


def sub_comm(comm, size):
    return comm.Split(0 if comm.rank < size else MPI.UNDEFINED, comm.rank)


@pytest.mark.mpi
@pytest.mark.parametrize("stop_at", [1, 3])
@pytest.mark.parametrize("fewer", [0, 1], ids=["same-size", "one-rank-fewer"])
def test_a_dataloader_with_workers_stopped_saved_and_resumed_uses_each_sample_once(
        comm, tmp_path, stop_at, fewer):
    """Before: the cursor counted the batches the workers had taken (6 after 3 consumed), so
    the resumed run skipped the batches prefetched but never consumed."""
    pytest.importorskip("torch")
    if fewer >= comm.size:
        pytest.skip("needs 2 ranks")
    directory = comm.bcast(str(tmp_path))
    used = []
    sampler = Sampler(SAMPLES, comm.rank, comm.size, batch_size=LOADER_BATCH, seed=5, skew=SKEW)
    stopped = epoch(comm, sampler, used, stop_at=stop_at)
    checkpoint.save(directory, [np.zeros(1)], epoch=1, cursor=sampler.cursor,
                    extra={"sampler": sampler.state()}, comm=comm)
    assert_all(stopped, "the run did not stop")

    sub = sub_comm(comm, comm.size - fewer)
    if sub != MPI.COMM_NULL:
        resumed = checkpoint.load(directory, [np.zeros(1)], comm=sub, resize=bool(fewer))
        sampler = Sampler(SAMPLES, sub.rank, sub.size, batch_size=LOADER_BATCH, seed=5, skew=SKEW)
        sampler.resume(resumed.epoch, resumed.cursors, resumed.extra["sampler"])
        epoch(sub, sampler, used)
        sampler.set_epoch(2)  # a whole epoch through the loader: each sample once too
        epoch(sub, sampler, used)
        sub.Free()
    every = collections.Counter(u for ids in comm.allgather(used) for u in ids)
    for e in (1, 2):
        counts = [every[(e, s)] for s in range(SAMPLES)]
        assert_all(counts == [1] * SAMPLES,
                   f"epoch {e}: sample ids used {dict(collections.Counter(counts))} times "
                   f"(0: skipped), missing {[s for s in range(SAMPLES) if not every[(e, s)]]}")
