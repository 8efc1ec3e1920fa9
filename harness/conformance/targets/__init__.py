"""The bundled conformance targets, by name, each a list of configurations.

A configuration's factory imports its target's package only when called, so naming a
target whose package is absent fails with ``TargetUnavailableError`` (one line), not at import.
"""

import importlib.util
from collections.abc import Callable, Mapping
from types import MappingProxyType

from harness.conformance.adapter import Adapter


class TargetUnavailableError(RuntimeError):
    """A target whose package is not installed."""


def _pagedkv(group_windows: tuple[int | None, ...]) -> Callable[[], Adapter]:
    def make() -> Adapter:
        from harness.conformance.targets.pagedkv import PagedKVAdapter  # noqa: PLC0415

        return PagedKVAdapter(group_windows=group_windows)

    return make


def _article() -> Adapter:
    from harness.conformance.targets.article import ArticleBlockManager  # noqa: PLC0415

    return ArticleBlockManager()


def _transformers(sliding_window: int | None) -> Callable[[], Adapter]:
    def make() -> Adapter:
        # Lazy: transformers and torch take seconds to import.
        from harness.conformance.targets.transformers_cb import (  # noqa: PLC0415
            TransformersAdapter,
        )

        return TransformersAdapter(sliding_window=sliding_window)

    return make


def _vllm(sliding_window: int | None) -> Callable[[], Adapter]:
    def make() -> Adapter:
        if importlib.util.find_spec("vllm") is None:
            raise TargetUnavailableError(
                "target vllm needs the vllm package: run scripts/setup.sh (it installs the "
                "'conformance' extra)"
            )
        from harness.conformance.targets.vllm_v1 import VLLMAdapter  # noqa: PLC0415

        return VLLMAdapter(sliding_window=sliding_window)

    return make


CONFIGURATIONS: Mapping[str, Callable[[], Adapter]] = MappingProxyType(
    {
        "pagedkv-full": _pagedkv((None,)),
        "pagedkv-windowed": _pagedkv((None, 6)),
        "article": _article,
        "transformers-full": _transformers(None),
        "transformers-sliding": _transformers(6),
        "vllm-full": _vllm(None),
        "vllm-hybrid": _vllm(6),
    }
)

TARGETS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "pagedkv": ("pagedkv-full", "pagedkv-windowed"),
        "article": ("article",),
        "transformers": ("transformers-full", "transformers-sliding"),
        "vllm": ("vllm-full", "vllm-hybrid"),
        **{name: (name,) for name in CONFIGURATIONS if name != "article"},
    }
)
