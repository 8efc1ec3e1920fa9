"""Have mutmut map again the tests edited since it mapped them.

    python scripts/mutation_stale_tests.py [--root mutants]

mutmut runs each mutant against the tests that reached its function when it collected its
stats (``mutants/mutmut-stats.json``, which names the commit they were collected at), and
on a later run collects stats only for tests it has not seen. A test edited since keeps its
old map: an assertion added to an existing test to kill a survivor never runs against that
mutant, which survives again (2026-12-04: ``spec.invariants._attention_tables``' loosened
zip, whose killing assertion had been added to an existing test). So before a run this
takes every test function or class of the stats' test files whose source differs from the
stats' commit out of the stats; mutmut then sees it as new and maps it again (seconds per
test). Prints one line: how many tests it took out, of how many changed functions.
Does nothing without a stats file (the run collects them all).
"""

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_sources(source: str) -> dict[str, str]:
    """Each top-level test function's and test class's source, by name."""
    return {
        node.name: ast.get_source_segment(source, node) or ""
        for node in ast.parse(source).body
        if (isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name.startswith("test"))
        or (isinstance(node, ast.ClassDef) and node.name.startswith("Test"))
    }


def changed_tests(old: str, new: str) -> set[str]:
    """The tests of ``new`` that ``old`` has with another source (new ones mutmut maps)."""
    before, after = test_sources(old), test_sources(new)
    return {name for name, source in after.items() if name in before and before[name] != source}


def is_node_of(node_id: str, prefix: str) -> bool:
    """Whether pytest's ``node_id`` is the test ``prefix`` (``path::name``), one of its
    parameters (``[...]``) or, for a class, one of its methods (``::method``)."""
    return node_id == prefix or node_id.startswith((prefix + "[", prefix + "::"))


def drop(stats: dict[str, object], prefixes: set[str]) -> int:
    """Take the tests named by ``prefixes`` out of ``stats``; how many node ids went."""
    durations = stats["duration_by_test"]
    mapping = stats["tests_by_mangled_function_name"]
    assert isinstance(durations, dict) and isinstance(mapping, dict)
    stale = {node for node in durations if any(is_node_of(node, p) for p in prefixes)}
    for node in stale:
        del durations[node]
    for function, tests in mapping.items():
        mapping[function] = [test for test in tests if test not in stale]
    return len(stale)


def _source_at(commit: str, path: str) -> str | None:
    shown = subprocess.run(
        ["git", "show", f"{commit}:{path}"], check=False, cwd=REPO, capture_output=True, text=True
    )
    return shown.stdout if shown.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO / "mutants")
    args = parser.parse_args(argv)
    path = args.root / "mutmut-stats.json"
    if not path.exists():
        print("mutation_stale_tests: no stats yet, nothing to take out")
        return 0
    stats = json.loads(path.read_text())
    commit = stats["git_commit"]
    files = sorted({node.split("::", 1)[0] for node in stats["duration_by_test"]})
    prefixes: set[str] = set()
    for file in files:
        old, current = _source_at(commit, file), REPO / file
        if old is not None and current.exists():
            prefixes |= {f"{file}::{name}" for name in changed_tests(old, current.read_text())}
    dropped = drop(stats, prefixes)
    path.write_text(json.dumps(stats, indent=4))
    print(
        f"mutation_stale_tests: {dropped} tests taken out of mutmut's stats "
        f"({len(prefixes)} test functions changed since {commit[:8]})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
