"""One job per module: no module of ``impl/``, ``harness/`` or ``scripts/`` runs past ~400
lines (a module that long is doing two jobs). ``spec/`` is exempt: it is a document, the
definition of correct, and reads best whole."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# "About 400": a module may run a little past 400 while its second job is found.
MAX_LINES = 420


def module_lengths(*folders: str) -> dict[str, int]:
    """Line counts of every ``.py`` file under ``folders``, by path from the repository."""
    return {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


def test_no_module_outside_spec_is_past_about_400_lines() -> None:
    lengths = module_lengths("impl", "harness", "scripts")
    assert lengths, "no modules found: the walk is broken"
    too_long = {path: n for path, n in lengths.items() if n > MAX_LINES}
    assert too_long == {}, f"over {MAX_LINES} lines (split each by its jobs): {too_long}"
