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
