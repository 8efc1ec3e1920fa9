"""pagedkv's harness: a real paged KV pool under a real transformer, and the benchmarks.

The public call is ``harness.check_model`` (the three paged-vs-dense checks on a model the
caller loaded), returning an ``EquivalenceReport``; everything else here is the main
command's and the benchmarks' machinery.

Importing the package is light: torch and transformers load only in the modules that need
them (``check_model`` loads them on first use), so the allocator benchmarks and
``harness.bench.fragmentation`` start without them.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.check import CheckSettingsError, Prompt, check_model
    from harness.oracle.equivalence import EquivalenceReport, RequestReport

__all__ = ["CheckSettingsError", "EquivalenceReport", "Prompt", "RequestReport", "check_model"]

# The public names and the modules they live in, imported when first asked for (PEP 562).
_PUBLIC = {
    "CheckSettingsError": "harness.check",
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
