"""torch CUDA tensors through the device path, against serial torch on the same device.

Each test runs on three placements: a CPU stand-in for CUDA tensors (``fake_device.fake_cuda``:
the library sees CUDA tensors, their CuPy views are fake device arrays over the same memory),
CUDA-aware and staged, in every CI run; and a real GPU (``cuda``, ``make gpu-check``), skipped
without one.  float64 throughout: the distributed run equals the serial one to 1e-12.
"""

import numpy as np
import pytest
from fake_device import (TorchCounters, fake_cuda, is_on_device,
                         use_torch_cuda_standin)
from helpers import gathered_equal

from tensorplay_mpi import (Adam, DataParallel, Join, JoinableComm, ZeroRedundancyOptimizer,
                            checkpoint)
from tensorplay_mpi.comm import torch_cuda
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere, reset_settings

torch = pytest.importorskip("torch")

from torch_reference import Branchy, arrays, close, loss_of, same_everywhere, serial  # noqa: E402

from tensorplay_mpi.checkpoint import torch_state  # noqa: E402
from tensorplay_mpi.evaluation.sync_batchnorm import SyncBatchNorm  # noqa: E402


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


def adamw_onecycle_clip(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        opt.step()
        sched.step()
    return update, opt


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
    update, opt = adamw_onecycle_clip(model)
    dp = DataParallel(model.parameters(), comm=comm, bucket_cap_mb=1e-4, update=update)
    with Join([dp]):
        for t in range(inputs[comm.rank]):
            model.zero_grad()
            k = micro(comm.rank, t)
            with dp.step(micro_batches=k):
                for m in range(k):
                    loss_of(model, comm.rank, t, m, sometimes, place).backward()
    expected = serial(lambda m: adamw_onecycle_clip(m)[0], inputs, sometimes, micro,
                      prepare=freeze_bias, place=place)
    got = arrays(model)
    state = [t.detach().cpu().numpy() for s in opt.state.values() for t in s.values()]
    assert_all(all(is_on_device(p) for p in model.parameters()), "a parameter moved")
    assert_all(all(is_on_device(g) for g in dp.grads), "dp.grads left the device")
    assert_all(same_everywhere(got + state, comm), "parameters or AdamW state differ")
    assert_all(not close(got, arrays(expected)), close(got, arrays(expected)))
    if stand_in_used(place) and max(inputs):
        assert_all(TorchCounters.stream_syncs > 0 and TorchCounters.hand_backs > 0,
                   f"torch's stream: {TorchCounters.stream_syncs} syncs, "
                   f"{TorchCounters.hand_backs} hand-backs")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("zero", [False, True])
def test_library_optimizers_on_device_tensors_equal_the_host_run(comm, place, zero):
    """The library's Adam (fused kernels on a GPU) and ZeroRedundancyOptimizer over torch
    CUDA parameters: as the same run on the CPU."""
    inputs = inputs_of("three_plus_rank", comm.size)

    def run(where):
        model = where(Branchy())
        params = list(model.parameters())
        dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-4)
        opt = (ZeroRedundancyOptimizer(params, dp.grads, Adam, comm=comm, lr=0.01) if zero
               else Adam(params, dp.grads, lr=0.01))
        with Join([dp, opt]):
            for t in range(inputs[comm.rank]):
                model.zero_grad()
                with dp.step():
                    loss_of(model, comm.rank, t, place=where).backward()
                opt.step()
        return arrays(model)

    host = run(lambda x: x)
    got = run(place)
    assert_all(gathered_equal(got, comm), "parameters differ across ranks")
    assert_all(not close(got, host), close(got, host))
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
