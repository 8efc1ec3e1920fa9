"""The kit refuses a broken adapter, factory or argument before its first step: one line that
names the adapter and its fault, exit 2 from the command line (1 is a discrepancy in the
target), ``AdapterError`` (a ``ValueError``) from the Python API. A fault of the adapter's own
view mid-run (``observe`` raising on a later step) is refused the same way."""

import math
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.conformance import (
    AdapterError,
    Call,
    EngineAdapter,
    assert_conforms,
    check_target,
    cli,
)
from tests.conformance import faulty_adapters
from tests.conformance.adapter_template import TinyPrefixPoolAdapter, make

FAULTS = [
    ("raises", "faulty_adapters.raises raised RuntimeError: the pool's config file is missing"),
    ("returns_none", "faulty_adapters.returns_none returned None, not an adapter"),
    ("returns_the_class", "returned the class TinyPrefixPoolAdapter, not an adapter"),
    ("needs_an_argument", "must take no arguments (the kit calls it with none, once per test"),
    ("returns_the_same_instance", "returned the same adapter twice: it must return a fresh"),
    ("without_observe", "adapter 'WithoutObserve': it has no method observe()"),
    ("observe_is_not_a_method", "adapter 'TinyPrefixPool': it has no method observe()"),
    (
        "observe_raises",
        "observe() raised AttributeError: 'TinyPrefixPool' object has no attribute 'blocks' "
        "on a fresh adapter",
    ),
    ("observe_returns_none", "observe() must return an Observation, got NoneType on a fresh"),
    ("block_size_0", "adapter 'TinyPrefixPool': block_size must be at least 1, got 0"),
    ("block_size_str", "block_size must be an int, got str '4'"),
    ("block_size_negative", "block_size must be at least 1, got -4"),
    ("block_size_float", "block_size must be an int, got float 4.0"),
    ("block_size_bool", "block_size must be an int, got bool True"),
    ("group_windows_empty", "group_windows must name at least 1 KV cache group, got 0"),
    ("group_windows_an_int", "group_windows must be a tuple, got int 6"),
    ("group_windows_zero_window", "window of group 1 must be at least 1 token, got 0"),
    (
        "group_windows_off_grid",
        "interval of state group 1 must be a positive multiple of the block size 4, got 6",
    ),
    ("supports_empty", "supports must name allocate_prompt or allocate (a request is admitted"),
    ("supports_unknown", "supports names 'relase', which the kit does not know"),
    ("supports_a_str", "supports must be a set of names, got str 'allocate_prompt'"),
    ("supports_missing_method", "supports names fork, but it is no method of the adapter"),
    ("pool_empty", "pool_block_ids: total_blocks must be at least 1, got 0"),
    ("pool_of_strs", "pool_block_ids must hold ints, got str 'a'"),
    ("pool_repeats", "pool_block_ids holds block 1 twice"),
    ("name_empty", "adapter TinyPrefixPoolAdapter: name must be a non-empty str, got str ''"),
    ("differences_a_list", "differences must be a mapping of property names to reasons, got list"),
    ("differences_unknown", "differences names 'conservaton', which is no property"),
    ("exact_a_str", "exact must be a bool, got str 'yes'"),
    ("kv_events_without_take_events", "supports names kv_events, but take_events() is no method"),
    (
        "observe_shows_two_groups",
        "observe() showed tables for 2 KV cache group(s), group_windows declares 1, on a fresh",
    ),
    (
        "huge_pool",
        "pool_block_ids: total_blocks must be at most 16,777,216, got 100,000,000 (the spec's",
    ),
]


