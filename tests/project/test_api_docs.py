"""docs/api/*.md against the code: each page's summary (signatures and first docstring lines)
is what docs/api_summary.py writes from the code now."""

import importlib.util
import pkgutil
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


def _public_modules():
    """Every public module of the package (no part of its name starts with ``_``), examples
    aside."""
    import tensorplay_mpi
    return ["tensorplay_mpi"] + [
        info.name for info in pkgutil.walk_packages(tensorplay_mpi.__path__, "tensorplay_mpi.")
        if ".examples" not in info.name
        and not any(part.startswith("_") for part in info.name.split("."))]


def test_every_public_module_has_a_page_and_no_private_one_has():
    """One page per public module (the facade's is the index: its table); a private module's
    names are not API, so no page documents it."""
    documented = [m for page in PAGES.glob("*.md")
                  for m in re.findall(r"automodule:: (\S+)", page.read_text())]
    missing = [m for m in _public_modules() if m != "tensorplay_mpi" and m not in documented]
    assert not missing, f"public modules without an API page in docs/api: {missing}"
    private = [m for m in documented if any(part.startswith("_") for part in m.split("."))]
    assert not private, f"API pages of private modules: {private}"
    assert len(documented) == len(set(documented)), "a module documented on two pages"
