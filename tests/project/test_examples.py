"""Examples and documentation code run under mpiexec at 1..4 ranks and are checked here."""

import json
import re

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import Join
from tensorplay_mpi.examples.uneven_mean import make_data
from tensorplay_mpi.testing import run_mpi

RANKS = [1, 2, 3, 4]


def check_clean_exit(result):
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pending" not in result.stderr, "a request leaked: " + result.stderr


@pytest.mark.parametrize("nprocs", RANKS)
@pytest.mark.parametrize("idle_rank0", [False, True])
def test_uneven_mean_matches_numpy_on_the_whole_data(nprocs, idle_rank0):
    samples, chunk = 20_011, 700
    args = ["-m", "tensorplay_mpi.examples.uneven_mean", "--samples", str(samples),
            "--chunk", str(chunk), "--seed", "3"] + (["--idle-rank0"] if idle_rank0 else [])
    result = run_mpi(nprocs, args)
    check_clean_exit(result)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    data = make_data(samples, 3)
    assert report["ranks"] == nprocs
    assert sum(report["chunks"]) == -(-samples // chunk)  # every chunk streamed exactly once
    if nprocs > 1:
        assert len(set(report["chunks"])) > 1, "the split should be uneven"
        assert (report["chunks"][0] == 0) == idle_rank0
    assert report["count"] == samples
    assert report["mean"] == pytest.approx(data.mean(), rel=1e-13)
    assert report["variance"] == pytest.approx(data.var(), rel=1e-11)


def docstring_program(obj):
    """The literal block (``::``) of the Examples section of `obj`'s docstring, dedented."""
    doc = obj.__doc__.split("Examples\n    --------", 1)[1]
    block = doc.split("::\n\n", 1)[1]
    lines = [line[8:] for line in block.splitlines()]
    return "\n".join(lines).strip() + "\n"


@pytest.mark.parametrize("nprocs", RANKS)
def test_join_docstring_example_runs(nprocs, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(docstring_program(Join))
    assert re.search(r"^with Join\(", script.read_text(), re.M), script.read_text()
    check_clean_exit(run_mpi(nprocs, [str(script)]))


def test_the_leak_check_can_fail(tmp_path):
    """MPICH (the default install) reports a request dropped before completion at exit."""
    script = tmp_path / "leak.py"
    script.write_text("import numpy as np\nfrom mpi4py import MPI\n"
                      "MPI.COMM_WORLD.Iallreduce(np.ones(1), np.ones(1))\n")
    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("only MPICH reports pending references at exit")
    assert "pending" in run_mpi(2, [str(script)]).stderr


def test_make_data_is_deterministic():
    np.testing.assert_array_equal(make_data(10, 1), make_data(10, 1))


@pytest.mark.parametrize("nprocs, flags", [
    (1, []), (2, ["--divide", "active"]),
    pytest.param(3, ["--skew", "0"], marks=pytest.mark.slow),
    pytest.param(4, [], marks=pytest.mark.slow),
])
def test_demo_training_is_accurate_exact_and_identical_on_every_rank(nprocs, flags):
    result = run_mpi(nprocs, ["-m", "tensorplay_mpi.examples.train", *flags], timeout=300)
    check_clean_exit(result)  # exit 0: held-out accuracy >= 0.95 and identical parameters
    split = json.loads(re.search(r"split (\[[\d, ]+\])", result.stdout).group(1))
    held_out = float(re.search(r"held-out accuracy ([\d.]+)", result.stdout).group(1))
    assert len(split) == nprocs and sum(split) == 1438  # every sample once, none padded
    if "--skew" in flags:  # skew 0: as even as possible
        assert max(split) - min(split) <= 1
    elif nprocs > 1:
        assert split == sorted(split) and split[0] < split[-1]
    assert held_out >= 0.95
    assert f"parameters identical on all {nprocs} ranks: yes" in result.stdout


def demo_lines(stdout):
    """The demo's output lines with the numbers blanked: its format."""
    return [re.sub(r"[\d.]+", "N", re.sub(r"digest \w+", "digest D", line))
            for line in stdout.splitlines()]


@pytest.mark.slow
def test_the_torch_demo_prints_the_demo_lines_and_trains_as_well():
    pytest.importorskip("torch")
    nprocs = 3
    flags = ["--epochs", "5", "--min-accuracy", "0.9"]
    result = run_mpi(nprocs, ["-m", "tensorplay_mpi.examples.train_torch", *flags], timeout=300)
    check_clean_exit(result)  # exit 0: accurate enough and identical parameters
    numpy_demo = run_mpi(nprocs, ["-m", "tensorplay_mpi.examples.train", *flags], timeout=300)
    check_clean_exit(numpy_demo)
    assert demo_lines(result.stdout) == demo_lines(numpy_demo.stdout)
    assert f"parameters identical on all {nprocs} ranks: yes (digest " in result.stdout


@pytest.mark.parametrize("nprocs", RANKS)
@pytest.mark.parametrize("idle_rank0", [False, True])
def test_kmeans_equals_the_serial_run_on_all_the_data(nprocs, idle_rank0):
    from tensorplay_mpi.examples import kmeans

    args = ["--points", "3000", "--seed", "2"] + (["--idle-rank0"] if idle_rank0 else [])
    result = run_mpi(nprocs, ["-m", "tensorplay_mpi.examples.kmeans", *args])
    check_clean_exit(result)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    data = kmeans.make_data(3000, 5, 2, 2)
    per_rank = [kmeans.rank_batches(data, r, nprocs, 64, idle_rank0) for r in range(nprocs)]
    assert report["batches"] == [len(b) for b in per_rank]
    assert report["identical_on_every_rank"]  # kept current on the ranks that joined early
    if nprocs > 1:
        assert len(set(report["batches"])) > 1 and (report["batches"][0] == 0) == idle_rank0
    expected = kmeans.serial_kmeans(per_rank, data[:5].copy())
    np.testing.assert_allclose(report["centroids"], expected, rtol=1e-12, atol=0)


def test_the_demo_says_why_it_exits_1_below_min_accuracy():
    result = run_mpi(2, ["-m", "tensorplay_mpi.examples.train", "--epochs", "1",
                         "--min-accuracy", "0.999"], timeout=120)
    held_out = float(re.search(r"held-out accuracy ([\d.]+)", result.stdout).group(1))
    assert held_out < 0.999 and result.returncode != 0
    assert (f"FAILED: held-out accuracy {held_out:.4f} is below --min-accuracy 0.999"
            in result.stdout), result.stdout


def test_without_scikit_learn_the_demo_names_the_extra(tmp_path):
    (tmp_path / "sklearn").mkdir()
    (tmp_path / "sklearn" / "__init__.py").write_text("raise ImportError('hidden by the test')")
    result = run_mpi(2, ["-m", "tensorplay_mpi.examples.train"], timeout=120,
                     PYTHONPATH=str(tmp_path))
    assert result.returncode != 0
    assert "pip install 'tensorplay-mpi[examples]'" in result.stderr, result.stderr


def test_device_cuda_without_cupy_names_the_extra(tmp_path):
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("raise ImportError('hidden by the test')")
    result = run_mpi(1, ["-m", "tensorplay_mpi.examples.train", "--device", "cuda"],
                     timeout=120, PYTHONPATH=str(tmp_path))
    assert result.returncode != 0
    assert "--device cuda needs CuPy: pip install 'tensorplay-mpi[cuda]'" in result.stderr


def _gpus():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="launches its own mpiexec")
@pytest.mark.skipif(not _gpus(), reason="no CUDA GPU and CuPy")
def test_demo_on_gpus_is_accurate_and_identical_on_every_rank():
    result = run_mpi(2, ["-m", "tensorplay_mpi.examples.train", "--device", "cuda"], timeout=300)
    check_clean_exit(result)
    assert "on cuda:" in result.stdout and "identical on all 2 ranks: yes" in result.stdout


def test_the_torch_demo_on_cuda_without_a_gpu_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: test_torch_demo_on_gpus covers it")
    result = run_mpi(1, ["-m", "tensorplay_mpi.examples.train_torch", "--device", "cuda"],
                     timeout=120)
    assert result.returncode != 0
    assert "--device cuda: torch sees no CUDA GPU here" in result.stderr, result.stderr


def _torch_gpus():
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if _gpus() else 0


@pytest.mark.gpu
@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="launches its own mpiexec")
@pytest.mark.skipif(not _torch_gpus(), reason="no CUDA GPU with torch and CuPy")
@pytest.mark.parametrize("nprocs", [1, 2])
def test_torch_demo_on_gpus_is_accurate_and_identical_on_every_rank(nprocs):
    result = run_mpi(nprocs, ["-m", "tensorplay_mpi.examples.train_torch", "--device", "cuda",
                              "--epochs", "10", "--min-accuracy", "0.9"], timeout=300)
    check_clean_exit(result)  # exit 0: accurate enough and identical parameters
    assert "on cuda:" in result.stdout
    assert f"parameters identical on all {nprocs} ranks: yes" in result.stdout
