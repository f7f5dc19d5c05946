"""torch CUDA tensors: on one rank through the CPU stand-in (views, streams, refusals); then
through the device path under mpiexec, against serial torch on the same device.

Each test under mpiexec runs on three placements: a CPU stand-in for CUDA tensors
(``fake_device.fake_cuda``: the library sees CUDA tensors, their CuPy views are fake device
arrays over the same memory), CUDA-aware and staged, in every CI run; and a real GPU (``cuda``,
``make gpu-check``), skipped without one.  float64 throughout: the distributed run equals the
serial one to 1e-12.
"""

import sys

import numpy as np
import pytest
from fake_device import (Counters, FakeCuda, FakeDeviceArray, TorchCounters, fake_cuda,
                         is_on_device, use_torch_cuda_standin)
from helpers import gathered_equal
from mpi4py import MPI

from tensorplay_mpi import (Adam, DataParallel, Join, JoinableComm, ZeroRedundancyOptimizer,
                            checkpoint)
from tensorplay_mpi.comm import iallreduce, _torch_cuda as torch_cuda
from tensorplay_mpi.comm._tensors import as_array, host_array, like
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere, reset_settings

torch = pytest.importorskip("torch")

from torch_reference import (Branchy, adamw_onecycle_clip, arrays, close, loss_of,  # noqa: E402
                             same_everywhere, serial)

from tensorplay_mpi.checkpoint import _torch_state as torch_state  # noqa: E402
from tensorplay_mpi.evaluation._sync_batchnorm import SyncBatchNorm  # noqa: E402


@pytest.fixture
def standin(monkeypatch):
    use_torch_cuda_standin(monkeypatch, aware=False)


def test_a_cuda_parameter_is_viewed_on_the_device_without_a_copy_and_wrapped_back(standin):
    p = fake_cuda(torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)))
    view = as_array(p)
    view[1] = 5.0
    assert type(view) is FakeDeviceArray and p[1].item() == 5.0  # a device array, shared
    back = like(p, view)
    assert isinstance(back, FakeCuda) and back.data_ptr() == p.data_ptr()
    assert torch_cuda.in_use()


def test_a_cuda_tensor_on_the_host_is_a_numpy_array(standin):
    host = host_array(fake_cuda(torch.arange(4, dtype=torch.float64)))
    assert type(host) is np.ndarray and host.tolist() == [0, 1, 2, 3]


def test_torch_stream_is_synchronised_before_mpi_and_waited_for_after_a_staged_copy(standin):
    x = fake_cuda(torch.ones(4, dtype=torch.float64))
    work = iallreduce(MPI.COMM_WORLD, x, x)
    synced_at_start = TorchCounters.stream_syncs
    work.wait()
    assert synced_at_start == 1, "torch's stream was not synchronised before MPI read the buffer"
    assert (Counters.d2h, Counters.h2d) == (1, 1), "staged: one copy each way"
    assert TorchCounters.hand_backs >= 1, "torch's stream does not wait for the copy back"
    assert x.tolist() == [1.0] * 4


def test_without_torch_cuda_tensors_torch_streams_are_left_alone(standin):
    x = np.ones(4)
    iallreduce(MPI.COMM_WORLD, x, x).wait()
    assert (TorchCounters.stream_syncs, TorchCounters.hand_backs) == (0, 0)
    assert not torch_cuda.in_use()


def test_a_cuda_tensor_without_cupy_names_the_package_to_install(monkeypatch):
    monkeypatch.setattr(torch_cuda, "_on_cuda", lambda tensor: isinstance(tensor, FakeCuda))
    monkeypatch.setitem(sys.modules, "cupy", None)  # the real view's `import cupy` fails
    with pytest.raises(TypeError, match=r"params\[0\] is a torch tensor on .*install the CuPy "
                                        r"wheel of your CUDA version"):
        as_array(fake_cuda(torch.zeros(2)), "params[0]")


