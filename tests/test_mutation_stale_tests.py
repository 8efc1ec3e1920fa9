"""``scripts/mutation_stale_tests.py``: a test edited since mutmut mapped it is mapped again."""

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.modules import load_script

OLD = """
def helper():
    return 1


def test_same():
    assert helper() == 1


def test_edited():
    assert helper() == 1


class TestMachine:
    def runTest(self):
        pass
"""
NEW = (
    OLD.replace("def helper():\n    return 1", "def helper():\n    return 2")
    .replace(
        "def test_edited():\n    assert helper() == 1", "def test_edited():\n    assert helper()"
    )
    .replace("pass", "assert True")
    + "\n\ndef test_new():\n    pass\n"
)


@pytest.fixture(scope="module")
def stale() -> ModuleType:
    return load_script("mutation_stale_tests")


def test_only_tests_whose_source_changed_are_stale_not_new_ones_or_helpers(
    stale: ModuleType,
) -> None:
    assert stale.changed_tests(OLD, NEW) == {"test_edited", "TestMachine"}
    assert stale.changed_tests(OLD, OLD) == set()


def test_a_test_is_its_parameters_and_methods_not_a_longer_name(stale: ModuleType) -> None:
    prefix = "tests/t.py::test_a"
    assert stale.is_node_of("tests/t.py::test_a", prefix)
    assert stale.is_node_of("tests/t.py::test_a[spec]", prefix)
    assert stale.is_node_of("tests/t.py::test_a::runTest", prefix)
    assert not stale.is_node_of("tests/t.py::test_ab", prefix)
    assert not stale.is_node_of("tests/u.py::test_a", prefix)


def test_dropping_takes_a_test_out_of_the_durations_and_every_function_map(
    stale: ModuleType,
) -> None:
    stats: dict[str, object] = {
        "duration_by_test": {
            "t.py::test_a[spec]": 0.1,
            "t.py::test_a[impl]": 0.1,
            "t.py::test_b": 1,
        },
        "tests_by_mangled_function_name": {
            "spec.x_f": ["t.py::test_a[spec]", "t.py::test_b"],
            "impl.x_g": ["t.py::test_a[impl]"],
        },
    }
    assert stale.drop(stats, {"t.py::test_a"}) == 2
    assert stats == {
        "duration_by_test": {"t.py::test_b": 1},
        "tests_by_mangled_function_name": {"spec.x_f": ["t.py::test_b"], "impl.x_g": []},
    }


def test_the_command_keeps_unchanged_tests(
    stale: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert stale.main(["--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "mutation_stale_tests: no stats yet, nothing to take out\n"
    node = f"tests/test_mutation_stale_tests.py::{test_the_command_keeps_unchanged_tests.__name__}"
    stats = {
        "git_commit": "HEAD",
        "duration_by_test": {node: 0.5},
        "tests_by_mangled_function_name": {"spec.x_f": [node]},
    }
    (tmp_path / "mutmut-stats.json").write_text(json.dumps(stats))
    assert stale.main(["--root", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "mutmut-stats.json").read_text()) == stats
    assert capsys.readouterr().out.startswith("mutation_stale_tests: 0 tests taken out")
