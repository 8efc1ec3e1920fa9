"""``docs/harness.md``'s map is the tree: every module of ``harness/`` has a row, and every
path a row names exists.

A row's first cell names its modules in backticks: a path from the repository's root
(``harness/runtime/flex_paged.py``), then, in the same cell, bare file names in that
path's folder (``varlen_kernel.py``). A package's ``__init__.py`` needs a row only when it
holds code of its own (``harness/__init__.py``'s lazy public names, the kit's target
registry); one that is a docstring, imports and ``__all__`` is the package's table of
contents, said by its modules' rows.
"""

import ast
import re
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS_MD = ROOT / "docs" / "harness.md"


def map_section(document: str) -> str:
    """The text of the ``## Map`` section of ``docs/harness.md``."""
    section = document.split("\n## Map\n", 1)[1]
    return section.split("\n## ", 1)[0]


def mapped_paths(document: str) -> list[str]:
    """The paths the map's rows name, in order, each from the repository's root."""
    paths: list[str] = []
    for line in map_section(document).splitlines():
        if not line.startswith("| `"):
            continue
        folder: PurePosixPath | None = None
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "/" in name:
                path = PurePosixPath(name)
                folder = path.parent
            else:
                assert folder is not None, f"a bare name before any path: {line}"
                path = folder / name
            paths.append(str(path))
    return paths


def has_code_of_its_own(source: str) -> bool:
    """Whether a module is more than a docstring, imports and ``__all__``."""
    for statement in ast.parse(source).body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # the docstring
        if isinstance(statement, ast.Import | ast.ImportFrom):
            continue
        if isinstance(statement, ast.Assign) and [
            target.id for target in statement.targets if isinstance(target, ast.Name)
        ] == ["__all__"]:
            continue
        return True
    return False


def modules_needing_a_row(root: Path) -> set[str]:
    """Every module of ``root/harness`` the map must list, by path from ``root``."""
    return {
        path.relative_to(root).as_posix()
        for path in (root / "harness").rglob("*.py")
        if path.name != "__init__.py" or has_code_of_its_own(path.read_text(encoding="utf-8"))
    }


def map_faults(root: Path, document: str) -> list[str]:
    """What is wrong with the map against the tree under ``root``: empty when it matches."""
    listed = mapped_paths(document)
    faults = [
        f"listed twice: {path}" for path in sorted({p for p in listed if listed.count(p) > 1})
    ]
    faults += [f"listed, not in the tree: {path}" for path in listed if not (root / path).is_file()]
    missing = modules_needing_a_row(root) - set(listed)
    faults += [f"in the tree, not in the map: {path}" for path in sorted(missing)]
    return faults


def test_the_map_lists_every_module_of_harness_and_nothing_else() -> None:
    document = HARNESS_MD.read_text(encoding="utf-8")
    assert len(mapped_paths(document)) > 100, "too few rows read: the parser is broken"
    assert map_faults(ROOT, document) == []


def test_bare_names_in_a_row_are_in_its_first_path_s_folder() -> None:
    document = "\n## Map\n\n| module | job |\n|---|---|\n| `harness/a/b.py`, `c.py` | x |\n"
    assert mapped_paths(document) == ["harness/a/b.py", "harness/a/c.py"]


@pytest.mark.parametrize(
    ("source", "needs_a_row"),
    [
        ('"""The package."""\n', False),
        ('"""The package."""\nfrom a import b\n\n__all__ = ["b"]\n', False),
        ('"""The package."""\nNAMES = {"b": "a"}\n', True),
        ('"""The package."""\ndef __getattr__(name): ...\n', True),
    ],
)
def test_an_init_needs_a_row_when_it_holds_code(source: str, needs_a_row: bool) -> None:
    assert has_code_of_its_own(source) is needs_a_row


def _planted_tree(tmp_path: Path) -> tuple[Path, str]:
    """A copy of harness/'s file names under ``tmp_path`` (empty files: only paths matter,
    and each copied ``__init__.py`` keeps its source) and the real map."""
    for path in (ROOT / "harness").rglob("*.py"):
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text(encoding="utf-8") if path.name == "__init__.py" else "")
    (tmp_path / "scripts").mkdir()
    for path in (ROOT / "scripts").glob("*.py"):
        (tmp_path / "scripts" / path.name).write_text("")
    document = HARNESS_MD.read_text(encoding="utf-8")
    assert map_faults(tmp_path, document) == []
    return tmp_path, document


def test_a_planted_unlisted_module_is_caught(tmp_path: Path) -> None:
    root, document = _planted_tree(tmp_path)
    (root / "harness" / "runtime" / "planted.py").write_text('"""Planted."""\n')
    assert map_faults(root, document) == ["in the tree, not in the map: harness/runtime/planted.py"]


def test_a_planted_init_with_code_is_caught(tmp_path: Path) -> None:
    root, document = _planted_tree(tmp_path)
    (root / "harness" / "bench" / "__init__.py").write_text('"""Benchmarks."""\nNAMES = ()\n')
    assert map_faults(root, document) == ["in the tree, not in the map: harness/bench/__init__.py"]


def test_a_listed_module_that_is_gone_is_caught(tmp_path: Path) -> None:
    root, document = _planted_tree(tmp_path)
    (root / "harness" / "runtime" / "varlen_kernel.py").unlink()
    assert map_faults(root, document) == [
        "listed, not in the tree: harness/runtime/varlen_kernel.py"
    ]