def test_a_cuda_tensor_of_a_dtype_without_a_view_is_a_type_error(standin):
    with pytest.raises(TypeError, match="dtype torch.bfloat16 .* has no CuPy view"):
        as_array(fake_cuda(torch.zeros(2, dtype=torch.bfloat16)), "x")


def test_a_tensor_on_another_device_kind_is_refused():
    with pytest.raises(TypeError, match="on the CPU and on CUDA devices"):
        as_array(torch.zeros(2, device="meta"))


def test_handed_hands_torch_its_stream_back_when_the_block_raises(standin):
    as_array(fake_cuda(torch.zeros(2, dtype=torch.float64)))  # torch CUDA in use
    TorchCounters.reset()
    with pytest.raises(ZeroDivisionError, match="a bug between the two"):
        with torch_cuda.handed():
            raise ZeroDivisionError("a bug between the two")
    assert (TorchCounters.takes, TorchCounters.hand_backs) == (1, 1)


def test_an_optimizer_step_that_raises_still_hands_torch_its_stream_back(standin):
    """An update that fails after its take (a schedule's bug) leaves torch's stream ordered
    after the library's kernels, as a completed one does."""
    from tensorplay_mpi.optim import SGD

    param = fake_cuda(torch.zeros(3, dtype=torch.float64))
    opt = SGD([param], [fake_cuda(torch.ones(3, dtype=torch.float64))],
              lr=lambda step: 0.1 if step == 1 else 1 / 0)
    opt.step()
    TorchCounters.reset()
    with pytest.raises(ZeroDivisionError):
        opt.step()
    assert TorchCounters.takes >= 1 and TorchCounters.hand_backs == TorchCounters.takes


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------


