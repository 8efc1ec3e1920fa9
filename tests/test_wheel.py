"""The wheel as a user gets it, and an editable install of a checkout: each installed into
a fresh venv, and a user's file type-checked against it with ``mypy --strict
--disallow-any-expr`` (so the packages are typed, and no ``Any`` comes out of the public
API; setuptools' default editable install hid them behind an import hook mypy cannot follow).

Nothing is downloaded: the wheel builds with the dev venv's setuptools (no build isolation),
installs with ``--no-deps``, and the fresh venv reads torch and transformers from the dev
venv's site-packages through a ``.pth`` line (which runs none of that directory's own
``.pth`` files, so the editable install of the repository stays out of sight). mypy runs
from a directory outside the repository, so the source folders are not on its path.
"""

import shutil
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.support.wheel_build import ROOT, build_wheel
from tests.support.wheel_build import run as _run

USER_FILE = ROOT / "tests" / "support" / "wheel_user.py"
# torch's own analysis is most of a cold run (~1 min on 2 cores); kept between runs here.
MYPY_CACHE = ROOT / ".mypy_cache" / "wheel-user"


def _source_copy(base: Path) -> Path:
    """The files an editable install reads (setup.cfg's editable mode among them), copied
    under ``base``: the repository stays untouched."""
    source = base / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy(ROOT / name, source)
    for package in ("spec", "impl", "harness"):
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return source


def _fresh_venv(base: Path) -> Path:
    """A venv under ``base`` that reads torch and transformers from the dev venv; its python."""
    venv.create(base / "user", with_pip=False)
    python = base / "user" / "bin" / "python"
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=base)
    dev_site = sysconfig.get_paths()["purelib"]
    (Path(site.stdout.strip()) / "dev-site-packages.pth").write_text(dev_site + "\n")
    return python


def _install(python: Path, *what: str | Path, cwd: Path) -> None:
    installed = _run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        *what, cwd=cwd,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr


@pytest.fixture(scope="module")
def user_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel of this source installed; its python."""
    base = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(base)
    python = _fresh_venv(base)
    _install(python, wheel, cwd=base)
    return python


@pytest.fixture(scope="module")
def editable_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with this source installed as ``pip install -e`` (the README's route and
    scripts/setup.sh's) installs it; its python."""
    base = tmp_path_factory.mktemp("editable")
    python = _fresh_venv(base)
    _install(python, "--no-build-isolation", "-e", _source_copy(base), cwd=base)
    return python


def test_the_wheel_ships_every_package_typed_and_the_console_script(user_python: Path) -> None:
    probe = (
        "import importlib.metadata as m, pathlib, harness, impl, spec; "
        "print(all((pathlib.Path(p.__file__).parent / 'py.typed').is_file() "
        "for p in (harness, impl, spec))); "
        "print(harness.__file__); "
        "print([e.value for e in m.entry_points(group='console_scripts', name='pagedkv')])"
    )
    done = _run(user_python, "-c", probe, cwd=user_python.parents[2])
    typed, location, scripts = done.stdout.splitlines()
    assert typed == "True"
    assert location.startswith(str(user_python.parents[1]))  # the wheel's copy, not the repo's
    assert scripts == "['harness.cli.pagedkv:main']"
    help_text = _run(user_python.parent / "pagedkv", "--help", cwd=user_python.parents[2])
    assert help_text.returncode == 0 and "pagedkv check" in help_text.stdout


def test_an_editable_install_runs_the_source_and_a_module_added_after_it(
    editable_python: Path,
) -> None:
    source = editable_python.parents[2] / "source"
    (source / "harness" / "added_after_install.py").write_text("WHERE = __file__\n")
    probe = "import harness, harness.added_after_install as a; print(harness.__file__, a.WHERE)"
    done = _run(editable_python, "-c", probe, cwd=editable_python.parents[2])
    assert done.stdout.split() == [
        str(source / "harness" / "__init__.py"),
        str(source / "harness" / "added_after_install.py"),
    ], done.stderr


def test_a_user_file_is_mypy_strict_clean_against_the_wheel_and_an_editable_install(
    user_python: Path, editable_python: Path, tmp_path: Path
) -> None:
    shutil.copy(USER_FILE, tmp_path / "user_code.py")
    # One after the other: the second run finds torch's analysis in the cache.
    for python in (user_python, editable_python):
        checked = _run(
            sys.executable, "-m", "mypy", "--strict", "--disallow-any-expr", "--warn-unreachable",
            "--python-executable", python, "--cache-dir", MYPY_CACHE, "user_code.py",
            cwd=tmp_path,
        )  # fmt: skip
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "Success: no issues found in 1 source file" in checked.stdout