def _cli(target: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit code of a short run of ``target``, and what it wrote to stderr."""
    code = cli.main(["--target", target, "--steps", "50", "--progress-every", "1000"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("factory", "message"), FAULTS, ids=[f for f, _ in FAULTS])
def test_a_broken_adapter_exits_2_with_one_line_naming_it_and_its_fault(
    factory: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"tests.conformance.faulty_adapters:{factory}"
    code, err = _cli(target, capsys)
    assert code == 2
    assert err.startswith(f"{cli.PROG}: error: {target}: ") and message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("factory", "message"), FAULTS, ids=[f for f, _ in FAULTS])
def test_check_target_refuses_a_broken_adapter_with_an_adapter_error_before_any_step(
    factory: str, message: str
) -> None:
    progress: list[int] = []
    with pytest.raises(AdapterError, match=r"^[^\n]*$") as refused:
        check_target(
            getattr(faulty_adapters, factory),
            steps=50,
            progress=lambda report: progress.append(report.steps),
            progress_every_s=0,
        )
    assert message in str(refused.value) and progress == []
    assert isinstance(refused.value, ValueError)


def test_a_factory_that_is_not_callable_is_refused() -> None:
    with pytest.raises(AdapterError, match="the factory must be callable, got NoneType None"):
        check_target(None, steps=5)  # type: ignore[arg-type]


def test_observe_raising_mid_run_is_the_adapters_fault_with_the_step_it_followed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``observe`` answers a fresh adapter, then raises from its 7th call: not a discrepancy
    (exit 1) but the adapter's fault (exit 2), in one line naming the step, once shrunk."""
    code, err = _cli("tests.conformance.faulty_adapters:observe_raises_later", capsys)
    started, refused = err.strip().splitlines()  # the progress line at the start, the fault
    assert code == 2 and ": 0/50 steps, 0 cases, " in started
    assert refused.startswith(f"{cli.PROG}: error: tests.conformance.faulty_adapters:")
    assert "adapter 'TinyPrefixPool': observe() raised KeyError: 'r3' after step " in refused
    assert " of a test case, " in refused
    with pytest.raises(AdapterError, match=r"observe\(\) raised KeyError: 'r3' after step \d+"):
        check_target(faulty_adapters.observe_raises_later, steps=50, shrink_seconds=5)


def test_take_events_raising_mid_run_is_the_adapters_fault() -> None:
    with pytest.raises(AdapterError) as refused:
        check_target(faulty_adapters.take_events_raises, steps=50, shrink_seconds=5)
    assert "take_events() raised RuntimeError: the event queue is closed after " in str(
        refused.value
    )


def test_a_factory_that_fails_at_a_later_test_case_is_the_adapters_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(faulty_adapters, "_MADE", [0])
    with pytest.raises(AdapterError, match=r"fails_later raised OSError: too many open files$"):
        check_target(faulty_adapters.fails_later, steps=500, shrink_seconds=5)


def test_what_an_operation_raises_stays_a_discrepancy_in_the_target() -> None:
    """The spec judges an operation's exception (``raises_only_refusals``): exit 1, not 2."""

    class RaisesOnRelease(faulty_adapters.NeedsNothing):
        def release(self, request_id: str) -> None:
            raise KeyError(request_id)

    report = check_target(RaisesOnRelease, steps=200, shrink_seconds=5)
    assert report.discrepancy is not None
    assert "raises_only_refusals" in {f.name for f in report.discrepancy.bugs()}


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def make(:\n", "cannot import 'kit_syntax_error': SyntaxError: invalid syntax"),
        ("import no_such_package_here\n", "No module named 'no_such_package_here'"),
        ("raise RuntimeError('no GPU')\n", "cannot import 'kit_raises': RuntimeError: no GPU"),
    ],
    ids=["syntax_error", "import_error", "raises"],
)
def test_a_module_that_does_not_import_exits_2_with_one_line(
    source: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = message.split("'")[1] if message.startswith("cannot") else "kit_import_error"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = _cli(f"{module}:make", capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_relative_module_name_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _cli(".adapter_template:make", capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "'.adapter_template' is a relative module name: name it from the top" in err


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        ({"steps": 0}, ValueError, "steps must be at least 1, got 0"),
        ({"steps": -3}, ValueError, "steps must be at least 1, got -3"),
        ({"steps": "5"}, TypeError, "steps must be an int, got str '5'"),
        ({"steps": 5.0}, TypeError, "steps must be an int, got float 5.0"),
        ({"steps": True}, TypeError, "steps must be an int, got bool True"),
        ({"seed": "x"}, TypeError, "seed must be an int, got str 'x'"),
        ({"seed": None}, TypeError, "seed must be an int, got NoneType None"),
        ({"shrink_seconds": -1}, ValueError, "shrink_seconds must be a finite number of at "),
        ({"shrink_seconds": math.inf}, ValueError, "shrink_seconds must be a finite number of"),
        ({"shrink_seconds": "60"}, TypeError, "shrink_seconds must be a number, got str '60'"),
        ({"progress_every_s": -1.0}, ValueError, "progress_every_s must be a finite number"),
    ],
)
def test_check_target_refuses_its_arguments_naming_the_keyword_and_the_value(
    keywords: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{message}"):
        check_target(make, **keywords)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        ({"steps": 0}, ValueError, "steps must be at least 1, got 0"),
        ({"steps": "5"}, TypeError, "steps must be an int, got str '5'"),
        ({"seed": "x"}, TypeError, "seed must be an int, got str 'x'"),
    ],
)
def test_assert_conforms_checks_something_or_refuses(
    keywords: dict[str, object], error: type[Exception], message: str
) -> None:
    """``steps=0`` passed with 0 steps: ``assert_conforms`` then checked nothing."""
    with pytest.raises(error, match=f"^{message}"):
        assert_conforms(make, **keywords)  # type: ignore[arg-type]


