"""The wheel of this source, built as a user gets it, for the tests that install it into a
fresh venv (``tests/test_wheel.py``, ``tests/conformance/test_wheel_adapter.py``).

Nothing is downloaded: the wheel builds with the dev venv's setuptools (no build isolation)
from a copy of the packages, the pyproject and the README.
"""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*command: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command``'s completed process, its output captured as text (ten minutes at most)."""
    return subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def build_wheel(base: Path) -> Path:
    """Build this source's wheel under ``base``; its path."""
    source = base / "source"
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    shutil.copy(ROOT / "README.md", source)
    for package in ("spec", "impl", "harness"):
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    built = run(
        sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
        "-w", base / "wheels", cwd=source,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (base / "wheels").glob("pagedkv-*.whl")
    return wheel
