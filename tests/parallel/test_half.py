"""Half-precision models (float16, bfloat16) through DataParallel, against float64 replays.

A half-precision bucket widens its gradients to float32, sums them there with MPI's SUM,
divides in float32 and rounds the mean to the format once.  With ``k`` active ranks and
the divisor ``d``, the float32 sum of ``k`` terms is off by at most ``(k - 1) u32 sum|g|``
and the division by ``u32 |S / d|`` (``u32 = 2**-24``), so the float32 mean ``q`` is within
``e = (k + 1) u32 sum|g| / d`` of the exact mean ``m``; rounding ``q`` to the format adds at
most ``u |q| <= u (|m| + e)`` (``u``: half the format's epsilon) where ``q`` is normal, and
half the smallest subnormal below.  That bound is what the averaged gradients are checked
against, on every rank, joined ones included, with uneven inputs.  Summing in the format
would round ``k - 1`` more times (a bfloat16 sum of three values of mixed signs misses it).

A torch model trained in the format with ``update=opt.step`` is then compared with the same
model trained in float64 serially over the active ranks' batches, within a first-order bound
of the format's rounding (``half_reference.training_tolerance``), and is bitwise the same on
every rank.
"""

import numpy as np
import pytest

from tensorplay_mpi import DataParallel, Join, JoinableComm
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

torch = pytest.importorskip("torch")

from half_reference import LR, STEPS, Small, loss_of, train, training_tolerance  # noqa: E402
from torch_reference import same_everywhere  # noqa: E402

U32 = 2.0 ** -24
FORMATS = {  # name: (unit roundoff u, smallest subnormal, torch dtype or None for NumPy)
    "numpy-float16": (2.0 ** -11, 2.0 ** -24, None),
    "float16": (2.0 ** -11, 2.0 ** -24, torch.float16),
    "bfloat16": (2.0 ** -8, 2.0 ** -133, torch.bfloat16),
}
SHAPES = [(3, 4), (5,)]
PATTERNS = ("three_plus_rank", "rank0_zero", "last_zero", "even")


def gradient(rank, t, i, name):
    """Rank `rank`'s gradient of parameter `i` in step `t`, exactly representable in the
    format: float64 of mixed signs and magnitudes 2**-6 .. 2**6, rounded to it."""
    g = np.random.default_rng([rank, t, i]).standard_normal(SHAPES[i])
    g *= 2.0 ** np.random.default_rng([rank, t, i, 1]).integers(-6, 7, SHAPES[i])
    dtype = FORMATS[name][2]
    if dtype is None:
        return g.astype(np.float16).astype(np.float64)
    return torch.from_numpy(g).to(dtype).double().numpy()


def as_float64(x):
    return x.double().numpy() if torch.is_tensor(x) else np.asarray(x, dtype=np.float64)


def params_of(name):
    dtype = FORMATS[name][2]
    if dtype is None:
        return [np.zeros(s, np.float16) for s in SHAPES]
    return [torch.zeros(s, dtype=dtype) for s in SHAPES]


def mean_bound(terms, size, name):
    """The exact mean of `terms` over `size` ranks and how far the library's may be from it."""
    u, tiny, _ = FORMATS[name]
    exact = sum(terms) / size
    e = (len(terms) + 1) * U32 * sum(np.abs(g) for g in terms) / size
    return exact, u * (np.abs(exact) + e) + e + tiny / 2


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", list(FORMATS))
def test_half_gradients_are_the_mean_rounded_once(comm, name, pattern, stream):
    """`stream`: a JoinableComm's allreduce in each step, as SyncBatchNorm's (the step's
    collectives then go as one announced block while a rank has joined)."""
    inputs = inputs_of(pattern, comm.size) if pattern != "even" else [4] * comm.size
    params = params_of(name)
    seen = []
    dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-5,  # a bucket per parameter
                      update=lambda: seen.append([as_float64(g) for g in dp.grads]))
    jc = JoinableComm(comm)
    with Join([dp, jc] if stream else [dp]):
        for t in range(inputs[comm.rank]):
            with dp.step():
                if stream:
                    jc.allreduce(np.ones(2))
                for i in range(len(SHAPES)):
                    dp.grads[i] = gradient(comm.rank, t, i, name).astype(
                        np.float16 if FORMATS[name][2] is None else np.float64)
    bad = []
    for t, got in enumerate(seen):
        for i, g in enumerate(got):
            terms = [gradient(r, t, i, name) for r in range(comm.size) if inputs[r] > t]
            exact, bound = mean_bound(terms, comm.size, name)
            if not (np.abs(g - exact) <= bound).all():
                bad.append((t, i, float(np.max(np.abs(g - exact) - bound))))
    assert_all(len(seen) == max(inputs), f"{len(seen)} updates, expected {max(inputs)}")
    assert_all(not bad, f"{name} {inputs}: (step, param, excess over the bound) {bad}")
    assert_all(same_everywhere([g for step in seen for g in step], comm),
               "averaged gradients differ between ranks")


