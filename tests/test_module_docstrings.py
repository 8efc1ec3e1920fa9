"""Every module says its job: each ``.py`` file of ``spec/``, ``impl/``, ``harness/`` and
``scripts/`` opens with a docstring whose first paragraph is that job, in a sentence.

This replaces a line cap (``docs/decisions.md``, 2026-12-07): where a module's code goes is
decided by the job it states, not by its length. What a test can check is that the
statement is there and is a sentence: the docstring exists, its text starts on the opening
line, and its first paragraph ends with a full stop. Whether it states one job (a module
that needs "and" for it is two) is the reviewer's.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("spec", "impl", "harness", "scripts")


def job_statement_fault(source: str) -> str | None:
    """Why a module's source does not open with its job in a sentence, or ``None`` if it does."""
    docstring = ast.get_docstring(ast.parse(source), clean=False)
    if docstring is None or not docstring.strip():
        return "no module docstring"
    if not docstring.splitlines()[0].strip():
        return "the docstring's first line is empty (its job goes on the opening line)"
    first_paragraph = docstring.strip().split("\n\n", 1)[0].rstrip()
    if not first_paragraph.endswith("."):
        return "the docstring's first paragraph is not a sentence ending with a full stop"
    return None


def modules(*folders: str) -> list[Path]:
    """Every ``.py`` file under ``folders``, sorted."""
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def test_every_module_opens_with_its_job() -> None:
    paths = modules(*FOLDERS)
    assert len(paths) > 100, "too few modules found: the walk is broken"
    faults = {
        str(path.relative_to(ROOT)): fault
        for path in paths
        if (fault := job_statement_fault(path.read_text(encoding="utf-8"))) is not None
    }
    assert faults == {}, f"modules that do not state their job: {faults}"


@pytest.mark.parametrize(
    ("source", "fault"),
    [
        ("import sys\n", "no module docstring"),
        ('""""""\nimport sys\n', "no module docstring"),
        ('x = 1\n"""Not the module docstring: code comes first."""\n', "no module docstring"),
        ('"""\nThe job, one line down.\n"""\n', "the docstring's first line is empty"),
        ('"""The job, cut off\n\nMore."""\n', "not a sentence"),
        ('"""The pool\n"""\n', "not a sentence"),
    ],
)
def test_a_planted_module_without_its_job_is_caught(source: str, fault: str) -> None:
    found = job_statement_fault(source)
    assert found is not None and fault in found


@pytest.mark.parametrize(
    "source",
    [
        '"""The paged KV pool: where K/V tensors live."""\n',
        '"""A job that runs over\ntwo lines, then stops.\n\nDetails."""\nimport sys\n',
    ],
)
def test_a_module_that_states_its_job_passes(source: str) -> None:
    assert job_statement_fault(source) is None