def test_progress_is_reported_before_the_first_step_and_between_the_steps_of_a_case() -> None:
    """A target slow to start or slow enough that a test case outlasts ``progress_every_s``
    (a big pool, a server) is not silent: progress comes once the adapter is accepted, then
    after a step, not only after a whole case."""
    calls: list[int] = []
    report = check_target(
        make, steps=20, progress=lambda r: calls.append(r.steps), progress_every_s=0
    )
    assert calls[0] == 0 and len(calls) == 1 + report.steps + report.cases


def test_a_class_is_a_factory_too_and_a_good_adapter_runs() -> None:
    report = check_target(TinyPrefixPoolAdapter, steps=20)
    assert report.discrepancy is None and report.steps >= 20


def _transformers_engine(**overrides: object) -> Callable[[], EngineAdapter]:
    """A factory of transformers' bundled engine adapter with ``overrides`` in place of its
    methods."""
    from harness.conformance.targets.transformers_engine import (  # noqa: PLC0415
        TransformersEngine,
    )

    engine = type("TransformersEngine", (TransformersEngine,), overrides)
    return lambda: engine(sliding_window=None, known_findings=True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"abort": None}, "it has no method abort()"),
        ({"supports": frozenset({"allocate_prompt"})}, "supports names 'allocate_prompt', which"),
    ],
    ids=["no_abort", "supports_an_operation"],
)
def test_an_engine_adapter_is_checked_as_an_engine(
    overrides: dict[str, object], message: str
) -> None:
    """An engine adapter has submit, step and abort; its steps are the server's, so its
    ``supports`` names no operation (only cache_salt and kv_events)."""
    with pytest.raises(AdapterError, match=re.escape(message)):
        check_target(_transformers_engine(**overrides), steps=5)


def test_an_engine_adapter_raising_outside_its_servers_step_is_the_adapters_fault() -> None:
    """The server's own exceptions come as ``ServerError`` (``record_calls``); anything else
    out of ``step`` is the adapter's."""

    def step(self: EngineAdapter, sampled: object, finishing: object) -> list[Call]:
        raise RuntimeError("the adapter's own bookkeeping")

    with pytest.raises(AdapterError) as refused:
        check_target(_transformers_engine(step=step), steps=20, shrink_seconds=5)
    assert "raised RuntimeError: the adapter's own bookkeeping outside its server's step (not " in (
        str(refused.value)
    )


def test_a_server_that_raises_on_an_arrival_is_a_discrepancy_in_the_target() -> None:
    """An arrival is the server's own call (``add_request``): what it raises is judged."""
    from harness.conformance.targets.transformers_engine import (  # noqa: PLC0415
        TransformersEngine,
    )

    def submit(
        self: TransformersEngine, request_id: str, token_ids: tuple[int, ...], cache_salt: None
    ) -> None:
        if len(token_ids) > 8:
            raise ValueError(f"a prompt of {len(token_ids)} tokens")
        TransformersEngine.submit(self, request_id, token_ids, cache_salt)

    report = check_target(_transformers_engine(submit=submit), steps=100, shrink_seconds=5)
    assert report.discrepancy is not None
    assert "raises_only_refusals" in {f.name for f in report.discrepancy.bugs()}
