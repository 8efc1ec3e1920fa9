"""Sort mutmut's mutants of spec/ and impl/ into the classes no test can kill, by their diff.

    python scripts/mutation_classes.py [--generate] [--to-run FILE]   (from the repository root)
    python scripts/mutation_classes.py --summary
    python scripts/mutation_classes.py --digest NAME ...

Prints one line per equivalent mutant (its class and name) and a count per class
(``--summary``: one line counting every mutant by its verdict or class instead); with
``--to-run FILE`` writes the names of every other mutant that has no verdict yet to FILE,
one per line, for ``mutmut run`` (so a stopped run resumes); ``--generate`` has mutmut
write mutants/ first. Three classes are recognised, each shown equivalent in
docs/verification.md instead of being run one by one (every surviving mutant runs every
test that reaches its function, a minute or more each on the CI machine, and these are
more than half the survivors):

- ``zip-strict``: ``zip(..., strict=True)`` loosened (``strict=False``, ``strict=None`` or
  no ``strict``) and nothing else changed, in an operation of spec/ or impl/. Each such zip
  pairs per-group (or per-block) lists that the allocator builds together, so their
  lengths never differ; ``strict`` guards our own bug. Not in ``spec.invariants``: its
  predicates take any state, one built by hand included, whose lists may differ in length,
  so those mutants run.
- ``assert-message``: only the message string of an ``assert`` changed. The asserts guard
  our own invariants and never fire in a correct allocator.
- ``explained``: a mutant listed in scripts/mutation_equivalent.txt (its name, a digest of
  its function's source and why no test can tell it apart), each explained in
  docs/verification.md; one whose function changed since it was listed runs again.
  ``--digest NAME ...`` prints the line to list one by (the reason is added by hand).

A mutant that changes anything else on the line is not in a class and runs.
"""

import argparse
import ast
import hashlib
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

MUTANT = re.compile(r"^(?P<function>.+)__mutmut_(?P<number>\d+|orig)$")
SPACE = re.compile(r"\s+")
STRICT = re.compile(r",strict=True,?\)")  # in a source without whitespace
PREDICATES = "spec.invariants"
EXPLAINED = Path(__file__).resolve().parent / "mutation_equivalent.txt"
LOOSENED = (",strict=False)", ",strict=None)", ",)", ")", ",strict=False,)", ",strict=None,)")


def function_sources(path: Path) -> Iterator[tuple[str, str, str]]:
    """(function, mutant number or 'orig', source) of each function mutmut wrote in ``path``."""
    source = path.read_text()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            match = MUTANT.match(node.name)
            if match is not None:
                assert node.end_lineno is not None, f"{path}: no end line for {node.name}"
                # Past the ``def`` line, which differs by the name alone.
                body = "\n".join(lines[node.lineno : node.end_lineno])
                yield match["function"], match["number"], body


def changed_lines(original: str, mutant: str) -> list[tuple[str, str]] | None:
    """The (original, mutant) line pairs that differ, or None when the line counts differ."""
    before, after = original.splitlines(), mutant.splitlines()
    if len(before) != len(after):
        return None
    return [(a, b) for a, b in zip(before, after, strict=True) if a != b]


def equivalence_class(original: str, mutant: str, module_of_predicates: bool) -> str | None:
    """The class of a mutant whose whole diff is one known-equivalent change, else None
    (``module_of_predicates``: the mutant is in ``spec.invariants``)."""
    if not module_of_predicates and _only_strict_loosened(original, mutant):
        return "zip-strict"
    pairs = changed_lines(original, mutant)
    if pairs is None or len(pairs) != 1:
        return None
    (before, after) = pairs[0]
    if _is_assert(before) and _is_assert(after) and _assert_test(before) == _assert_test(after):
        return "assert-message"
    return None


def _only_strict_loosened(original: str, mutant: str) -> bool:
    """Whether ``mutant`` is ``original`` with one ``strict=True`` loosened, all else equal
    (whitespace aside: a zip call may span lines). ``strict=True`` is zip's alone in
    spec/ and impl/ (tests/test_mutation_classes.py checks)."""
    before, after = SPACE.sub("", original), SPACE.sub("", mutant)
    for found in STRICT.finditer(before):
        head, tail = before[: found.start()], before[found.end() :]
        if any(head + loosened + tail == after for loosened in LOOSENED):
            return True
    return False


def _is_assert(line: str) -> bool:
    try:
        tree = ast.parse(line.strip())
    except SyntaxError:
        return False
    return len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert)


def _assert_test(line: str) -> str:
    statement = ast.parse(line.strip()).body[0]
    assert isinstance(statement, ast.Assert)
    return ast.dump(statement.test)


def digest(source: str) -> str:
    """A short digest of a function's source: an explained mutant stays explained while it
    is unchanged."""
    return hashlib.sha256(source.encode()).hexdigest()[:12]


def explained(path: Path = EXPLAINED) -> dict[str, str]:
    """Each listed mutant's name and the digest of its function when it was explained."""
    if not path.exists():
        return {}
    listed: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, function_digest = line.split()[:2]
            listed[name] = function_digest
    return listed


