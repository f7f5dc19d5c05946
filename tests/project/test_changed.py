"""``make check``'s map from a changed file to its tests (tests/changed.py)."""

import pytest
from changed import simplest, targets_of


@pytest.mark.parametrize("path, tests", [
    ("tensorplay_mpi/comm/_collectives.py", ["tests/comm/"]),  # the folder of its package
    ("tensorplay_mpi/comm/__init__.py", ["tests/comm/"]),
    ("tensorplay_mpi/_process.py", ["tests/process/"]),  # a root module with a folder
    ("tensorplay_mpi/_threads.py", ["tests/process/test_threads.py"]),  # private: its name
    ("tensorplay_mpi/info.py", ["tests/process/test_info.py"]),  # test files of its name
    ("tests/join/test_join.py", ["tests/join/test_join.py"]),  # a test file: itself
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
    assert simplest(["tests/comm/test_comm.py", "tests/comm/", "tests/join/test_join.py",
                     "tests/comm/"]) == ["tests/comm/", "tests/join/test_join.py"]
