"""``DataParallel(compress="bf16"|"fp16")``: float32 gradients reduced in 16 bits.

Each rank divides its gradient by the divisor in float32 and rounds it to the format; the
allreduce adds the 16-bit terms pairwise (each addition exact in float32, then rounded to the
format), in an order that MPI's algorithm chooses.  The replay does the same arithmetic with
torch's conversions and accepts, per element, the result of any order of additions (every
binary tree over the active ranks' terms: 1, 3 and 15 trees for 2, 3 and 4 terms; a joined
rank's zero changes nothing).  With uneven inputs, on every rank, joined ones included, and
bitwise the same everywhere.
"""

import numpy as np
import pytest

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

torch = pytest.importorskip("torch")

from half_reference import LR, STEPS, Small, train, training_tolerance  # noqa: E402
from torch_reference import same_everywhere  # noqa: E402

FORMATS = {"bf16": (torch.bfloat16, 2.0 ** -8), "fp16": (torch.float16, 2.0 ** -11)}
SHAPES = [(3, 4), (5,)]


def gradient(rank, t, i):
    """Rank `rank`'s float32 gradient of parameter `i` in step `t`: mixed signs, magnitudes
    2**-6 .. 2**6."""
    g = np.random.default_rng([rank, t, i]).standard_normal(SHAPES[i])
    g *= 2.0 ** np.random.default_rng([rank, t, i, 1]).integers(-6, 7, SHAPES[i])
    return g.astype(np.float32)


def rounded(x, name):
    """float32 `x` rounded to the format (to nearest even, by torch), as float32."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(FORMATS[name][0]).float().numpy()


def every_order(terms, name):
    """The sums of `terms` in every order of pairwise additions, each rounded to the format."""
    if len(terms) == 1:
        return [terms[0]]
    results = []
    rest = list(range(1, len(terms)))
    for mask in range(2 ** len(rest)):  # the parts that hold terms[0], and the others
        left = [terms[0]] + [terms[j] for k, j in enumerate(rest) if mask >> k & 1]
        right = [terms[j] for k, j in enumerate(rest) if not mask >> k & 1]
        if right:
            results += [rounded(a + b, name) for a in every_order(left, name)
                        for b in every_order(right, name)]
    return results


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("pattern", ["three_plus_rank", "rank0_zero", "last_zero"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_compressed_gradients_are_a_16_bit_sum_of_rounded_terms(comm, name, pattern):
    inputs = inputs_of(pattern, comm.size)
    params = [np.zeros(s, np.float32) for s in SHAPES]
    seen = []
    dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-5, compress=name,
                      update=lambda: seen.append([np.array(g) for g in dp.grads]))
    with Join([dp]):
        for t in range(inputs[comm.rank]):
            with dp.step():
                for i in range(len(SHAPES)):
                    dp.grads[i][...] = gradient(comm.rank, t, i)
    bad = []
    for t, got in enumerate(seen):
        for i, g in enumerate(got):
            terms = [rounded(gradient(r, t, i) / np.float32(comm.size), name)
                     for r in range(comm.size) if inputs[r] > t]
            if not np.any([g == c for c in every_order(terms, name)], axis=0).all():
                bad.append((t, i))
    assert_all(len(seen) == max(inputs), f"{len(seen)} updates, expected {max(inputs)}")
    assert_all(not bad, f"{name} {inputs}: (step, param) off every order of sums: {bad}")
    assert_all(same_everywhere([g for step in seen for g in step], comm),
               "averaged gradients differ between ranks")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", list(FORMATS))
def test_a_float32_model_trains_with_compression_like_a_float64_replay(comm, name):
    inputs = [min(STEPS, n) for n in inputs_of("three_plus_rank", comm.size)]
    model = Small()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp = DataParallel(model.parameters(), comm=comm, bucket_cap_mb=1e-4, update=opt.step,
                      compress=name)
    expected, largest = train(comm, model, dp, inputs)
    got = [p.detach().numpy() for p in model.parameters()]
    excess = [float(np.max(np.abs(g - e.detach().numpy())
                           - training_tolerance(2.0 ** -24, e.detach().numpy(), m.item(),
                                                max(inputs), u_grad=FORMATS[name][1])))
              for g, e, m in zip(got, expected.parameters(), largest)]
    assert_all(same_everywhere(got, comm), "parameters differ between ranks")
    assert_all(max(excess) <= 0, f"{name} {inputs}: over the bound by {excess}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("params, compress, error, match", [
    ([np.zeros(3, np.float32)], "int8", ValueError, "compress must be None, 'bf16' or 'fp16'"),
    ([np.zeros(3)], "bf16", TypeError, r"compress='bf16' takes float32 params .* float64"),
])
def test_compress_misuse_is_refused_on_every_rank(comm, params, compress, error, match):
    with raises_everywhere(error, match=match):
        DataParallel(params, comm=comm, compress=compress)


@pytest.mark.mpi(min_size=1)
def test_a_frozen_parameter_of_another_dtype_is_no_reason_to_refuse(comm):
    """A frozen float64 ``Parameter`` is never reduced: compress takes the model; a float64
    tensor trained by hand (no ``Parameter``) is reduced, and refused."""
    frozen = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64), requires_grad=False)
    dp = DataParallel([torch.zeros(4), frozen], comm=comm, compress="bf16")
    with raises_everywhere(TypeError, match=r"params\[1\] is float64"):
        DataParallel([torch.zeros(4), torch.zeros(3, dtype=torch.float64)], comm=comm,
                     compress="bf16")
    assert_all(dp.compress == "bf16")


@pytest.mark.mpi(min_size=2)
def test_ranks_that_differ_in_compress_are_refused_on_every_rank(comm):
    with raises_everywhere(ValueError, match="different .*compress"):
        DataParallel([np.zeros(3, np.float32)], comm=comm,
                     compress="bf16" if comm.rank == 0 else None)


@pytest.mark.mpi(min_size=1)
def test_samples_with_compress_is_refused_on_every_rank(comm):
    dp = DataParallel([np.zeros(3, np.float32)], comm=comm, compress="fp16")
    with raises_everywhere(ValueError, match="samples= with compress='fp16'"):
        with Join([dp]), dp.step(samples=4):
            pass


def test_the_bfloat16_rounding_is_torchs_on_every_kind_of_float32(recwarn):
    """Normal, subnormal, halfway, overflowing, infinite and NaN values (a NaN whose payload
    sits in the low bits included) round as torch rounds them; NaN stays NaN."""
    from tensorplay_mpi.parallel._compress import from_bfloat16, to_bfloat16
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 32, 100_000, dtype=np.uint64).astype(np.uint32)
    bits[:6] = [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F800001, 0xFFC00000, 0x00008000]
    x = bits.view(np.float32)
    wire, scratch, back = (np.empty(x.size, t) for t in (np.uint16, np.uint32, np.float32))
    to_bfloat16(x, wire, scratch)
    from_bfloat16(wire, back)
    expected = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    nan = np.isnan(expected)
    assert np.array_equal(back[~nan], expected[~nan]) and np.isnan(back[nan]).all()
    assert not recwarn.list, [str(w.message) for w in recwarn.list]
