"""pagedkv's harness: a real paged KV pool under a real transformer, and the benchmarks.

The public call is ``harness.check_model`` (the three paged-vs-dense checks on a model the
caller loaded), returning an ``EquivalenceReport``; everything else here is the main
command's and the benchmarks' machinery.

Importing the package is light: torch and transformers load only in the modules that need
them (``check_model`` loads them on first use), so the allocator benchmarks and
``harness.bench.fragmentation`` start without them.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.check import Prompt, check_model
    from harness.oracle.equivalence import EquivalenceReport, RequestReport
    from harness.settings import CheckSettings, CheckSettingsError

__all__ = [
    "CheckSettings",
    "CheckSettingsError",
    "EquivalenceReport",
    "Prompt",
    "RequestReport",
    "check_model",
]

# The public names and the modules they live in, imported when first asked for (PEP 562).
_PUBLIC = {
    "CheckSettings": "harness.settings",
    "CheckSettingsError": "harness.settings",
    "Prompt": "harness.check",
    "check_model": "harness.check",
    "EquivalenceReport": "harness.oracle.equivalence",
    "RequestReport": "harness.oracle.equivalence",
}


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    return getattr(importlib.import_module(_PUBLIC[name]), name)


def _exit_on_interrupt_while_starting() -> None:
    """Under ``python -m harness.X``, while Python imports its packages (it sets
    ``sys.argv[0]`` to ``"-m"`` until the module is found): Ctrl-C is one line and exit
    130 from here on, through the seconds of importing torch, until the command's own
    handling takes over (``harness.parsing.exit_on_interrupt``)."""
    if sys.argv[:1] != ["-m"] or "-m" not in sys.orig_argv[:-1]:
        return
    module = sys.orig_argv[sys.orig_argv.index("-m") + 1]
    if module.split(".")[0] == "harness":
        from harness.parsing import exit_on_interrupt  # noqa: PLC0415

        exit_on_interrupt(f"python -m {module}")


_exit_on_interrupt_while_starting()
