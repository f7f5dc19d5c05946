"""Every Python example in docs/ is a complete program: run each under mpiexec.

A block whose first line is ``# test_NAME.py`` is a pytest module: it is run with pytest-mpi.
"""

import re
from pathlib import Path

import pytest
from helpers import run_mpi

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCKS = [(page.stem, i, code) for page in sorted(DOCS.glob("*.md"))
          for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", page.read_text(),
                                              re.M | re.S))]


def test_the_docs_have_examples():
    assert {page for page, _, _ in BLOCKS} >= {"quickstart", "custom_joinable", "data_parallel",
                                                "optimizers", "joinable_comm", "gpus",
                                                "testing", "sharp_bits"}


@pytest.mark.parametrize("nprocs", [1, 3])
@pytest.mark.parametrize("page, index, code", BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_docs_example_runs(tmp_path, nprocs, page, index, code):
    if re.search(r"^import torch", code, re.M):
        pytest.importorskip("torch")
    first = code.splitlines()[0]
    name = first[2:].strip() if re.fullmatch(r"# test_\w+\.py", first) else "example.py"
    script = tmp_path / name
    script.write_text(code)
    if name == "example.py":
        args = [str(script)]
    else:
        args = ["-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", str(script)]
    result = run_mpi(nprocs, args, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pending" not in result.stderr, result.stderr
