"""The API pages' summaries, readable in the repository: each public name's signature and the
first line of its docstring, written into docs/api/*.md from the code (``make api-docs``).

Each page names its modules and members in ``automodule`` directives, which the Sphinx site
renders in full (``make docs``); this script writes, between two marker lines under the page's
title, the same names as Markdown: a heading with the signature and the docstring's first
paragraph, and for a class its public methods and properties.  ``--check`` writes nothing and
exits 1 naming the pages that differ (tests/project/test_api_docs.py runs it).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

PAGES = Path(__file__).resolve().parent / "api"
BEGIN = ("<!-- summary: written by `make api-docs` (docs/api_summary.py) from the docstrings; "
         "edit those, not this -->")
END = "<!-- end of the written part -->"
_DIRECTIVE = re.compile(r"\.\. automodule:: (\S+)\n((?:   :members:.*\n)(?:             .*\n)*)?")


def directives(page: str) -> list[tuple[str, list[str] | None]]:
    """The ``(module, members)`` of each automodule directive of `page` (``None``: its
    ``__all__``)."""
    found = []
    for module, members in _DIRECTIVE.findall(page):
        names = members.replace(":members:", "").replace(",", " ").split()
        found.append((module, names or None))
    return found


def _default(value: object) -> str:
    if isinstance(value, type):
        return value.__name__
    text = repr(value)
    if " at 0x" in text:  # an object without a stable repr: MPI.SUM and the like
        name = getattr(value, "__name__", None) or _mpi_name(value)
        return name or "..."
    return text


def _mpi_name(value: object) -> str | None:
    from mpi4py import MPI
    for name in ("SUM", "PROD", "MAX", "MIN", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR"):
        if value is getattr(MPI, name):
            return f"MPI.{name}"
    return None


def signature(obj: object, method: bool = False) -> str:
    """`obj`'s parameters without annotations (a `method`'s without its first), defaults as
    written (``"(x, op=MPI.SUM)"``), or ``""`` for what is not callable."""
    if not callable(obj):
        return ""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    if method:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    parts = []
    for p in sig.parameters.values():
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text = "*" + text
        elif p.kind is p.VAR_KEYWORD:
            text = "**" + text
        if p.default is not p.empty:
            text += "=" + _default(p.default)
        parts.append(text)
    if any(p.kind is p.KEYWORD_ONLY for p in sig.parameters.values()) and \
            not any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
        first = next(i for i, p in enumerate(sig.parameters.values()) if p.kind is p.KEYWORD_ONLY)
        parts.insert(first, "*")
    return f"({', '.join(parts)})"


_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")


def first_line(doc: str | None) -> str:
    """The first paragraph of `doc`, on one line, its reST roles and literals as Markdown code
    (``""`` without a docstring)."""
    if not doc:
        return ""
    line = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    line = _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`",
                     line)
    return line.replace("``", "`")


def _item(text: str, doc: str | None) -> str:
    line = first_line(doc)
    return f"{text}: {line}" if line else text


def _own_doc(cls: type, name: str) -> str | None:
    """The docstring of `cls`'s `name`, or of the method of this package's that it overrides
    (not another library's: torch's ``forward`` says nothing of this one)."""
    for klass in cls.__mro__:
        value = vars(klass).get(name)
        if value is not None and klass.__module__.split(".")[0] == "tensorplay_mpi":
            doc = getattr(value, "__doc__", None)
            if doc:
                return doc
    return None


def _members(cls: type) -> list[str]:
    lines = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            lines.append(_item(f"- `.{name}` (property)", value.__doc__))
        elif isinstance(value, (staticmethod, classmethod)) or inspect.isfunction(value):
            function = getattr(cls, name)
            text = f"- `.{name}{signature(function, inspect.isfunction(value))}`"
            lines.append(_item(text, _own_doc(cls, name)))
    return lines


PUBLIC = ("tensorplay_mpi", "tensorplay_mpi.comm", "tensorplay_mpi.checkpoint",
          "tensorplay_mpi.evaluation.metrics", "tensorplay_mpi.optim", "tensorplay_mpi.parallel",
          "tensorplay_mpi.algorithms", "tensorplay_mpi.evaluation")
"""The modules users import from: a name they re-export is shown by its path there."""


def public_path(module_name: str, name: str, obj: object) -> str:
    """Where users import `obj` from: the first of :data:`PUBLIC` that has it, else its
    module."""
    if callable(obj):
        for public in PUBLIC:
            if getattr(importlib.import_module(public), name, None) is obj:
                return f"{public}.{name}"
    return f"{module_name}.{name}"


def summary(page: str) -> str:
    """The Markdown summary of the names `page`'s directives document."""
    out = []
    for module_name, names in directives(page):
        module = importlib.import_module(module_name)
        for name in names if names is not None else list(getattr(module, "__all__", [])):
            obj = getattr(module, name)
            kind = "class " if isinstance(obj, type) else ""
            value = "" if callable(obj) or len(repr(obj)) > 60 else f" = {obj!r}"
            path = public_path(module_name, name, obj)
            out.append(f"### {kind}`{path}{signature(obj)}{value}`\n")
            line = first_line(obj.__doc__) if callable(obj) else ""
            if line:
                out.append(line + "\n")
            if isinstance(obj, type):
                members = _members(obj)
                if members:
                    out.append("\n".join(members) + "\n")
    return "\n".join(out)


def rewritten(page: str) -> str:
    """`page` with its summary (re)written under its title."""
    if BEGIN in page:
        page = page[:page.index(BEGIN)] + page[page.index(END) + len(END):].lstrip("\n")
    title, _, rest = page.partition("\n")
    rest = rest.lstrip("\n")
    return f"{title}\n\n{BEGIN}\n\n## Summary\n\n{summary(page)}\n## Reference\n\n{END}\n\n{rest}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming the pages that differ")
    args = parser.parse_args(argv)
    stale, unchecked = [], []
    for path in sorted(PAGES.glob("*.md")):
        if path.name == "index.md":
            continue
        text = path.read_text()
        try:
            new = rewritten(text)
        except ImportError as error:  # an optional extra (torch, numba) is not installed
            unchecked.append(f"{path.name} ({error})")
            continue
        if new != text:
            stale.append(path.name)
            if not args.check:
                path.write_text(new)
    if unchecked:
        print(f"not checked, their modules do not import here: {'; '.join(unchecked)}")
    if args.check and stale:
        print(f"API summaries out of date: {', '.join(stale)}; run `make api-docs`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
