"""The JoinableComm benchmarks that `make bench` runs still run: a tiny run of each at 2 ranks.

Their figures are not checked (timings never are in tests): only that each finishes, writes
its JSON, and times every variant it names.
"""

import json
import math
from pathlib import Path

from tensorplay_mpi.testing import run_mpi

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run(script, tmp_path, *args):
    out = tmp_path / f"{script}.json"
    result = run_mpi(2, [str(BENCHMARKS / f"{script}.py"), "--out", str(out), *args],
                     OPENBLAS_NUM_THREADS="1")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


def timed(values):
    return all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)


def test_profile_steps_wraps_functions_that_exist(tmp_path):
    report = run("profile_steps", tmp_path, "--sizes", "4096", "--steps", "3")
    rows = report["joinable_comm"]
    assert rows["blocking"] > 0
    for row in (rows["all_active"], rows["one_joined"]):  # the wrapped parts were reached
        assert row["iteration"] > 0 and row["wrappers"] > 0


def test_bench_jc_times_every_variant(tmp_path):
    report = run("bench_jc", tmp_path, "--iterations", "5", "--repeats", "1")
    assert len(report["schedules"]) == 2
    for schedule in report["schedules"].values():
        assert {"blocking", "jc_all_active", "jc_one_joined"} <= set(schedule["us"])
        assert timed(schedule["us"].values())


def test_bench_science_times_both_loops(tmp_path):
    report = run("bench_science", tmp_path, "--iterations", "3", "--repeats", "1")
    assert {name.split(",")[0] for name in report["loops"]} == {"monte_carlo", "kmeans"}
    for loop in report["loops"].values():
        assert set(loop["us_per_iteration"]) == {"jc", "padding"}
        assert timed(loop["us_per_iteration"].values())
