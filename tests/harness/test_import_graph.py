"""The import graph, read with ``ast``: spec <- impl <- harness, and no arrow back up.

Inside ``harness``, the command line (``harness/cli/``) is the top floor: nothing below
imports it, and no two of harness's packages and top-level modules import each other,
directly or round a longer cycle.

Every ``import`` counts, a function-local one too: an import deferred for start-up time is
still an arrow.
"""

import ast
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from harness.cli.pagedkv import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> Iterator[str]:
    """The absolute module names ``path`` imports (``from a.b import c`` gives ``a.b``)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield from imported_modules_of(node)


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


# The command's entry point for ``python -m harness``: above the CLI, not below it.
ENTRY_POINT = "harness/__main__.py"


def test_nothing_below_the_cli_imports_it() -> None:
    bad = {
        (path, module)
        for path, module in arrows("harness")
        if is_under(module, "harness.cli")
        and not path.startswith("harness/cli/")
        and path != ENTRY_POINT
    }
    assert bad == set()


def test_the_console_script_loads_only_the_benchmarks_it_lists_and_none_at_import() -> None:
    """``pagedkv bench NAME`` imports ``BENCHMARKS[NAME]``'s module by name when it runs it
    (``package_graph`` counts those arrows): no import of ``harness.bench`` in the script."""
    script = ROOT / "harness" / "cli" / "pagedkv.py"
    assert [m for m in imported_modules(script) if is_under(m, "harness.bench")] == []
    assert all(is_under(module, "harness.bench") for module, _ in BENCHMARKS.values())


def test_no_two_of_harness_packages_and_modules_import_each_other() -> None:
    cycle = find_cycle(package_graph())
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


def package_graph(root: Path = ROOT) -> dict[str, dict[str, set[str]]]:
    """``harness.X -> harness.Y -> the files making the arrow``, a node per package or
    top-level module of ``harness`` (``harness`` itself for its ``__init__``); a node's
    arrows to itself are left out. The console script's benchmarks, imported by name, are
    arrows from the CLI."""
    graph: dict[str, dict[str, set[str]]] = {}
    for module, _ in BENCHMARKS.values():
        graph.setdefault("harness.cli", {}).setdefault(node_of(module), set()).add(
            "harness/cli/pagedkv.py"
        )
    for path in sorted((root / "harness").rglob("*.py")):
        relative = path.relative_to(root)
        source = node_of(".".join(relative.with_suffix("").parts))
        for module in imported_harness_modules(path):
            target = node_of(module)
            if target != source:
                graph.setdefault(source, {}).setdefault(target, set()).add(str(relative))
    return graph


def imported_harness_modules(path: Path) -> Iterator[str]:
    """What ``path`` imports from ``harness``, ``from harness import x`` as ``harness.x``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "harness":
            yield from (f"harness.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            yield from (m for m in imported_modules_of(node) if is_under(m, "harness"))


def imported_modules_of(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute module names one import statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return [node.module] if node.level == 0 and node.module is not None else []


def node_of(module: str) -> str:
    """``harness.X`` for a module in ``harness``'s package or top-level module ``X``."""
    parts = module.split(".")
    return "harness" if parts[1:2] in ([], ["__init__"]) else ".".join(parts[:2])


def find_cycle(graph: Mapping[str, Mapping[str, object]]) -> list[str]:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``[]`` when it has none (a depth-first
    search: an arrow to a node still on the path closes a cycle)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if cycle := visit(target):
                return cycle
        path.pop()
        done.add(node)
        return []

    for node in sorted(graph):
        if cycle := visit(node):
            return cycle
    return []


def test_the_cycle_finder_finds_a_long_cycle_and_none_in_a_tree() -> None:
    graph = {"a": {"b": 0}, "b": {"c": 0, "d": 0}, "c": {"a": 0}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 0, "c": 0}, "b": {"c": 0}}) == []


def test_the_package_graph_reads_each_kind_of_arrow(tmp_path: Path) -> None:
    (tmp_path / "harness" / "cli").mkdir(parents=True)
    (tmp_path / "harness" / "__init__.py").write_text("def f():\n    import harness.parsing\n")
    (tmp_path / "harness" / "cli" / "main.py").write_text(
        "from harness import check\nfrom harness.cli.report import x\n"
    )
    (tmp_path / "harness" / "check.py").write_text("from harness.bench.decode import main\n")
    assert package_graph(tmp_path) == {
        "harness": {"harness.parsing": {"harness/__init__.py"}},
        "harness.cli": {
            "harness.check": {"harness/cli/main.py"},
            "harness.bench": {"harness/cli/pagedkv.py"},  # the benchmarks, by name
        },
        "harness.check": {"harness.bench": {"harness/check.py"}},
    }


def test_the_graph_reader_sees_a_function_local_import(tmp_path: Path) -> None:
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from harness.bench.plots import main\n    import torch\n")
    assert list(imported_modules(module)) == ["harness.bench.plots", "torch"]
