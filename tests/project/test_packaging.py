"""What a user or a site checks first: the wheel's contents and metadata, licence, changelog."""

import inspect
import pkgutil
import re
import subprocess
import sys
import zipfile
from importlib import import_module

from helpers import ROOT

import tensorplay_mpi


def test_the_wheel_ships_py_typed_the_licence_and_its_dependencies(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                             str(tmp_path), str(ROOT)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("tensorplay_mpi-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = archive.read(metadata).decode()
    assert "tensorplay_mpi/py.typed" in names
    assert any(n.endswith("licenses/LICENSE") for n in names), names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    assert f"Version: {tensorplay_mpi.__version__}" in meta
    assert "License-Expression: BSD-3-Clause" in meta
    for requirement in ("mpi4py>=4", "numpy", "threadpoolctl>=3"):
        assert f"Requires-Dist: {requirement}" in meta, meta
    assert "Requires-Dist: scikit-learn; extra == \"examples\"" in meta


def test_the_licence_is_bsd_3_clause():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    assert "Neither the name of the copyright holder" in text


def test_the_changelog_keeps_a_changelog_with_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "https://keepachangelog.com/" in text
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert versions[0] == "Unreleased" and tensorplay_mpi.__version__ in versions
    sections = set(re.findall(r"^### (\w+)", text, re.M))
    assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def test_make_help_lists_every_target_once():
    """Each phony target has one rule (one recipe) and one line in `make help`."""
    makefile = (ROOT / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY:(.*?)\n\n", makefile, re.M | re.S).group(1)
                .replace("\\", " ").split())
    for target in phony:
        assert len(re.findall(rf"^{target}:", makefile, re.M)) == 1, target
    result = subprocess.run(["make", "-s", "-C", str(ROOT), "help"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    listed = re.findall(r"^  make (\S+) +\S", result.stdout, re.M)
    assert sorted(listed) == sorted(phony)


def test_no_two_class_names_are_the_same_words_in_another_order():
    """`CommJoinable` beside `JoinableComm` read as one name: class names must differ in words."""
    classes = set()
    for module in pkgutil.walk_packages(tensorplay_mpi.__path__, "tensorplay_mpi."):
        if ".examples" in module.name:
            continue
        found = inspect.getmembers(import_module(module.name), inspect.isclass)
        classes |= {cls.__name__ for _, cls in found if cls.__module__.startswith("tensorplay_")}
    words = {}
    for name in sorted(classes):
        key = tuple(sorted(re.findall(r"[A-Z][a-z0-9]*", name.lstrip("_"))))
        assert key not in words, f"{name} and {words[key]} are the same words"
        words[key] = name


def test_numba_is_a_dependency_exactly_where_it_has_wheels():
    """The default install brings the fused optimizer steps where PyPI has numba's wheels; other
    platforms install without it (the NumPy rules) instead of failing to build it."""
    from packaging.markers import Marker

    text = (ROOT / "pyproject.toml").read_text()
    (marker,) = re.findall(r'"numba>=[\d.]+; (.+)",', text)
    cases = {("Linux", "x86_64", "3.10"): True, ("Linux", "aarch64", "3.14"): True,
             ("Darwin", "arm64", "3.12"): True, ("Windows", "AMD64", "3.13"): True,
             ("Darwin", "x86_64", "3.12"): False, ("Windows", "ARM64", "3.12"): False,
             ("Linux", "ppc64le", "3.12"): False, ("Linux", "x86_64", "3.15"): False}
    for (system, machine, python), expected in cases.items():
        env = {"platform_system": system, "platform_machine": machine, "python_version": python}
        assert Marker(marker).evaluate(env) is expected, (system, machine, python)
