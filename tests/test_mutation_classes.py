"""``scripts/mutation_classes.py``: which mutants it calls equivalent without running them,
read from mutated sources written as mutmut writes them."""

import ast
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.modules import REPO, load_script


@pytest.fixture(scope="module")
def classes() -> ModuleType:
    return load_script("mutation_classes")


ZIP = "    for a, b in zip(xs, ys, strict=True):\n        total += a * b\n"
WRAPPED = "    for a, b in zip(\n        xs, ys, strict=True\n    ):\n        total += a * b\n"
ASSERT = '    assert total >= 0, "a total is never negative"\n    return total\n'


@pytest.mark.parametrize(
    ("original", "mutant", "kind"),
    [
        (ZIP, ZIP.replace("strict=True", "strict=False"), "zip-strict"),
        (ZIP, ZIP.replace("strict=True", "strict=None"), "zip-strict"),
        (ZIP, ZIP.replace(", strict=True", ", "), "zip-strict"),
        (ZIP, ZIP.replace(", strict=True", ""), "zip-strict"),
        (ZIP, ZIP.replace("zip(xs,", "zip(None,"), None),  # the pairing itself changed
        (ZIP, ZIP.replace("strict=True", "strict=False").replace("a * b", "a / b"), None),
        (WRAPPED, WRAPPED.replace("strict=True", "strict=None"), "zip-strict"),
        (WRAPPED, WRAPPED.replace(" strict=True\n    ):", " ):"), "zip-strict"),
        (WRAPPED, WRAPPED.replace("ys, strict=True", "None, strict=False"), None),
        (ASSERT, ASSERT.replace('"a total', '"XXa total'), "assert-message"),
        (ASSERT, ASSERT.replace('"a total is never negative"', "None"), "assert-message"),
        (ASSERT, ASSERT.replace(">= 0", "> 0"), None),  # the test itself changed
        (ASSERT, ASSERT.replace("return total", "return None"), None),
    ],
)
def test_a_mutant_is_in_a_class_only_when_that_change_is_all_its_diff(
    classes: ModuleType, original: str, mutant: str, kind: str | None
) -> None:
    assert classes.equivalence_class(original, mutant, False) == kind


def test_a_loosened_zip_in_an_invariant_predicate_is_run(classes: ModuleType) -> None:
    loosened = ZIP.replace("strict=True", "strict=False")
    assert classes.equivalence_class(ZIP, loosened, True) is None


def test_every_strict_keyword_in_spec_and_impl_is_zips() -> None:
    """What lets the zip-strict class look for ``strict=True`` alone."""
    root = REPO
    calls = [
        node
        for path in [*root.glob("spec/*.py"), *root.glob("impl/*.py")]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and any(k.arg == "strict" for k in node.keywords)
    ]
    assert calls, "no strict= keyword found"
    assert {ast.unparse(call.func) for call in calls} == {"zip"}


MUTATED = """
def x_total__mutmut_orig(xs, ys):
    total = 0
    for a, b in zip(xs, ys, strict=True):
        total += a * b
    return total


def x_total__mutmut_1(xs, ys):
    total = 0
    for a, b in zip(xs, ys, strict=False):
        total += a * b
    return total


def x_total__mutmut_2(xs, ys):
    total = 1
    for a, b in zip(xs, ys, strict=True):
        total += a * b
    return total


def x_total__mutmut_3(xs, ys):
    total = 0
    for a, b in zip(xs, ys, strict=True):
        total -= a * b
    return total


def x_total__mutmut_4(xs, ys):
    total = None
    for a, b in zip(xs, ys, strict=True):
        total += a * b
    return total


class Pool:
    def xǁPoolǁtake__mutmut_orig(self, count):
        assert count >= 0, "a count is never negative"
        return count

    def xǁPoolǁtake__mutmut_1(self, count):
        assert count >= 0, "XXa count is never negative"
        return count
"""


def test_the_names_and_verdicts_are_mutmuts_and_only_mutants_without_one_are_to_run(
    classes: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "rules.py").write_text(MUTATED)
    verdicts = {
        "spec.rules.x_total__mutmut_1": 0,
        "spec.rules.x_total__mutmut_2": None,
        "spec.rules.x_total__mutmut_3": 1,
        "spec.rules.x_total__mutmut_4": 37,  # mutmut's code: caught by the type checker
    }
    meta = {"exit_code_by_key": verdicts}
    (tmp_path / "spec" / "rules.py.meta").write_text(json.dumps(meta))
    assert list(classes.mutant_names(tmp_path, {})) == [
        ("spec.rules.x_total__mutmut_1", "zip-strict"),
        ("spec.rules.x_total__mutmut_2", None),
        ("spec.rules.x_total__mutmut_3", None),
        ("spec.rules.x_total__mutmut_4", None),
        ("spec.rules.xǁPoolǁtake__mutmut_1", "assert-message"),
    ]
    assert classes.verdicts(tmp_path) == verdicts
    assert classes.names_to_run(tmp_path, {}) == ["spec.rules.x_total__mutmut_2"]
    assert classes.summary(tmp_path, {}) == (
        "mutation: 5 mutants: 2 killed (1 by mypy --strict, 0 by timeout), 0 survived, "
        "0 without tests, "
        "0 suspicious, 2 equivalent by class and 0 explained as equivalent (set aside), "
        "1 not run yet; "
        "killed 100.0% of those run"
    )


def test_an_explained_mutant_is_not_run_until_its_function_changes(
    classes: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "rules.py").write_text(MUTATED)
    name = "spec.rules.x_total__mutmut_2"
    sources = {n: original for n, original, _ in classes.mutant_sources(tmp_path)}
    listing = tmp_path / "equivalent.txt"
    listing.write_text(f"# a comment\n{name} {classes.digest(sources[name])} why, in words\n")
    listed = classes.explained(listing)
    assert dict(classes.mutant_names(tmp_path, listed))[name] == "explained"
    assert name not in classes.names_to_run(tmp_path, listed)
    stale = {name: classes.digest(sources[name] + "\n    total += 1")}
    assert dict(classes.mutant_names(tmp_path, stale))[name] is None
    assert name in classes.names_to_run(tmp_path, stale)
    assert classes.explained(tmp_path / "missing.txt") == {}


def test_a_digest_asked_of_a_mutant_that_is_gone_is_one_line_and_exit_2(
    classes: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """How a stale line of the equivalent listing shows: its function is gone."""
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "rules.py").write_text(MUTATED)
    known, gone = "spec.rules.x_total__mutmut_1", "spec.rules.x_gone__mutmut_1"
    argv = ["mutation_classes.py", "--root", str(tmp_path), "--digest", known, gone]
    monkeypatch.setattr(sys, "argv", argv)
    assert classes.main() == 2
    out, err = capsys.readouterr()
    assert out.split(" ")[0] == known and len(out.splitlines()) == 1
    assert err == f"mutation_classes: no mutant {gone} in {tmp_path}/\n"
