"""docs/api/*.md against the code: each page's summary (signatures and first docstring lines)
is what docs/api_summary.py writes from the code now."""

import ast
import importlib.util
import re

from helpers import ROOT

PAGES = ROOT / "docs" / "api"


def _summary_script():
    spec = importlib.util.spec_from_file_location("api_summary", ROOT / "docs" / "api_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_api_page_carries_the_summary_of_its_code(capsys):
    assert _summary_script().main(["--check"]) == 0, capsys.readouterr().out


def test_a_stale_summary_is_rewritten_and_the_rest_of_the_page_kept():
    script = _summary_script()
    page = (PAGES / "join.md").read_text()
    stale = page.replace("Context manager that lets ranks", "An outdated description of", 1)
    assert stale != page and script.rewritten(stale) == page
    bare = page[:page.index(script.BEGIN)] + page[page.index(script.END) + len(script.END):]
    assert script.rewritten(bare.replace("\n\n\n", "\n\n")) == page  # a page without one


def test_every_public_name_of_the_facade_has_a_summary():
    text = "".join(p.read_text() for p in PAGES.glob("*.md"))
    import tensorplay_mpi
    missing = [name for name in tensorplay_mpi.__all__
               if name[0].isupper() and f".{name}(" not in text]
    assert not missing, f"public classes without a summary in docs/api: {missing}"


def _reexports(path):
    """Whether the module at `path` only re-exports: a package's ``__init__.py``, or a module
    of imports and ``__all__`` alone (the public paths kept, ``metrics.py``...)."""
    body = ast.parse(path.read_text()).body[1:]  # after the docstring
    return path.name == "__init__.py" or all(
        isinstance(node, (ast.Import, ast.ImportFrom)) or isinstance(node, ast.Assign)
        and [ast.unparse(target) for target in node.targets] == ["__all__"] for node in body)


def test_every_module_with_code_of_its_own_has_a_page():
    documented = {m for page in PAGES.glob("*.md")
                  for m in re.findall(r"automodule:: (\S+)", page.read_text())}
    missing = [module for path in sorted((ROOT / "tensorplay_mpi").rglob("*.py"))
               if not _reexports(path) and "examples" not in path.parts
               and (module := ".".join(path.relative_to(ROOT).with_suffix("").parts))
               not in documented]
    assert not missing, f"modules without an API page in docs/api: {missing}"
