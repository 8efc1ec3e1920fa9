"""Output files of the commands (the main command's, the decode benchmark's): checked before
the long work starts, written whole or not at all (a temporary file in the same directory,
renamed into place), so Ctrl-C or a full disk never leaves half a file behind.
"""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from harness.parsing import UsageError

# What matplotlib's savefig writes (Figure().canvas.get_supported_filetypes(), fixed here so
# checking a name does not import matplotlib).
PLOT_FORMATS = (
    *("avif", "eps", "gif", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg"),
    *("svgz", "tif", "tiff", "webp"),
)
DEFAULT_PLOT_NAME = "pool_over_time.png"


def plot_target(option: str, path: Path) -> Path:
    """Where ``--plot path`` will write: ``path`` itself, ``DIR/pool_over_time.png`` for a
    directory, ``path.png`` for a name without extension. Raises ``UsageError`` for an
    unknown format or a directory that is missing or not writable."""
    if path.is_dir():
        path = path / DEFAULT_PLOT_NAME
    elif not path.suffix:
        path = path.with_name(path.name + ".png")
    extension = path.suffix.removeprefix(".").lower()
    if extension not in PLOT_FORMATS:
        raise UsageError(
            f"{option} {str(path)!r}: unknown image format {extension!r} "
            f"(one of: {', '.join(PLOT_FORMATS)})"
        )
    check_writable(option, path)
    return path


def check_writable(option: str, path: Path) -> None:
    """Raise ``UsageError`` unless a file can be created in ``path``'s directory."""
    if not path.parent.is_dir():
        raise UsageError(f"{option}: no directory {str(path.parent)!r} to write into")
    if path.is_dir():
        raise UsageError(f"{option}: {str(path)!r} is a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".pagedkv-probe-"):
            pass
    except OSError as error:
        raise UsageError(f"{option}: cannot write into {str(path.parent)!r}: {error}") from None


def write_replacing(path: Path, write: Callable[[Path], object]) -> None:
    """Run ``write`` on a temporary file beside ``path`` (same extension), then rename it to
    ``path``; on any error or interruption the temporary file is removed and ``path`` is
    left as it was."""
    descriptor, temporary_name = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix
    )
    os.close(descriptor)
    temporary = Path(temporary_name)
    try:
        write(temporary)
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)