def _has_cuda():
    try:
        import cupy  # noqa: F401  (the device path's arrays)
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _has_cuda()
PLACES = ["stand-in, CUDA-aware", "stand-in, staged",
          pytest.param("cuda", marks=[pytest.mark.gpu,
                                      pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")])]
STEPS = 6


@pytest.fixture(params=PLACES)
def place(request, monkeypatch, comm):
    """Moves a model or a tensor to the device under test; the stand-in counts torch's
    stream synchronisations and hand-backs."""
    if request.param == "cuda":
        torch.cuda.set_device(comm.rank % torch.cuda.device_count())
        monkeypatch.setenv("TENSORPLAY_MPI_CUDA_AWARE", "auto")
        reset_settings()
        return lambda x: x.to("cuda")
    use_torch_cuda_standin(monkeypatch, aware=request.param.endswith("aware"))
    return fake_cuda


def stand_in_used(place):
    return place is fake_cuda


def optimizer_state(opt):
    """torch optimizer `opt`'s state tensors, on the host, in parameter order."""
    return [t.detach().cpu().numpy() for s in opt.state.values() for t in s.values()]


def sometimes(rank, t):
    return (rank + t) % 3 != 0  # the side branch unused by some ranks at some steps


def micro(rank, t):
    return 1 + (rank + t) % 2


def freeze_bias(model):
    model.first.bias.requires_grad_(False)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pattern", ["three_plus_rank", "rank0_zero"])
def test_torch_training_through_update_equals_serial_torch_on_the_device(comm, place, pattern):
    """AdamW, OneCycleLR and clipping through update=, micro-batches, a frozen and an unused
    parameter, uneven inputs: as serial torch on the same device, the same on every rank."""
    inputs = [min(STEPS, n) for n in inputs_of(pattern, comm.size)]
    model = place(Branchy())
    freeze_bias(model)
    update, opt, _ = adamw_onecycle_clip(model, STEPS)
    dp = DataParallel(model.parameters(), comm=comm, bucket_cap_mb=1e-4, update=update)
    with Join([dp]):
        for t in range(inputs[comm.rank]):
            model.zero_grad()
            k = micro(comm.rank, t)
            with dp.step(micro_batches=k):
                for m in range(k):
                    loss_of(model, comm.rank, t, m, sometimes, place).backward()
    reference = {}

    def serial_update(m):
        update, reference["opt"], _ = adamw_onecycle_clip(m, STEPS)
        return update
    expected = serial(serial_update, inputs, sometimes, micro, prepare=freeze_bias, place=place)
    got = arrays(model)
    state = optimizer_state(opt)
    assert_all(all(is_on_device(p) for p in model.parameters()), "a parameter moved")
    assert_all(all(is_on_device(g) for g in dp.grads), "dp.grads left the device")
    assert_all(same_everywhere(got + state, comm), "parameters or AdamW state differ")
    assert_all(not close(got, arrays(expected)), close(got, arrays(expected)))
    assert_all(not close(state, optimizer_state(reference["opt"])),
               f"AdamW state off serial torch's: {close(state, optimizer_state(reference['opt']))}")
    if stand_in_used(place) and max(inputs):
        assert_all(TorchCounters.stream_syncs > 0 and TorchCounters.hand_backs > 0,
                   f"torch's stream: {TorchCounters.stream_syncs} syncs, "
                   f"{TorchCounters.hand_backs} hand-backs")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("zero", [False, True])
def test_library_optimizers_on_device_tensors_equal_serial_torch_adam(comm, place, zero):
    """The library's Adam (fused kernels on a GPU) and ZeroRedundancyOptimizer over torch
    CUDA parameters, in the Join: as serial torch.optim.Adam over the global batches."""
    inputs = inputs_of("three_plus_rank", comm.size)
    model = place(Branchy())
    params = list(model.parameters())
    dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-4)
    opt = (ZeroRedundancyOptimizer(params, dp.grads, Adam, comm=comm, lr=0.01) if zero
           else Adam(params, dp.grads, lr=0.01))
    with Join([dp, opt]):
        for t in range(inputs[comm.rank]):
            model.zero_grad()
            with dp.step():
                loss_of(model, comm.rank, t, place=place).backward()
            opt.step()
    expected = arrays(serial(lambda m: torch.optim.Adam(m.parameters(), lr=0.01).step, inputs,
                             place=place))
    got = arrays(model)
    assert_all(gathered_equal(got, comm), "parameters differ across ranks")
    assert_all(not close(got, expected), close(got, expected))
    if stand_in_used(place) and max(inputs):  # each update after torch's writes, and before
        assert_all(TorchCounters.takes > 0 and TorchCounters.hand_backs > 0,  # torch's next
                   f"{TorchCounters.takes} takes, {TorchCounters.hand_backs} hand-backs")


@pytest.mark.mpi(min_size=1)
def test_joinable_comm_hands_back_device_tensors(comm, place):
    """An allreduce of a CUDA tensor with a joined rank: a CUDA tensor back, and out= in place."""
    inputs = inputs_of("three_plus_rank", comm.size)
    jc = JoinableComm(comm)
    right = True
    with Join([jc]):
        for t in range(inputs[comm.rank]):
            jc.begin_iteration()
            x = place(torch.full((5,), float(comm.rank + t), dtype=torch.float64))
            total = jc.allreduce(x)
            jc.allreduce(x, out=x)
            expected = sum(r + t for r in range(comm.size) if inputs[r] > t)
            right &= (is_on_device(total) and bool((total.cpu() == expected).all())
                      and bool((x.cpu() == expected).all()))
    assert_all(right, "a device allreduce went wrong")


def completed(work):
    work.wait()
    return work.result()


JC_ENTRY_POINTS = {
    "allreduce": lambda jc, x: jc.allreduce(x),
    "iallreduce": lambda jc, x: completed(jc.iallreduce(x)),
    "allreduce out=": lambda jc, x: jc.allreduce(x.contiguous(), out=x.contiguous()),
    "bcast": lambda jc, x: jc.bcast(x, root=0),
    "ibcast": lambda jc, x: completed(jc.ibcast(x, root=0)),
    "allgather": lambda jc, x: jc.allgather(x),
}


@pytest.mark.mpi
@pytest.mark.parametrize("entry", JC_ENTRY_POINTS)
def test_joinable_comm_reads_device_tensors_after_torchs_kernels(comm, entry):
    """Every JoinableComm entry point orders CuPy's stream after torch's (a take) before it
    reads a torch CUDA tensor: a transposed one is copied to C order on CuPy's stream first.
    The result equals NumPy's on the same values."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        use_torch_cuda_standin(monkeypatch)
        jc = JoinableComm(comm)
        base = torch.arange(12, dtype=torch.float64).reshape(3, 4) + comm.rank
        x = fake_cuda(base.t() if entry != "allreduce out=" else base)  # not C-ordered
        values = x.numpy().copy()  # before an in-place result overwrites it
        TorchCounters.reset()
        got = JC_ENTRY_POINTS[entry](jc, x)
        takes = TorchCounters.takes
    finally:
        monkeypatch.undo()
    ranks = range(comm.size)
    expected = {"bcast": values - comm.rank, "ibcast": values - comm.rank,
                "allgather": np.concatenate([values - comm.rank + r for r in ranks])}.get(
        entry, sum(values - comm.rank + r for r in ranks))
    right = np.array_equal(torch.as_tensor(got).numpy(), expected)
    assert_all(takes >= 1 and right, f"{entry}: {takes} takes, result right: {right}")


@pytest.mark.mpi(min_size=2)
def test_sync_batchnorm_on_the_device_equals_batchnorm_over_the_global_batch(comm, place):
    """SyncBatchNorm on CUDA inputs of uneven sizes: the output, the input's gradient and the
    running statistics of torch's BatchNorm1d over the concatenated batch, on the device."""
    sizes = [2 + r for r in range(comm.size)]
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, 3, generator=g, dtype=torch.float64) * 2 + 1 for n in sizes]
    jc = JoinableComm(comm)
    norm = SyncBatchNorm.convert_sync_batchnorm(place(torch.nn.BatchNorm1d(3).double()), jc)
    x = place(xs[comm.rank].clone()).requires_grad_(True)
    with Join([jc]):
        jc.begin_iteration()
        y = norm(x)
        (y * y).sum().backward()
    serial = place(torch.nn.BatchNorm1d(3).double())
    whole = place(torch.cat(xs)).requires_grad_(True)
    y_all = serial(whole)
    (y_all * y_all).sum().backward()
    start = sum(sizes[:comm.rank])
    mine = slice(start, start + sizes[comm.rank])
    pairs = [(y, y_all[mine]), (x.grad, whole.grad[mine]), (norm.running_mean, serial.running_mean),
             (norm.running_var, serial.running_var)]
    bad = [i for i, (a, b) in enumerate(pairs)
           if not torch.allclose(a.detach().cpu(), b.detach().cpu(), rtol=1e-10, atol=1e-12)]
    assert_all(not bad and (stand_in_used(place) or y.is_cuda),
               f"differ: {bad} (output, input grad, running mean, running var)")


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_narrow_sync_batchnorm_on_the_gpu_is_as_exact_as_serial_batchnorm_there(comm, dtype):
    """float32 and bfloat16 CUDA inputs, every rank's batch (channel 0's mean far from zero):
    the output and input gradient within a few times serial CUDA BatchNorm's own error in that
    dtype of the float64 replay."""
    torch.cuda.set_device(comm.rank % torch.cuda.device_count())
    dtype = getattr(torch, dtype)
    sizes = [2 + r for r in range(comm.size)]
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(n, 3, 5, generator=g, dtype=torch.float64)
          + torch.tensor([300.0, 0.01, -2.0], dtype=torch.float64)[None, :, None] for n in sizes]

    def run(layer, batches, dtype):
        inputs = [x.to("cuda", dtype).requires_grad_() for x in batches]
        y = layer(torch.cat(inputs) if len(inputs) > 1 else inputs[0])
        (y * y).sum().backward()
        return y.detach().double().cpu(), torch.cat([x.grad.double().cpu() for x in inputs])

    jc = JoinableComm(comm)
    layer = SyncBatchNorm(3, process_group=jc).to("cuda", dtype)
    with Join([jc]):
        jc.begin_iteration()
        ours = run(layer, [xs[comm.rank]], dtype)
    serial = run(torch.nn.BatchNorm1d(3).to("cuda", dtype), xs, dtype)
    exact = run(torch.nn.BatchNorm1d(3).double(), xs, torch.float64)
    start = sum(sizes[:comm.rank])
    mine = slice(start, start + sizes[comm.rank])
    ulp = torch.finfo(dtype).eps
    worse = [name for name, o, t, r in zip(("output", "input grad"), ours,
                                            (serial[0][mine], serial[1][mine]),
                                            (exact[0][mine], exact[1][mine]))
             if (o - r).abs().max() > 4 * (t - r).abs().max() + 4 * ulp * r.abs().max()]
    assert_all(not worse, f"worse than serial {dtype} BatchNorm on the GPU: {worse}")


