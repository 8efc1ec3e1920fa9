"""Keep mutmut's verdicts between runs, so a mutation run can go on in another session.

    python scripts/mutation_verdicts.py save|restore [FILE] [--root mutants]

mutants/ is git-ignored and a new checkout starts without it, while a run of every mutant
takes hours more than a session has on the 2-core machine. ``save`` writes each mutated
function's verdicts to FILE (default scripts/mutation_verdicts.txt, committed) with the
hash mutmut gave the function's source, keeping the saved verdicts of unchanged functions
that mutmut has forgotten; ``restore``, after mutmut has generated mutants/, gives every
mutant without a verdict the saved one, but only where its function's hash is unchanged (a
function edited since is run again), and takes away a verdict the file has cleared (``-``:
a survivor since killed by a new test or explained), so the mutant runs again unless
explained. Tests are not hashed: a killed verdict stays until its function changes (as in
mutmut's own mutants/); delete FILE to start over.
"""

import argparse
import json
import re
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent / "mutation_verdicts.txt"
KEY = re.compile(r"^(?P<function>.+)__mutmut_(?P<number>\d+)$")
HEADER = (
    "# mutmut's verdicts of spec/ and impl/, written by scripts/mutation_verdicts.py: per\n"
    "# mutated function, the hash of its source and each mutant's exit code (- : not run)\n"
)
NOT_RUN = "-"


def _metas(root: Path) -> list[Path]:
    return sorted(root.glob("**/*.py.meta"))


def _function_of(key: str) -> tuple[str, int]:
    match = KEY.match(key)
    assert match is not None, f"not a mutant name: {key}"
    return match["function"], int(match["number"])


def _hash_of(meta: dict[str, dict[str, str]], function: str) -> str | None:
    """mutmut files a function's hash under its name without the module."""
    return meta["hash_by_function_name"].get(function.rsplit(".", 1)[1])


def _read(path: Path) -> dict[str, tuple[str, list[str]]]:
    """Each saved function's hash and verdicts (none if ``path`` does not exist)."""
    saved: dict[str, tuple[str, list[str]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                function, function_hash, *codes = line.split(" ")
                saved[function] = (function_hash, codes)
    return saved


def _saved_entry(
    saved: dict[str, tuple[str, list[str]]], function: str, function_hash: str | None, number: int
) -> str | None:
    """What the file holds for mutant ``number`` of ``function`` (an exit code or ``-``),
    if the function's hash is unchanged; None otherwise."""
    saved_hash, codes = saved.get(function, ("", []))
    if saved_hash != function_hash or number > len(codes):
        return None
    return codes[number - 1]


def _saved_code(
    saved: dict[str, tuple[str, list[str]]], function: str, function_hash: str | None, number: int
) -> int | None:
    """The saved verdict of mutant ``number`` of ``function``, if its hash is unchanged."""
    entry = _saved_entry(saved, function, function_hash, number)
    return None if entry is None or entry == NOT_RUN else int(entry)


def save(root: Path, path: Path) -> int:
    """Write the verdicts under ``root`` to ``path``, keeping those ``path`` holds for
    unchanged functions where ``root`` has none; the number of mutants with one."""
    # NOTE: mutmut 3.8 forgets a function's verdicts when a test reaching it changed, in
    # its stats run, after ``restore``: without the saved ones a save would drop them,
    # while here a verdict stands until its function changes.
    saved = _read(path)
    lines: list[str] = []
    decided = 0
    for meta_path in _metas(root):
        meta = json.loads(meta_path.read_text())
        codes: dict[str, dict[int, int | None]] = {}
        for key, code in meta["exit_code_by_key"].items():
            function, number = _function_of(key)
            if code is None:
                code_or_saved = _saved_code(saved, function, _hash_of(meta, function), number)
            else:
                code_or_saved = code
            codes.setdefault(function, {})[number] = code_or_saved
        for function, by_number in sorted(codes.items()):
            row = [by_number.get(n) for n in range(1, max(by_number) + 1)]
            decided += sum(code is not None for code in row)
            written = " ".join(NOT_RUN if code is None else str(code) for code in row)
            lines.append(f"{function} {_hash_of(meta, function)} {written}\n")
    path.write_text(HEADER + "".join(lines))
    return decided


def restore(root: Path, path: Path) -> tuple[int, int]:
    """Give mutants without a verdict their saved one where the function is unchanged, and
    take away a verdict the file has cleared; the numbers restored and cleared."""
    # NOTE: a save writes every verdict mutmut holds, so an unchanged function's `-` over
    # a verdict in mutants/ is one cleared by hand: a survivor since killed by a new test
    # or explained. Kept, it would never be run again and would still count as surviving.
    saved = _read(path)
    restored = cleared = 0
    for meta_path in _metas(root):
        meta = json.loads(meta_path.read_text())
        changed = False
        for key, code in meta["exit_code_by_key"].items():
            function, number = _function_of(key)
            function_hash = _hash_of(meta, function)
            if code is not None:
                if _saved_entry(saved, function, function_hash, number) == NOT_RUN:
                    meta["exit_code_by_key"][key] = None
                    cleared += 1
                    changed = True
                continue
            saved_code = _saved_code(saved, function, function_hash, number)
            if saved_code is not None:
                meta["exit_code_by_key"][key] = saved_code
                restored += 1
                changed = True
        if changed:
            meta_path.write_text(json.dumps(meta, indent=4))
    return restored, cleared


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["save", "restore"])
    parser.add_argument("file", nargs="?", type=Path, default=DEFAULT, help="the verdicts file")
    parser.add_argument("--root", type=Path, default=Path("mutants"), help="mutmut's tree")
    args = parser.parse_args()
    if not args.root.is_dir():
        print(f"mutation_verdicts: no {args.root}/: run mutmut first", file=sys.stderr)
        return 2
    if args.action == "save":
        print(f"mutation_verdicts: {save(args.root, args.file)} verdicts saved to {args.file}")
    elif args.file.exists():
        restored, cleared = restore(args.root, args.file)
        print(
            f"mutation_verdicts: {restored} verdicts restored, {cleared} cleared, from {args.file}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
