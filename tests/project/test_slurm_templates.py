"""The Slurm templates hold what a site needs after one edit (`make slurm-test` runs them)."""

import re

import pytest
from helpers import ROOT

SLURM = ROOT / "slurm"
TEMPLATES = sorted(SLURM.glob("*.sbatch"))


def directive(text, name):
    found = re.findall(rf"^#SBATCH --{name}=(\S+)", text, re.M)
    return found[0] if found else None


def seconds(limit):
    """Slurm's [[days-]hours:]minutes:seconds, as this test reads it."""
    days, _, clock = limit.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    hours, minutes, secs = parts
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + secs


def test_there_are_templates():
    assert {t.name for t in TEMPLATES} == {"train.sbatch", "train-gpu.sbatch", "pytest.sbatch"}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_a_template_needs_one_edit_and_times_out_before_slurm(template):
    text = template.read_text()
    assert directive(text, "account") == "YOUR_ACCOUNT"
    assert directive(text, "partition").startswith("YOUR_")
    assert re.search(r"^# module load \S+", text, re.M), "no module load example"
    assert "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}" in text
    assert "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}" in text
    timeout = int(re.search(r"TENSORPLAY_MPI_TIMEOUT:-(\d+)", text).group(1))
    assert 0 < timeout < seconds(directive(text, "time")), "the library must report first"
    assert "--kill-on-bad-exit=1" in text and "python -m mpi4py" in text


def test_the_gpu_template_gives_each_rank_a_gpu_and_trains_on_it():
    text = (SLURM / "train-gpu.sbatch").read_text()
    assert directive(text, "gpus-per-task") == "1" or "--gpu-bind=closest" in text
    assert re.search(r"tensorplay_mpi\.examples\.train --device \"\$DEVICE\"", text)
    assert "DEVICE=${DEVICE:-cuda}" in text


def test_time_limits_are_read_as_slurm_does():
    assert seconds("00:10:00") == 600 and seconds("1-02:00:00") == 93600
    assert seconds("30:00") == 1800


@pytest.mark.parametrize("name", ["train.sbatch", "train-gpu.sbatch"])
def test_the_program_line_is_marked_as_the_one_to_edit(name):
    lines = (SLURM / name).read_text().splitlines()
    last_srun = max(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert lines[last_srun - 1].startswith("# EDIT: your own program"), lines[last_srun - 1]


def test_the_pytest_template_loads_the_plugin_without_a_warning():
    """`-p tensorplay_mpi.testing`, the form of docs/testing.md that pytest does not warn about."""
    assert "-p tensorplay_mpi.testing" in (SLURM / "pytest.sbatch").read_text()
