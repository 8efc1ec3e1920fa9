"""A user's own allocator checked from the command line, as a user installs pagedkv: the
wheel built from this source, installed into a fresh venv with the kit's one dependency
(Hypothesis, the ``kit`` extra) and no torch, and the adapter template copied to a
directory outside the repository and named as ``module:factory``.

Nothing is downloaded: the wheel builds with the dev venv's setuptools and installs with
``--no-deps``; Hypothesis (and sortedcontainers, its one dependency) come from the dev
venv through a ``.pth`` line to a folder that holds only them, so torch stays out of sight.
"""

import importlib.metadata
import shutil
import sys
import venv
from pathlib import Path

import pytest

from tests.support.wheel_build import ROOT, build_wheel
from tests.support.wheel_build import run as _run

TEMPLATE = ROOT / "tests" / "conformance" / "adapter_template.py"
KIT_DEPENDENCIES = ("hypothesis", "sortedcontainers")


def _link_distribution(name: str, into: Path) -> None:
    """Link the top-level files and folders of installed distribution ``name`` into ``into``."""
    distribution = importlib.metadata.distribution(name)
    tops = {Path(str(f)).parts[0] for f in distribution.files or ()}
    for top in tops - {"..", "__pycache__"}:
        source = Path(str(distribution.locate_file(top)))
        if source.exists() and not (into / top).exists():
            (into / top).symlink_to(source)


@pytest.fixture(scope="module")
def user_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with this source's wheel and Hypothesis, without torch; its python."""
    base = tmp_path_factory.mktemp("kit-wheel")
    wheel = build_wheel(base)
    venv.create(base / "user", with_pip=False)
    python = base / "user" / "bin" / "python"
    installed = _run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        wheel, cwd=base,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    dependencies = base / "kit-dependencies"
    dependencies.mkdir()
    for name in KIT_DEPENDENCIES:
        _link_distribution(name, dependencies)
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=base)
    (Path(site.stdout.strip()) / "kit-dependencies.pth").write_text(f"{dependencies}\n")
    return python


def test_the_wheel_declares_the_kit_extra_and_the_venv_has_no_torch(user_python: Path) -> None:
    probe = (
        "import importlib.metadata as m, importlib.util as u; "
        "print([r for r in m.requires('pagedkv') if 'extra == \"kit\"' in r]); "
        "print(u.find_spec('torch') is None, u.find_spec('hypothesis') is not None)"
    )
    done = _run(user_python, "-c", probe, cwd=user_python.parents[2])
    extra, torchless = done.stdout.splitlines()
    assert "hypothesis==" in extra and torchless == "True True"


def test_an_adapter_outside_the_repository_runs_by_module_and_factory(
    user_python: Path, tmp_path: Path
) -> None:
    shutil.copy(TEMPLATE, tmp_path / "my_pool.py")
    target = ["--target", "my_pool:make", "--seed", "3"]
    done = _run(user_python, "-m", "harness.conformance", *target, "--steps", "300", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TinyPrefixPool: " in done.stdout and "all properties held" in done.stdout
    script = user_python.parent / "pagedkv"
    done = _run(script, "conformance", *target, "--steps", "100", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "my_pool:make: " in done.stdout