def library_sgd(model, dp):
    from tensorplay_mpi.optim import SGD
    return SGD(model.parameters(), dp.grads, lr=LR, comm=dp.comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pattern", ["three_plus_rank", "rank0_zero"])
@pytest.mark.parametrize("name, optimizer", [("float16", "torch"), ("bfloat16", "torch"),
                                             ("float16", "library")])
def test_a_half_torch_model_trains_like_a_float64_replay(comm, name, optimizer, pattern):
    u, _, dtype = FORMATS[name]
    inputs = [min(STEPS, n) for n in inputs_of(pattern, comm.size)]
    model = Small().to(dtype)
    steps = []  # the optimizer's step, once it exists (it takes dp.grads)
    dp = DataParallel(model.parameters(), comm=comm, bucket_cap_mb=1e-4,
                      update=lambda: steps[0]())
    opt = (torch.optim.SGD(model.parameters(), lr=LR) if optimizer == "torch"
           else library_sgd(model, dp))
    steps.append(opt.step)
    expected, largest = train(comm, model, dp, inputs)
    got = [p.detach().double().numpy() for p in model.parameters()]
    bits = [p.detach().view(torch.int16).numpy() for p in model.parameters()]
    excess = [float(np.max(np.abs(g - e.detach().numpy())
                           - training_tolerance(u, e.detach().numpy(), m.item(), max(inputs))))
              for g, e, m in zip(got, expected.parameters(), largest)]
    assert_all(same_everywhere(bits, comm), "parameters differ between ranks")
    assert_all(max(excess) <= 0, f"{name} {inputs}: over the bound by {excess}")


@pytest.mark.mpi(min_size=1)
def test_library_optimizers_refuse_bfloat16_params_naming_torch_ones(comm):
    from tensorplay_mpi.optim import SGD, ZeroRedundancyOptimizer
    model = Small().to(torch.bfloat16)
    dp = DataParallel(model.parameters(), comm=comm)
    for make in (lambda: SGD(model.parameters(), dp.grads, lr=0.1),
                 lambda: ZeroRedundancyOptimizer(model.parameters(), dp.grads)):
        with raises_everywhere(TypeError, match=r"params\[0\] is bfloat16, .*update=opt.step"):
            make()


def train_half(model, update_owner, comm, inputs, first):
    """Steps `first`, `first + 1`, ... of `inputs` (global numbering) under a Join."""
    dp = DataParallel(model.parameters(), comm=comm, bucket_cap_mb=1e-4,
                      update=update_owner.step)
    with Join([dp]):
        for t in range(first, first + inputs[comm.rank]):
            model.zero_grad()
            with dp.step():
                loss_of(model, comm.rank, t).backward()


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-3)  # float16 holds 1e-3


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_a_half_run_resumes_from_a_checkpoint_bitwise(comm, tmp_path, name):
    """Two uneven Joins in a row, or the first, a checkpoint, fresh objects and the second."""
    from tensorplay_mpi import checkpoint
    from tensorplay_mpi.checkpoint import load_state_arrays, state_arrays
    dtype = FORMATS[name][2]
    inputs = inputs_of("three_plus_rank", comm.size)
    model = Small().to(dtype)
    opt = adamw(model)
    train_half(model, opt, comm, inputs, 0)
    directory = comm.bcast(str(tmp_path))
    checkpoint.save(directory, model.parameters(), extra=state_arrays(opt, "opt"), comm=comm)
    train_half(model, opt, comm, inputs, max(inputs))

    again = Small().to(dtype)
    opt2 = adamw(again)
    resumed = checkpoint.load(directory, again.parameters(), comm=comm)
    load_state_arrays(opt2, resumed.extra, "opt")
    train_half(again, opt2, comm, inputs, max(inputs))
    bits = [t.view(torch.int16).numpy().tobytes() for m, o in ((model, opt), (again, opt2))
            for t in [*[p.detach() for p in m.parameters()],
                      *[v for s in o.state.values() for v in s.values() if v.dtype == dtype]]]
    half = len(bits) // 2
    assert_all(bits[:half] == bits[half:], "the resumed run differs from the one never stopped")
    assert_all(same_everywhere([np.frombuffer(b, np.uint8) for b in bits], comm),
               "parameters or optimizer state differ between ranks")


def test_float16_sums_beyond_its_range_average_to_the_exact_mean(recwarn):
    """Two ranks' 60000 sum to 120000, beyond float16 (65504) but not float32: the mean is
    60000, not the infinity a float16 sum gives; a mean of 70000 is infinite, and NaN stays
    NaN, without a warning (the wire's sums are set as an allreduce of two ranks leaves them).
    """
    from tensorplay_mpi.parallel._buckets import make_buckets
    (bucket,), _, (view,) = make_buckets([np.zeros(3, np.float16)], 1e6)
    bucket.grads[...] = [2 * 60000.0, 2 * 70000.0, np.nan]
    bucket.divide(2)
    bucket.unpack()
    assert view[0] == 60000 and view[1] == np.inf and np.isnan(view[2]), view
    assert not recwarn.list, [str(w.message) for w in recwarn.list]
