"""The history's convention (docs/testing.md, `make check`): every commit subject since the
convention began fits on one line of at most 72 characters, the detail in the body."""

import subprocess

import pytest
from helpers import ROOT

SINCE = "be6dd75019a38b28b79f842c62d1c6f6536d9a4a"
"""The last commit before the convention (older subjects are history)."""


def test_commit_subjects_fit_on_one_line_of_72_characters():
    known = subprocess.run(["git", "cat-file", "-e", f"{SINCE}^{{commit}}"], cwd=ROOT,
                           capture_output=True)
    if known.returncode != 0:
        pytest.skip("this clone lacks the history (a shallow clone): nothing to check")
    subjects = subprocess.run(["git", "log", "--format=%s", f"{SINCE}..HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.splitlines()
    long = [s for s in subjects if len(s) > 72]
    assert not long, f"commit subjects over 72 characters: {long}"
