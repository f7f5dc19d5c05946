"""docs/api/index.md against the code: the facade's table lists its ``__all__``; the layout
table lists every module on disk, bottom up (each imports only those in its row or above), a
public module alone in its row and the private ones by folder; the state table lists every
module that holds process-wide state, and its resets are those the modules register."""

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
from helpers import ROOT

import tensorplay_mpi
from tensorplay_mpi import _resets

PACKAGE = ROOT / "tensorplay_mpi"
INDEX = ROOT / "docs" / "api" / "index.md"


def _table(heading_text, first_header):
    """The first column's backticked names of each row of the table under `heading_text`."""
    text = INDEX.read_text()
    section = text[text.index(heading_text):] if heading_text else text
    lines = section[section.index(f"| {first_header} |"):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _modules():
    """Every module of the package, as its path below tensorplay_mpi/ (``algorithms/join.py``),
    each folder's ``__init__.py`` (its public face) included."""
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def _private(module):
    """Whether `module` (a path below tensorplay_mpi/) is private: a part of it starts with
    ``_``, but a package's ``__init__.py``, which stands for its folder."""
    parts = Path(module).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return any(part.startswith("_") for part in parts)


def _row_of(module, rows):
    """The index of the layout row that covers `module` (a file, or a folder's entry)."""
    for i, names in enumerate(rows):
        for name in names:
            if name == module or name.endswith("/") and module.startswith(name):
                return i
    return None


def _layout_rows():
    return [re.findall(r"`([^`]+)`", row[0]) for row in _table("## The layers", "module")]


def test_the_facade_table_lists_the_facade_s_names():
    listed = {name for row in _table("## The facade", "names")
              for name in re.findall(r"`([^`]+)`", row[0])}
    assert listed == set(tensorplay_mpi.__all__)


def test_a_row_is_one_public_module_or_the_private_modules_of_one_folder():
    wrong = []
    for names in _layout_rows():
        private = [name for name in names if not name.endswith("/") and _private(name)]
        if private and (len(private) != len(names)
                        or len({str(Path(name).parent) for name in names}) != 1):
            wrong.append(names)  # private modules of one folder only
        elif not private and len(names) != 1:
            wrong.append(names)  # a public module alone
    assert not wrong, f"rows of the layout table that mix modules: {wrong}"


def test_a_private_module_carries_no_all_and_a_public_one_does():
    """The names of a private module are not API: no ``__all__`` says otherwise; a public
    module lists what users call (examples aside: programs to run)."""
    wrong = [module for module in _modules() if not module.startswith("examples/")
             and ("__all__" in _assigned(module)) == _private(module)]
    assert not wrong, f"private modules with an __all__, or public ones without: {wrong}"


def _assigned(module):
    """The names `module` assigns at its top level."""
    tree = ast.parse((PACKAGE / module).read_text())
    return {ast.unparse(target) for node in tree.body if isinstance(node, ast.Assign)
            for target in node.targets}


def test_every_module_on_disk_has_a_row_and_every_row_a_module():
    rows = _layout_rows()
    modules = _modules()
    missing = [m for m in modules if _row_of(m, rows) is None]
    assert not missing, f"modules missing from the layout table of docs/api/index.md: {missing}"
    absent = [n for names in rows for n in names
              if not any(m == n or n.endswith("/") and m.startswith(n) for m in modules)]
    assert not absent, f"the layout table names modules that do not exist: {absent}"


def _runtime_nodes(tree):
    """Every node of `tree` but those under ``if TYPE_CHECKING:`` (annotations only: a
    module may name a type of a row below it, as ``algorithms/_requests.py`` names ``Join``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _file(parts):
    """The file of the module or package `parts` names below tensorplay_mpi/, else None."""
    for candidate in ("/".join(parts) + ".py", "/".join([*parts, "__init__.py"])):
        if (PACKAGE / candidate).is_file():
            return candidate
    return None


def _targets(module):
    """The files `module` imports at run time, as written (a package: its ``__init__.py``)."""
    parts = list(Path(module).parent.parts)
    for node in _runtime_nodes(ast.parse((PACKAGE / module).read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tensorplay_mpi":
                    yield _file(alias.name.split(".")[1:])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[:len(parts) - (node.level - 1)]
            elif (node.module or "").split(".")[0] == "tensorplay_mpi":
                base, node = [], ast.ImportFrom(module=node.module[len("tensorplay_mpi") + 1:],
                                                names=node.names, level=1)
            else:
                continue
            target = base + (node.module.split(".") if node.module else [])
            for alias in node.names:  # a submodule by that name, else the module itself
                yield _file([*target, alias.name]) or _file(target)


def _imports(module, seen=None):
    """The modules of the layout table that `module` imports: an ``__init__.py`` that no row
    names (the facade, ``algorithms/__init__.py``) stands for what it imports in turn."""
    seen = set() if seen is None else seen
    found = set()
    for target in _targets(module):
        if target is None or target == module or target in seen:
            continue
        if target.endswith("__init__.py") and target not in _modules():
            seen.add(target)
            found |= _imports(target, seen)
        else:
            found.add(target)
    return found


def test_the_package_root_holds_at_most_15_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 15, f"{len(root)} modules at the package root: {root}"


def test_each_module_imports_only_its_row_and_the_rows_above():
    rows = _layout_rows()
    upward = [f"{m} (row {_row_of(m, rows) + 1}) imports {i} (row {_row_of(i, rows) + 1})"
              for m in _modules() for i in sorted(_imports(m))
              if None not in (_row_of(i, rows), _row_of(m, rows))
              and _row_of(i, rows) > _row_of(m, rows)]
    assert not upward, "imports against the layout table's order: " + "; ".join(upward)


_EMPTY_CONTAINERS = ("set", "dict", "list", "WeakValueDictionary", "WeakKeyDictionary",
                     "Create_keyval")


def _holds_state(module):
    """Why `module` holds process-wide state, by its source, else None: a ``global``
    statement, a cached function, an empty mutable container or a keyval at module level, an
    exit hook, a hook or handler of the interpreter's, an attribute set on a caller's object."""
    tree = ast.parse((PACKAGE / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            return f"global {', '.join(node.names)}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                name = ast.unparse(decorator)
                if "lru_cache" in name or name.endswith("cache"):
                    return f"cached {node.name}"
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called in ("atexit.register", "signal.signal", "setattr"):
                return called
        if isinstance(node, ast.Assign) and any(
                ast.unparse(t) in ("sys.excepthook", "sys.exit") for t in node.targets):
            return "an interpreter hook"
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, (ast.Dict, ast.Set, ast.List)) and not getattr(
                value, "keys", getattr(value, "elts", None)):
            return f"an empty container {ast.unparse(node)}"
        if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] \
                in _EMPTY_CONTAINERS and not value.args:
            return ast.unparse(node).splitlines()[0]
    return None


def _state_modules():
    return {re.findall(r"`([^`]+)`", row[1])[0] for row in _table("## Process-wide state",
                                                                   "state")}


@pytest.mark.parametrize("module", [m for m in _modules()
                                    if not m.startswith("examples/")])
def test_a_module_that_holds_process_wide_state_is_in_the_state_table(module):
    why = _holds_state(module)
    if why is None:
        assert module not in _state_modules(), \
            f"{module} is in the state table of docs/api/index.md but holds no state"
    else:
        assert module in _state_modules(), (
            f"{module} holds process-wide state ({why}) but is not in the state table of "
            "docs/api/index.md")


def _every_module_imported():
    """Every module of the package imported (examples aside; a torch-only one where torch
    imports), so that each has registered its resets."""
    for info in pkgutil.walk_packages(tensorplay_mpi.__path__, "tensorplay_mpi."):
        if ".examples" not in info.name:
            try:
                importlib.import_module(info.name)
            except ImportError:
                pass  # an optional extra (torch): its module holds nothing to reset


def _path_of(module_name):
    """``tensorplay_mpi.comm._buffers`` -> ``comm/_buffers.py``."""
    parts = module_name.split(".")[1:]
    return _file(parts) if parts else "__init__.py"


def test_the_state_table_s_resets_are_those_the_modules_register():
    """A module that forgets to register a reset the table promises, or registers one the
    table does not show, fails here."""
    _every_module_imported()
    shown = sorted((module.strip("`"), reset) for _, module, _, reset in
                   _table("## Process-wide state", "state") if not reset.startswith("—"))
    registered = sorted((_path_of(entry.module),
                         f"`{entry.module.removeprefix('tensorplay_mpi.')}.{entry.name}()`")
                        for entry in _resets.registered())
    assert shown == registered


@pytest.mark.parametrize("module", [m for m in _modules() if not m.startswith("examples/")])
def test_every_cached_function_registers_its_reset(module):
    """A decision cached for the process (``lru_cache``) must be resettable by the testing
    helpers: its module registers ``cache_clear`` at import."""
    tree = ast.parse((PACKAGE / module).read_text())
    cached = [node.name for node in ast.walk(tree)
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
              and any("cache" in ast.unparse(d) for d in node.decorator_list)]
    if not cached:
        return
    _every_module_imported()
    name = ".".join(Path(module).with_suffix("").parts).removesuffix(".__init__")
    names = {entry.name for entry in _resets.registered()
             if entry.module == f"tensorplay_mpi.{name}"}
    missing = [f for f in cached if f"{f}.cache_clear" not in names]
    assert not missing, f"{module}: cached without a registered reset: {missing}"