def bn_net(norm):
    """Linear - BatchNorm1d (SyncBatchNorm over `norm`, a JoinableComm, when given) - tanh -
    Linear, float64, on the host."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.BatchNorm1d(3),
                                torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()
    return model if norm is None else SyncBatchNorm.convert_sync_batchnorm(model, norm)


def bn_batch(rank, t, place):
    g = torch.Generator().manual_seed(100 * rank + t)
    n = 2 + rank
    return (place(torch.randn(n, 4, generator=g, dtype=torch.float64) * 2 + 1),
            place(torch.randn(n, 2, generator=g, dtype=torch.float64)))


def sse(model, x, y):
    return ((model(x) - y) ** 2).sum()


def host_state(model):
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def serial_batchnorm(inputs, sync, place, lr):
    """The model's state after each global step (:func:`host_state`) in serial torch, SGD: with
    `sync`, one BatchNorm1d over the concatenated batch of the
    ranks active at each step; without, each active rank's gradient from its own batch on
    the current state, the running statistics those of the highest active rank's batch (what
    DataParallel broadcasts at the step's end)."""
    model = place(bn_net(None))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    states = []
    for t in range(max(inputs)):
        active = [r for r in range(len(inputs)) if inputs[r] > t]
        opt.zero_grad()
        if sync:
            xs, ys = zip(*(bn_batch(r, t, place) for r in active))
            sse(model, torch.cat(xs), torch.cat(ys)).backward()
        else:
            start = {k: v.clone() for k, v in model.state_dict().items()}
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for r in active:
                model.load_state_dict(start)
                model.zero_grad()
                sse(model, *bn_batch(r, t, place)).backward()
                grads = [g + p.grad for g, p in zip(grads, model.parameters())]
            for p, g in zip(model.parameters(), grads):
                p.grad = g
        for p in model.parameters():
            p.grad /= len(inputs)
        opt.step()
        states.append(host_state(model))
    return states


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("norm", ["batch", "sync"])
def test_a_device_model_with_batchnorm_trains_as_serial_torch_buffers_included(comm, place, norm):
    """BatchNorm1d (the buffers DataParallel broadcasts) or SyncBatchNorm (in the same Join),
    SGD through update=, uneven inputs: after every step of every rank (what a periodic save
    writes), parameters, running statistics and num_batches_tracked as serial torch on the
    same device; the same on every rank after the Join."""
    inputs = [min(4, n) for n in inputs_of("three_plus_rank", comm.size)]
    jc = JoinableComm(comm) if norm == "sync" else None
    model = place(bn_net(jc))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers(), update=opt.step)
    seen = []
    with Join([dp] if jc is None else [dp, jc]):
        for t in range(inputs[comm.rank]):
            model.zero_grad()
            with dp.step():
                sse(model, *bn_batch(comm.rank, t, place)).backward()
            seen.append(host_state(model))
    expected = serial_batchnorm(inputs, norm == "sync", place, lr=0.05)
    seen.append(host_state(model))  # after the Join: the last step's, on every rank
    off = [(t, k) for t, got in zip([*range(len(seen) - 1), len(expected) - 1], seen)
           for k, v in expected[t].items()
           if not np.allclose(got[k], v, rtol=1e-10, atol=1e-12)]
    assert_all(not off, f"(step, entry) off serial torch: {off}")
    final = seen[-1]
    assert_all(int(final["1.num_batches_tracked"]) == max(inputs)
               and same_everywhere(list(final.values()), comm), "replicas differ")


