"""The import graph, read with ``ast``: spec <- impl <- harness, and no arrow back up.

Every ``import`` counts, a function-local one too: an import deferred for start-up time is
still an arrow.
"""

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> Iterator[str]:
    """The absolute module names ``path`` imports (``from a.b import c`` gives ``a.b``)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            yield node.module


def arrows(package: str) -> set[tuple[str, str]]:
    """(importing file, imported module) for every ``.py`` file under ``package``."""
    return {
        (str(path.relative_to(ROOT)), module)
        for path in sorted((ROOT / package).rglob("*.py"))
        for module in imported_modules(path)
    }


def is_under(module: str, *packages: str) -> bool:
    """Whether ``module`` is one of ``packages`` or inside one."""
    return any(module == package or module.startswith(package + ".") for package in packages)


def test_spec_imports_nothing_of_ours_but_spec_and_nothing_outside_the_stdlib() -> None:
    bad = {
        (path, module)
        for path, module in arrows("spec")
        if not is_under(module, "spec") and module.split(".")[0] not in sys.stdlib_module_names
    }
    assert bad == set()


def test_impl_imports_neither_harness_nor_tests_nor_torch() -> None:
    bad = {(p, m) for p, m in arrows("impl") if is_under(m, "harness", "tests", "torch")}
    assert bad == set()


def test_no_harness_module_imports_tests() -> None:
    assert {(p, m) for p, m in arrows("harness") if is_under(m, "tests")} == set()


def test_models_imports_nothing_from_the_runtime() -> None:
    models = ROOT / "harness" / "models.py"
    assert [m for m in imported_modules(models) if is_under(m, "harness.runtime")] == []


def test_the_cli_imports_no_benchmark() -> None:
    bad = {(p, m) for p, m in arrows("harness/cli") if is_under(m, "harness.bench")}
    assert bad == set()


def test_the_graph_reader_sees_a_function_local_import(tmp_path: Path) -> None:
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from harness.bench.plots import main\n    import torch\n")
    assert list(imported_modules(module)) == ["harness.bench.plots", "torch"]
