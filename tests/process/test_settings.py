"""The TENSORPLAY_MPI_* settings: parsed once, a bad value a ValueError naming the variable."""

import pytest

from tensorplay_mpi.settings import settings
from tensorplay_mpi.testing import reset_settings


@pytest.mark.parametrize("name", ["TENSORPLAY_MPI_TIMEOUT", "TENSORPLAY_MPI_GRACE"])
def test_a_bad_seconds_variable_is_a_value_error(monkeypatch, name):
    monkeypatch.setenv(name, "soon")
    reset_settings()
    with pytest.raises(ValueError, match=f"{name} must be a positive number of seconds, "
                                         "got 'soon'"):
        settings()


@pytest.mark.parametrize("text, on", [("1", True), ("true", True), ("YES", True), ("on", True),
                                      ("0", False), ("False", False), ("no", False), ("", False)])
def test_debug_accepts_the_usual_spellings(monkeypatch, text, on):
    monkeypatch.setenv("TENSORPLAY_MPI_DEBUG", text)
    reset_settings()
    assert settings().debug is on


def test_an_unknown_debug_value_is_a_value_error(monkeypatch):
    monkeypatch.setenv("TENSORPLAY_MPI_DEBUG", "maybe")
    reset_settings()
    with pytest.raises(ValueError, match="TENSORPLAY_MPI_DEBUG must be one of 1/true/yes/on or "
                                         "0/false/no/off, got 'maybe'"):
        settings()


def _documented_settings():
    """(variable, default) of each row of the table in the settings module's docstring, parsed
    by docutils as Sphinx parses it for the settings page (a table that does not parse is
    rendered as no table)."""
    docutils_core = pytest.importorskip("docutils.core")
    from docutils import nodes

    import tensorplay_mpi.settings as module

    tree = docutils_core.publish_doctree(module.__doc__,
                                         settings_overrides={"report_level": 5})
    tables = list(tree.findall(nodes.table))
    assert len(tables) == 1, f"expected one table in the settings docstring, got {len(tables)}"
    header = [entry.astext() for entry in next(tables[0].findall(nodes.thead)).findall(nodes.entry)]
    assert header == ["variable", "meaning", "default"]
    body = next(tables[0].findall(nodes.tbody))
    return [tuple(entry.astext() for entry in row.findall(nodes.entry))
            for row in body.findall(nodes.row)]


def _shown(default):
    """A default as the table shows it: 1/0 for booleans, whole seconds without a point."""
    if isinstance(default, bool):
        return str(int(default))
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def test_the_settings_table_lists_every_field_with_its_default():
    from dataclasses import fields

    from tensorplay_mpi.settings import Settings

    rows = _documented_settings()
    assert [(variable, default) for variable, _, default in rows] == [
        (f"TENSORPLAY_MPI_{field.name.upper()}", _shown(field.default))
        for field in fields(Settings)]
