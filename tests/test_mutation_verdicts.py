"""``scripts/mutation_verdicts.py``: verdicts kept between mutation runs, and dropped for a
function whose source changed."""

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.modules import load_script


@pytest.fixture(scope="module")
def verdicts() -> ModuleType:
    return load_script("mutation_verdicts")


def write_meta(root: Path, codes: dict[str, int | None], hashes: dict[str, str]) -> Path:
    """A .meta file as mutmut writes it for spec/rules.py (the fields these scripts read)."""
    (root / "spec").mkdir(parents=True, exist_ok=True)
    path = root / "spec" / "rules.py.meta"
    path.write_text(json.dumps({"exit_code_by_key": codes, "hash_by_function_name": hashes}))
    return path


RUN = {
    "spec.rules.x_slot_index__mutmut_1": 1,
    "spec.rules.x_slot_index__mutmut_2": None,
    "spec.rules.x_slot_index__mutmut_3": 0,
    "spec.rules.xǁRulesǁwidth__mutmut_1": 37,
}
HASHES = {"x_slot_index": "aaaa", "xǁRulesǁwidth": "bbbb"}


def save_run(verdicts: ModuleType, tmp_path: Path) -> Path:
    """The verdicts file a save of the run ``RUN`` writes."""
    saved = tmp_path / "verdicts.txt"
    write_meta(tmp_path / "before", RUN, HASHES)
    verdicts.save(tmp_path / "before", saved)
    return saved


def test_saved_verdicts_come_back_for_unchanged_functions_only(
    verdicts: ModuleType, tmp_path: Path
) -> None:
    saved = tmp_path / "verdicts.txt"
    write_meta(tmp_path / "before", RUN, HASHES)
    assert verdicts.save(tmp_path / "before", saved) == 3
    assert saved.read_text().splitlines()[2:] == [
        "spec.rules.x_slot_index aaaa 1 - 0",
        "spec.rules.xǁRulesǁwidth bbbb 37",
    ]
    # A fresh tree: width's source changed since (another hash), slot_index's did not.
    fresh = dict.fromkeys(RUN)
    meta = write_meta(tmp_path / "after", fresh, {**HASHES, "xǁRulesǁwidth": "cccc"})
    assert verdicts.restore(tmp_path / "after", saved) == (2, 0)
    assert json.loads(meta.read_text())["exit_code_by_key"] == {
        **fresh,
        "spec.rules.x_slot_index__mutmut_1": 1,
        "spec.rules.x_slot_index__mutmut_3": 0,
    }


def test_a_verdict_of_this_run_is_not_overwritten_by_a_saved_one(
    verdicts: ModuleType, tmp_path: Path
) -> None:
    saved = save_run(verdicts, tmp_path)
    meta = write_meta(tmp_path / "after", {**RUN, "spec.rules.x_slot_index__mutmut_1": 0}, HASHES)
    assert verdicts.restore(tmp_path / "after", saved) == (0, 0)
    assert (
        json.loads(meta.read_text())["exit_code_by_key"]["spec.rules.x_slot_index__mutmut_1"] == 0
    )


def test_a_save_keeps_the_saved_verdicts_mutmut_forgot_for_unchanged_functions(
    verdicts: ModuleType, tmp_path: Path
) -> None:
    # mutmut forgets a function's verdicts when a test reaching it changes: a save after
    # such a run must not lose them, while a function edited since loses its own.
    saved = save_run(verdicts, tmp_path)
    forgotten = {**dict.fromkeys(RUN), "spec.rules.x_slot_index__mutmut_2": 0}
    write_meta(tmp_path / "after", forgotten, {**HASHES, "xǁRulesǁwidth": "cccc"})
    assert verdicts.save(tmp_path / "after", saved) == 3
    assert saved.read_text().splitlines()[2:] == [
        "spec.rules.x_slot_index aaaa 1 0 0",
        "spec.rules.xǁRulesǁwidth cccc -",
    ]


def test_a_verdict_cleared_in_the_file_is_cleared_in_mutmut_s_tree(
    verdicts: ModuleType, tmp_path: Path
) -> None:
    # A survivor killed by a new test is cleared by hand (`-`): mutants/ still holding its
    # survived verdict would never run it again, and count it as surviving.
    saved = save_run(verdicts, tmp_path)
    saved.write_text(saved.read_text().replace("aaaa 1 - 0", "aaaa 1 - -").replace("37", "-"))
    meta = write_meta(tmp_path / "after", RUN, {**HASHES, "xǁRulesǁwidth": "cccc"})
    assert verdicts.restore(tmp_path / "after", saved) == (0, 1)
    assert json.loads(meta.read_text())["exit_code_by_key"] == {
        **RUN,
        "spec.rules.x_slot_index__mutmut_3": None,
    }