def mutant_sources(root: Path) -> Iterator[tuple[str, str, str]]:
    """(mutmut's name, its function's original source, the mutant's) of every mutant."""
    for path in sorted([*root.glob("spec/**/*.py"), *root.glob("impl/**/*.py")]):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        functions: dict[str, dict[str, str]] = {}
        for function, number, body in function_sources(path):
            functions.setdefault(function, {})[number] = body
        for function, versions in functions.items():
            original = versions.pop("orig")
            for number, body in sorted(versions.items(), key=lambda item: int(item[0])):
                name = f"{module}.{function}__mutmut_{number}"
                yield name.replace(".__init__.", "."), original, body


def mutant_names(
    root: Path, listed: dict[str, str] | None = None
) -> Iterator[tuple[str, str | None]]:
    """(mutmut's name, equivalence class or None) of every mutant under ``root``;
    ``listed``: the explained mutants (default: scripts/mutation_equivalent.txt's)."""
    listed = explained() if listed is None else listed
    for name, original, body in mutant_sources(root):
        module = name.rsplit(".", 1)[0]
        kind = equivalence_class(original, body, module == PREDICATES)
        if kind is None and listed.get(name) == digest(original):
            kind = "explained"
        yield name, kind


def generate() -> None:
    """Have mutmut write its mutated copy of the sources under mutants/, as ``mutmut run``
    does first.

    NOTE: mutmut has no command that only generates, so this calls the functions its
    ``run`` starts with; they are internal to mutmut 3.8.1, which scripts/mutation.sh pins.
    """
    from mutmut import __main__ as mutmut_main  # noqa: PLC0415 (only with --generate)
    from mutmut.mutation.trampoline import set_mutant_under_test  # noqa: PLC0415
    from mutmut.utils.file_utils import copy_src_dir  # noqa: PLC0415

    set_mutant_under_test("mutant_generation")
    Path("mutants").mkdir(exist_ok=True)
    copy_src_dir()
    mutmut_main.create_mutants(os.cpu_count() or 1)


def verdicts(root: Path) -> dict[str, int | None]:
    """Each mutant's exit code as mutmut recorded it in its .meta files (None: not run)."""
    found: dict[str, int | None] = {}
    for meta in root.glob("**/*.py.meta"):
        found.update(json.loads(meta.read_text()).get("exit_code_by_key", {}))
    return found


def names_to_run(root: Path, listed: dict[str, str] | None = None) -> list[str]:
    """The mutants in no class that have no verdict yet, in mutmut's file order."""
    run = verdicts(root)
    return [
        name for name, kind in mutant_names(root, listed) if kind is None and run.get(name) is None
    ]


def summary(root: Path, listed: dict[str, str] | None = None) -> str:
    """One line: every mutant counted once, by its verdict or, not run, by its class."""
    from mutmut.stats import status_by_exit_code  # noqa: PLC0415 (mutmut's own reading)

    run = verdicts(root)
    counts: Counter[str] = Counter()
    for name, kind in mutant_names(root, listed):
        status = status_by_exit_code[run.get(name)]
        counts[status if kind is None else "explained" if kind == "explained" else "class"] += 1
    typed = counts["caught by type check"]
    killed = counts["killed"] + counts["timeout"] + typed
    decided = killed + counts["survived"] + counts["no tests"] + counts["suspicious"]
    return (
        f"mutation: {counts.total()} mutants: {killed} killed ({typed} by mypy --strict, "
        f"{counts['timeout']} by timeout), {counts['survived']} survived, "
        f"{counts['no tests']} without tests, "
        f"{counts['suspicious']} suspicious, {counts['class']} equivalent by class and "
        f"{counts['explained']} explained as equivalent (set aside), "
        f"{counts['not checked']} not run yet; "
        f"killed {killed / max(decided, 1):.1%} of those run"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--generate", action="store_true", help="have mutmut write mutants/")
    parser.add_argument(
        "--to-run", type=Path, help="write the names of the other mutants not yet run here"
    )
    parser.add_argument("--root", type=Path, default=Path("mutants"), help="mutmut's tree")
    parser.add_argument(
        "--summary", action="store_true", help="print only the verdicts' one-line summary"
    )
    parser.add_argument(
        "--digest", nargs="+", metavar="NAME", help="print each mutant's line to explain it by"
    )
    args = parser.parse_args()
    if args.generate:
        generate()
    if not args.root.is_dir():
        print(f"mutation_classes: no {args.root}/: run mutmut first", file=sys.stderr)
        return 2
    if args.summary:
        print(summary(args.root))
        return 0
    if args.digest:
        sources = {name: original for name, original, _ in mutant_sources(args.root)}
        unknown = [name for name in args.digest if name not in sources]
        for name in unknown:
            print(f"mutation_classes: no mutant {name} in {args.root}/", file=sys.stderr)
        for name in args.digest:
            if name in sources:
                print(f"{name} {digest(sources[name])}")
        return 2 if unknown else 0
    equivalent = [(kind, name) for name, kind in mutant_names(args.root) if kind is not None]
    for kind, name in equivalent:
        print(f"{kind}: {name}")
    to_run = names_to_run(args.root)
    if args.to_run is not None:
        args.to_run.write_text("".join(f"{name}\n" for name in to_run))
    classes = Counter(kind for kind, _ in equivalent)
    counts = ", ".join(f"{kind} {count}" for kind, count in sorted(classes.items()))
    print(f"mutation_classes: {len(to_run)} to run, equivalent by class: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
