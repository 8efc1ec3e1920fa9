"""Architectures beyond Llama on the paged pool: each tiny seeded model passes the three
checks with both engines (prefix hits, forks and preemption on a tight, poisoned pool), and
``PagedCache`` under ``generate`` is bit-identical to HF's own cache.

Each architecture brings a feature the attention hook must carry through unchanged: Qwen2
biases on q/k/v, Qwen3 q/k norms and its own head_dim, Phi-3 a fused qkv projection,
Mistral a sliding window on every layer, Gemma 2 sliding and full layers with softcapping
under eager attention, Gemma 3 sliding and full layers with a rope each and q/k norms. The
windows are narrower than most prompts here, so a query that reads one key too many or too
few changes the logits (``test_a_hook_that_misreads_the_window_fails_check_2``).
"""

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import harness.runtime.paged_attention
from harness.cli.main import main
from harness.models import check_supported, kv_layout, tiny_model
from harness.oracle.checks import TokenTrace, check_alone
from harness.oracle.dense import generate_dense
from harness.oracle.equivalence import PoolConfig, run_equivalence
from harness.runtime.engine import BatchInvariantEngine, Engine, Request
from harness.runtime.kv_pool import PoisonedKVPool
from harness.runtime.paged_attention import sliding_window_mask, visible_start
from impl import KVBlockManager
from tests.support.device_cases import paged_cache_generate_failures
from tests.support.harness_cases import save_model_directory

ARCHITECTURES = ["qwen2", "qwen3", "phi3", "mistral", "gemma2", "gemma3"]
WINDOWED = ["mistral", "gemma2", "gemma3"]


def _requests(vocab: int) -> list[Request]:
    """Six staggered requests behind a shared 8-token prefix (two full blocks of 4), every
    other one asking for two continuations (a fork after its prefill)."""
    rng = random.Random(1)
    prefix = tuple(rng.randrange(vocab) for _ in range(8))
    return [
        Request(
            f"r{number}",
            prefix + tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 30))),
            10,
            arrival_step=number,
            num_continuations=1 + number % 2,
        )
        for number in range(6)
    ]


@pytest.mark.parametrize("engine_type", [Engine, BatchInvariantEngine])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_three_checks_pass_on_a_tiny_model_of_each_architecture(
    architecture: str, engine_type: type[Engine]
) -> None:
    loaded = tiny_model(architecture, seed=0)
    check_supported(loaded.model)
    pool = PoolConfig(
        total_blocks=24, block_size=4, engine_type=engine_type, pool_type=PoisonedKVPool
    )
    report = run_equivalence(
        loaded, _requests(loaded.model.config.vocab_size), pool, lambda _: None
    )
    failures = [
        check.detail
        for row in report.rows
        for check in (row.gate, row.alone, row.batch)
        if not check.passed
    ]
    assert failures == []
    assert report.schedules_equal
    # The run went through every sharing path: hits, copies after forks, preemption.
    assert report.prefix_hit_tokens > 0
    assert report.cow_copies > 0
    assert report.preemptions > 0


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_paged_cache_under_generate_is_bit_identical_for_each_architecture(
    architecture: str,
) -> None:
    failures = paged_cache_generate_failures(torch.device("cpu"), torch.float32, architecture)
    assert failures == []


# -- the window is read exactly: planted misreadings fail -------------------------------


def _one_key_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant a decode that reads W - 1 keys: the window's first key is dropped."""
    monkeypatch.setattr(
        harness.runtime.paged_attention,
        "visible_start",
        lambda query_count, token_count, window: (
            visible_start(query_count, token_count, window)
            + (query_count == 1 and window is not None and token_count > window)
        ),
    )


def _no_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant a hook that drops the window: every earlier key, a plain causal mask."""
    monkeypatch.setattr(
        harness.runtime.paged_attention, "visible_start", lambda query_count, token_count, _: 0
    )
    monkeypatch.setattr(
        harness.runtime.paged_attention,
        "sliding_window_mask",
        lambda request, _: sliding_window_mask(request, request.token_count + 1),
    )


@pytest.mark.parametrize("plant", [_one_key_short, _no_window])
def test_a_hook_that_misreads_the_window_fails_check_2(
    monkeypatch: pytest.MonkeyPatch, plant: Callable[[pytest.MonkeyPatch], None]
) -> None:
    loaded = tiny_model("mistral", seed=0)
    request = Request("r0", tuple(random.Random(2).randrange(256) for _ in range(20)), 6)
    dense = generate_dense(loaded.model, request.prompt_ids, request.max_new_tokens, None)
    plant(monkeypatch)
    store = PoisonedKVPool(kv_layout(loaded), 16, 4)
    engine = BatchInvariantEngine(loaded.model, KVBlockManager(16, 4), store, None)
    output = engine.run([request]).outputs["r0"]
    check = check_alone(
        "r0", TokenTrace(output.token_ids, output.logits), TokenTrace(dense.token_ids, dense.logits)
    )
    assert not check.passed
    # A misread window moves the logits (not only their last bits): the tokens change.
    assert output.token_ids != dense.token_ids


# -- python -m harness on a saved model directory --------------------------------------


@pytest.mark.parametrize("architecture", WINDOWED)
def test_python_m_harness_passes_on_a_saved_directory_of_each_windowed_architecture(
    architecture: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = save_model_directory(tiny_model(architecture, seed=0).model, tmp_path / "m")
    prompts = tmp_path / "prompts.jsonl"
    words = "a b c d e f g h i j k l m n o p q r s t u v w x y z"
    prompts.write_text(
        "".join(json.dumps({"prompt": words[: 2 * length]}) + "\n" for length in (13, 11))
    )
    argv = ["--device", "cpu", "--model", str(directory), "--prompts-file", str(prompts)]
    argv += ["--block-size", "4", "--max-new-tokens", "4", "--poison-freed"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"]
    assert result["model"] == "m"
