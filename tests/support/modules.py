"""Load a Python file that is not in a package (a script, a generated test) as a module."""

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_module(name: str, path: Path) -> ModuleType:
    """Execute ``path`` as a fresh module called ``name`` and return it."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module."""
    return load_module(name, REPO / "scripts" / f"{name}.py")
