"""Every Python example in docs/ and the README is a complete program: run each under mpiexec.

A block whose first line is ``# test_NAME.py`` is a pytest module: it is run with pytest-mpi and
the plugin loaded as docs/testing.md says (``-p tensorplay_mpi.testing``), and must not warn.
The README is a front door whose links lead to the pages, which never include it.
"""

import re

import pytest
from helpers import ROOT

from tensorplay_mpi.testing import run_mpi

DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))
BLOCKS = [(page.stem, i, code) for page in [*sorted(DOCS.glob("*.md")), README]
          for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", page.read_text(),
                                              re.M | re.S))]


def test_the_docs_have_examples():
    assert {page for page, _, _ in BLOCKS} >= {"quickstart", "custom_joinable", "data_parallel",
                                                "optimizers", "joinable_comm", "gpus",
                                                "testing", "sharp_bits"}


@pytest.mark.parametrize("nprocs", [1, pytest.param(3, marks=pytest.mark.slow)])  # ~50 s at 3
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
        args = ["-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                "-p", "tensorplay_mpi.testing", str(script)]
    result = run_mpi(nprocs, args, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pending" not in result.stderr, result.stderr
    assert "Warning" not in result.stdout, result.stdout


def test_no_page_includes_the_readme():
    """Pages are the only home of their facts: none pulls text out of the README by heading."""
    including = [page.name for page in PAGES
                 if re.search(r"\{include\}\s+\S*README", page.read_text())]
    assert not including


def _slug(heading):
    """The anchor MyST and GitHub give a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_links_resolve():
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    local = [link for link in links if not re.match(r"\w+:", link)]
    assert local, "the README links to no page"
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {link}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"README links to {link}: no heading"


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text
    linked = set(re.findall(r"\]\(docs/(\w+)\.md\)", text))
    toctree = re.search(r"```\{toctree\}(.*?)```", (DOCS / "index.md").read_text(), re.S)
    pages = set(re.findall(r"^(\w+)$", toctree.group(1), re.M)) - {"changelog"}
    assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"


def test_no_page_promises_a_pypi_release_that_does_not_exist():
    """`pip install tensorplay-mpi` works once a release exists; until then every page that
    shows it must say so."""
    for page in [*PAGES, README]:
        text = page.read_text()
        if re.search(r"pip install '?tensorplay-mpi", text):
            assert "not on PyPI yet" in text, page.name