@pytest.mark.mpi(min_size=1)
def test_a_device_model_and_its_optimizer_resume_bitwise(comm, place, tmp_path_factory):
    """checkpoint.save/load of CUDA parameters and buffers, and torch_state of an optimizer
    whose state lives on the device: a fresh model and optimizer resume bitwise."""
    directory = comm.bcast(str(tmp_path_factory.mktemp("ckpt")) if comm.rank == 0 else None)

    def made():
        model = place(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).double())
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, opt = made()
    for t in range(2):
        x = place(torch.full((4, 4), float(t + 1), dtype=torch.float64)) + place(torch.eye(4))
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    extra = {**torch_state.state_arrays(opt, "opt"), "ids": place(torch.arange(3))}
    checkpoint.save(directory, model.parameters(), buffers=model.buffers(), step=2,
                    extra=extra, comm=comm)
    fresh, fresh_opt = made()
    TorchCounters.reset()
    resumed = checkpoint.load(directory, fresh.parameters(), buffers=fresh.buffers(), comm=comm)
    if stand_in_used(place):  # written after torch's pending kernels, and before its next
        assert_all(TorchCounters.takes == 1 and TorchCounters.hand_backs == 1,
                   f"{TorchCounters.takes} takes, {TorchCounters.hand_backs} hand-backs")
    torch_state.load_state_arrays(fresh_opt, resumed.extra, "opt")

    def flat(m, o):
        tensors = [*m.parameters(), *m.buffers()]
        tensors += [v for s in o.state.values() for v in s.values()]
        return [t.detach().cpu().numpy() for t in tensors]

    same = all(np.array_equal(a, b) for a, b in zip(flat(model, opt), flat(fresh, fresh_opt)))
    on_device = stand_in_used(place) or all(  # torch moves the state to the parameters'
        v.is_cuda for s in fresh_opt.state.values() for v in s.values() if v.dim())  # device
    assert_all(same and on_device and resumed.step == 2
               and resumed.extra["ids"].tolist() == [0, 1, 2],
               f"resumed bitwise: {same}; optimizer state on the device: {on_device}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("call", ["save", "load"])
def test_a_tensor_one_rank_cannot_view_refuses_a_checkpoint_on_every_rank(
        comm, monkeypatch, tmp_path_factory, call):
    use_torch_cuda_standin(monkeypatch)
    directory = comm.bcast(str(tmp_path_factory.mktemp("ckpt")) if comm.rank == 0 else None)
    params = [fake_cuda(torch.zeros(3, dtype=torch.float64))]
    if call == "load":
        checkpoint.save(directory, params, comm=comm)
    if comm.rank == comm.size - 1:  # this rank has no CuPy

        def without_cupy(tensor):
            raise ImportError("No module named 'cupy'")
        monkeypatch.setattr(torch_cuda, "_cupy_from_torch", without_cupy)
    with raises_everywhere(TypeError, match="CuPy"):
        getattr(checkpoint, call)(directory, params, comm=comm)
