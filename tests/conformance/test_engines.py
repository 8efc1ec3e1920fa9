"""The engine targets run the servers' own code paths: vLLM's ``Scheduler`` and
transformers' ``ContinuousBatchProcessor``, their steps in the server's order, a request's
last forward followed by its finish in one step, and a preemption in the middle of one
(docs/conformance.md, "How each target is driven")."""

import importlib.util

import pytest

from harness.conformance import Call, EngineAdapter
from harness.conformance.targets import configuration

ENGINES = [
    pytest.param(
        "vllm-full",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("vllm") is None, reason="vllm is not installed"
        ),
    ),
    "transformers-full",
]


def _engine(name: str) -> EngineAdapter:
    adapter = configuration(name)()
    assert hasattr(adapter, "step")
    return adapter  # type: ignore[return-value]


def _trace(calls: list[Call]) -> list[str]:
    return [f"{c.operation} {c.args[0] if c.args else ''}".strip() for c in calls]


def test_the_vllm_target_is_vllms_own_scheduler() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415

    adapter = _engine("vllm-full")
    assert type(adapter.scheduler) is Scheduler  # type: ignore[attr-defined]


def test_the_transformers_target_is_its_own_batch_processor() -> None:
    from transformers.generation.continuous_batching.continuous_api import (  # noqa: PLC0415
        ContinuousBatchProcessor,
    )
    from transformers.generation.continuous_batching.scheduler import (  # noqa: PLC0415
        FIFOScheduler,
    )

    adapter = _engine("transformers-full")
    processor = adapter.processor  # type: ignore[attr-defined]
    assert type(processor) is ContinuousBatchProcessor
    assert type(processor.scheduler) is FIFOScheduler


@pytest.mark.parametrize("name", ENGINES)
def test_a_step_runs_the_last_forward_then_the_finish(name: str) -> None:
    adapter = _engine(name)
    adapter.submit("r0", (1, 2, 3))
    assert _trace(adapter.step({"r0": 0}, frozenset()))[0] == "allocate_prompt r0"
    last = _trace(adapter.step({"r0": 0}, frozenset({"r0"})))
    # The forward computes the pending token (an append), then the sampled stop token
    # finishes the request: both in one step, in that order.
    assert last.index("append_token_ids r0") < last.index("release r0")


@pytest.mark.parametrize("name", ENGINES)
def test_a_preemption_happens_in_the_middle_of_a_step(name: str) -> None:
    adapter = _engine(name)
    for request_id in ("r0", "r1"):
        adapter.submit(request_id, (1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3))
    for _ in range(40):  # both grow a token a step until the 12 blocks run out
        calls = adapter.step({"r0": 1, "r1": 2}, frozenset())
        preempts = [i for i, call in enumerate(calls) if call.operation == "preempt"]
        if preempts:
            break
    else:
        pytest.fail("no preemption in 40 steps")
    # The scheduler preempts because an allocation of this step was refused, after other
    # calls of the step: a preemption mid-step, not between steps.
    first = preempts[0]
    refused = [i for i, call in enumerate(calls[:first]) if call.outcome.refusal is not None]
    assert refused and first > 1, _trace(calls)


@pytest.mark.parametrize("name", ENGINES)
def test_a_client_abort_releases_a_running_request(name: str) -> None:
    adapter = _engine(name)
    adapter.submit("r0", (1, 2, 3, 0, 1))
    adapter.step({"r0": 0}, frozenset())
    assert _trace(adapter.abort("r0")) == ["release r0"]
    assert not any("r0" in tables for tables in adapter.observe().tables)
