"""The bundled conformance targets, by name, each a list of configurations, and a user's
own target named ``package.module:factory``.

A configuration's factory imports its target's package only when called, so naming a
target whose package is absent fails with ``TargetUnavailableError`` (one line), not at import.
"""

import importlib.util
from collections.abc import Callable, Mapping
from types import MappingProxyType

from harness.conformance.adapter import Adapter, EngineAdapter
from harness.named_callables import NamedCallableError, load_callable

Factory = Callable[[], Adapter | EngineAdapter]


class TargetUnavailableError(RuntimeError):
    """A target whose package is not installed, or a ``module:factory`` that cannot be loaded."""


def _pagedkv(group_windows: tuple[int | None, ...]) -> Callable[[bool], Factory]:
    def make() -> Adapter:
        from harness.conformance.targets.pagedkv import PagedKVAdapter  # noqa: PLC0415

        return PagedKVAdapter(group_windows=group_windows)

    return lambda known_findings: make


def _article() -> Adapter:
    from harness.conformance.targets.article import ArticleBlockManager  # noqa: PLC0415

    return ArticleBlockManager()


def _transformers(sliding_window: int | None) -> Callable[[bool], Factory]:
    def with_findings(known_findings: bool) -> Factory:
        def make() -> EngineAdapter:
            # Lazy: transformers and torch take seconds to import.
            from harness.conformance.targets.transformers_engine import (  # noqa: PLC0415
                TransformersEngine,
            )

            return TransformersEngine(sliding_window=sliding_window, known_findings=known_findings)

        return make

    return with_findings


def _require_vllm(target: str) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise TargetUnavailableError(
            f"target {target} needs the vllm package: run scripts/setup.sh (it installs "
            "the 'conformance' pins)"
        )


def _vllm(sliding_window: int | None) -> Callable[[bool], Factory]:
    def with_findings(known_findings: bool) -> Factory:
        def make() -> EngineAdapter:
            _require_vllm("vllm")
            from harness.conformance.targets.vllm_engine import VLLMEngine  # noqa: PLC0415

            return VLLMEngine(sliding_window=sliding_window, known_findings=known_findings)

        return make

    return with_findings


def _vllm_mamba(known_findings: bool) -> Factory:
    def make() -> EngineAdapter:
        _require_vllm("vllm-mamba")
        from harness.conformance.targets.vllm_mamba import VLLMMambaEngine  # noqa: PLC0415

        return VLLMMambaEngine(known_findings=known_findings)

    return make


_MAKERS: Mapping[str, Callable[[bool], Factory]] = MappingProxyType(
    {
        "pagedkv-full": _pagedkv((None,)),
        "pagedkv-windowed": _pagedkv((None, 6)),
        "article": lambda known_findings: _article,
        "transformers-full": _transformers(None),
        "transformers-sliding": _transformers(6),
        "vllm-full": _vllm(None),
        "vllm-hybrid": _vllm(6),
        "vllm-mamba": _vllm_mamba,
    }
)


def configuration(name: str, known_findings: bool = False) -> Factory:
    """The factory of bundled configuration ``name``; with ``known_findings``, its adapters
    declare the target's findings (docs/findings/) as differences, so that a run looks
    past them for other bugs."""
    return _MAKERS[name](known_findings)


CONFIGURATIONS: Mapping[str, Factory] = MappingProxyType(
    {name: configuration(name) for name in _MAKERS}
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


def load_factory(target: str) -> Factory:
    """The factory ``target`` names, ``package.module:factory`` (a class or a function
    returning a fresh adapter); the module is looked up as ``python -m`` would, from the
    current directory first. ``TargetUnavailableError`` says in one line what is wrong."""
    if ":" not in target:
        raise TargetUnavailableError(
            f"target {target!r} is neither a bundled target ({', '.join(TARGETS)}) nor "
            "package.module:factory"
        )
    try:
        return load_callable(target, "a factory of adapters")  # type: ignore[return-value]
    except NamedCallableError as error:
        raise TargetUnavailableError(str(error)) from error
