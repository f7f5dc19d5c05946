"""The test files and folders of what changed, for ``make check``.

    python tests/changed.py [BASE]

Prints the paths to give pytest, one a line, for the files changed since BASE (default: the
merge base with ``origin/HEAD`` when HEAD is ahead of it, else ``HEAD~1``), in the working tree
(staged or not) and untracked. The test tree mirrors the package:

- ``tensorplay_mpi/X/...`` -> ``tests/X/``; a module with no folder of its name
  (``tensorplay_mpi/X.py`` or ``tensorplay_mpi/Y/X.py``, a private ``_X.py`` alike) ->
  ``tests/X/``, else the test files named ``test_X*.py``, else those that name it by its dotted
  path (``tensorplay_mpi.Y._X``, or ``from tensorplay_mpi.Y import _X``); the facade
  ``tensorplay_mpi/__init__.py`` -> the API tests in ``tests/project/``;
- a test file -> itself; a launched program ``tests/programs/P.py`` -> the test files that name
  ``P.py``; a helper module ``tests/H.py`` -> the test files that import it;
- the docs and README -> ``tests/project/test_docs.py`` (the API pages: the API tests); the
  Slurm templates and the packaging files -> their tests in ``tests/project/``.

What maps to no test (conftest.py, a module no test names, benchmarks) is named on stderr.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PROJECT = "tests/project/"
FIXED = {  # path prefix -> its tests
    "docs/api/": [PROJECT + "test_api_docs.py", PROJECT + "test_api_index.py"],
    "docs/": [PROJECT + "test_docs.py"],
    "README.md": [PROJECT + "test_docs.py"],
    "slurm/": [PROJECT + "test_slurm_templates.py"],
    "setup.cfg": [PROJECT + "test_packaging.py"],
    "pyproject.toml": [PROJECT + "test_packaging.py"],
}
QUIET = ("benchmarks/", "CHANGELOG.md", "Makefile", ".ci/", "docs/conf.py", "LICENSE", ".git")


def git(*args):
    """The lines git prints for `args`, in the repository root."""
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def default_base():
    """The merge base with origin/HEAD when HEAD is ahead of it, else HEAD~1 (None: no parent)."""
    try:
        upstream = git("merge-base", "HEAD", "origin/HEAD")[0]
        if upstream != git("rev-parse", "HEAD")[0]:
            return upstream
    except subprocess.CalledProcessError:
        pass
    try:
        return git("rev-parse", "--verify", "-q", "HEAD~1")[0]
    except subprocess.CalledProcessError:
        return None


def changed_files(base):
    """The paths changed since `base` (committed or not) and the untracked ones."""
    tracked = git("diff", "--name-only", base) if base else git("ls-files")
    return sorted(set(tracked) | set(git("ls-files", "--others", "--exclude-standard")))


def all_test_files():
    """Every test file, relative to the root."""
    return sorted(str(p.relative_to(ROOT)) for p in TESTS.rglob("test_*.py"))


def naming(pattern):
    """The test files whose text matches the regular expression `pattern`."""
    return [path for path in all_test_files()
            if re.search(pattern, (ROOT / path).read_text(encoding="utf-8"))]


def targets_of_module(path):
    """The tests of the package module `path` (tensorplay_mpi/...)."""
    parts = Path(path).with_suffix("").parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts:  # the facade: its names
        return [PROJECT + "test_api_docs.py", PROJECT + "test_api_index.py"]
    for name in (parts[0], parts[-1]):
        if (TESTS / name.lstrip("_")).is_dir():
            return [f"tests/{name.lstrip('_')}/"]
    stem = re.escape(parts[-1].lstrip("_"))
    named = [p for p in all_test_files() if re.fullmatch(rf"test_{stem}(_.*)?\.py", Path(p).name)]
    parent = re.escape(".".join(("tensorplay_mpi", *parts[:-1])))
    name = re.escape(parts[-1])
    return named or naming(rf"\b{parent}\.{name}\b|\bfrom {parent} import\b.*\b{name}\b")


def targets_of(path):
    """The tests of the changed file `path` (relative to the root), [] if none."""
    name = Path(path).name
    if not (ROOT / path).exists():
        return []
    if path.startswith("tensorplay_mpi/") and path.endswith(".py"):
        return targets_of_module(path)
    if path.startswith("tests/"):
        if name.startswith("test_"):
            return [path]
        if path.startswith("tests/programs/"):
            return naming(rf"\b{re.escape(name)}\b")
        if Path(path).parent == TESTS.relative_to(ROOT) and name != "conftest.py":
            return naming(rf"(?m)^(from|import) {re.escape(Path(path).stem)}\b")
        return []
    return next((tests for prefix, tests in FIXED.items() if path.startswith(prefix)), [])


def simplest(paths):
    """`paths` without the files that a folder among them holds."""
    folders = [p for p in paths if p.endswith("/")]
    return sorted(p for p in set(paths) if not any(p != f and p.startswith(f) for f in folders))


def main(argv):
    base = argv[1] if len(argv) > 1 else default_base()
    found = []
    for path in changed_files(base):
        tests = targets_of(path)
        if not tests and (ROOT / path).exists() and not path.startswith(QUIET):
            print(f"changed.py: no test of its own for {path}", file=sys.stderr)
        found += tests
    print("\n".join(simplest(found)))


if __name__ == "__main__":
    main(sys.argv)
