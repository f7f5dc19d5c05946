"""``make check``'s map from a changed file to its tests (tests/changed.py), and the layout it
relies on: the test tree mirrors the package (docs/testing.md)."""

import pytest
from changed import ROOT, TESTS, simplest, targets_of

PACKAGE = ROOT / "tensorplay_mpi"
# The folders of tests/ that are no package folder: the root modules' (data.py, stopping.py;
# process/: _process.py, _threads.py, settings.py, info.py, testing.py), the project's (docs,
# examples, packaging, Slurm templates), the launched programs, across hosts, on Slurm.
NOT_PACKAGE_FOLDERS = {"data", "stopping", "process", "project", "programs", "multihost", "slurm"}
# The package folders without a test folder: the examples run in tests/project/test_examples.py
# (and the demos' stops in tests/stopping/), found by the files that name them.
UNMIRRORED = {"examples"}


@pytest.mark.parametrize("path, tests", [
    ("tensorplay_mpi/comm/_collectives.py", ["tests/comm/"]),  # the folder of its package
    ("tensorplay_mpi/comm/__init__.py", ["tests/comm/"]),
    ("tensorplay_mpi/comm/_torch_cuda.py", ["tests/comm/"]),
    ("tensorplay_mpi/algorithms/join.py", ["tests/algorithms/"]),
    ("tensorplay_mpi/algorithms/_joinable_comm.py", ["tests/algorithms/"]),
    ("tensorplay_mpi/_process.py", ["tests/process/"]),  # a root module with a folder
    ("tensorplay_mpi/_threads.py", ["tests/process/test_threads.py"]),  # private: its name
    ("tensorplay_mpi/info.py", ["tests/process/test_info.py"]),  # test files of its name
    ("tensorplay_mpi/_replicas.py", ["tests/algorithms/test_replicas.py"]),  # in any folder
    ("tensorplay_mpi/__init__.py", ["tests/project/test_api_docs.py",  # the facade's names
                                    "tests/project/test_api_index.py"]),
    ("tests/algorithms/test_join.py", ["tests/algorithms/test_join.py"]),  # a test file: itself
    ("docs/stopping.md", ["tests/project/test_docs.py"]),
    ("tests/conftest.py", []),  # everything: make test
    ("tensorplay_mpi/no_such_module.py", []),  # deleted: nothing to run
])
def test_a_changed_file_maps_to_its_tests(path, tests):
    assert targets_of(path) == tests


def test_a_launched_program_maps_to_the_tests_that_launch_it():
    assert "tests/parallel/test_update.py" in targets_of("tests/programs/update_failure.py")


def test_a_module_without_a_folder_of_its_name_maps_to_the_tests_that_name_it():
    tests = targets_of("tensorplay_mpi/examples/train_torch.py")
    assert "tests/project/test_examples.py" in tests
    assert all(path.startswith("tests/") and "/test_" in path for path in tests)


def test_a_private_module_without_a_folder_maps_to_the_tests_that_import_it():
    tests = targets_of("tensorplay_mpi/_resets.py")
    assert "tests/process/test_process.py" in tests  # from tensorplay_mpi._resets import ...
    assert "tests/project/test_api_index.py" in tests  # from tensorplay_mpi import _resets


def test_a_folder_takes_the_place_of_its_files():
    assert simplest(["tests/comm/test_comm.py", "tests/comm/", "tests/algorithms/test_join.py",
                     "tests/comm/"]) == ["tests/algorithms/test_join.py", "tests/comm/"]


def test_the_test_tree_mirrors_the_package():
    """tensorplay_mpi/X/ is tested in tests/X/; any other test folder is a root module's, the
    project's, or a launcher's (so that a test file of a module lands where changed.py runs it)."""
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert packages - UNMIRRORED <= folders, "package folders without tests/X/"
    assert folders - packages <= NOT_PACKAGE_FOLDERS, "test folders that mirror nothing"


def test_every_module_of_the_package_has_tests_to_run():
    unmapped = [str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*.py"))
                if not targets_of(str(p.relative_to(ROOT)))]
    assert unmapped == []


def test_no_serial_and_mpi_pair_of_files():
    """One file per subject, its serial and its MPI tests side by side (the marker chooses):
    no tests/X/test_Y.py beside a tests/X/test_Y_mpi.py, and test file names unique."""
    files = [p.relative_to(TESTS) for p in TESTS.rglob("test_*.py")]
    pairs = [f for f in files if f.name.endswith("_mpi.py")
             and f.with_name(f.name.removesuffix("_mpi.py") + ".py") in files]
    assert pairs == []
    names = [f.name for f in files]
    assert len(names) == len(set(names)), "two test files of one name (pytest's rootdir import)"
