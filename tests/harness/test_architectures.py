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
from harness.models import check_supported, kv_layout
from harness.oracle.checks import TokenTrace, check_alone
from harness.oracle.dense import generate_dense
from harness.oracle.device_cases import paged_cache_generate_failures
from harness.oracle.equivalence import PoolConfig, run_equivalence
from harness.runtime.engine import BatchInvariantEngine, Engine
from harness.runtime.kv_pool import PagedKVPool, PoisonedKVPool, new_manager
from harness.runtime.paged_attention import sliding_window_mask, visible_start
from harness.runtime.paged_cache import PagedCache
from harness.runtime.requests import Request
from harness.tiny_models import tiny_model
from impl import KVCacheManager
from tests.support.harness_cases import ReportsAHeldBlockAsSkipped, save_model_directory

ARCHITECTURES = ["qwen2", "qwen3", "phi3", "mistral", "gemma2", "gemma3"]
WINDOWED = ["mistral", "gemma2", "gemma3"]
# Tight enough to preempt: sliding windows free blocks as requests decode, and Gemma's two
# KV cache groups (full, windowed) each hold a prompt's blocks.
TOTAL_BLOCKS = {"mistral": 16, "gemma2": 30, "gemma3": 30}


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
        total_blocks=TOTAL_BLOCKS.get(architecture, 24),
        block_size=4,
        engine_type=engine_type,
        pool_type=PoisonedKVPool,
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
    # Windowed models freed blocks mid-run (poisoned at once), full ones never do.
    assert (report.blocks_freed_by_window > 0) == (architecture in WINDOWED)
    assert (report.peak_blocks_saved_by_window > 0) == (architecture in WINDOWED)


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


def _alone_run(
    monkeypatch: pytest.MonkeyPatch, plant: Callable[[pytest.MonkeyPatch], None]
) -> bool:
    """One Mistral request alone with ``plant`` applied to the hook: whether check 2 passed
    (and, when it did not, that the tokens changed too)."""
    loaded = tiny_model("mistral", seed=0)
    request = Request("r0", tuple(random.Random(2).randrange(256) for _ in range(20)), 6)
    dense = generate_dense(loaded.model, request.prompt_ids, request.max_new_tokens, None)
    plant(monkeypatch)
    layout = kv_layout(loaded)
    store = PoisonedKVPool(layout, 16, 4)
    engine = BatchInvariantEngine(loaded.model, new_manager(layout, 16, 4), store, None)
    output = engine.run([request]).outputs["r0"]
    check = check_alone(
        "r0", TokenTrace(output.token_ids, output.logits), TokenTrace(dense.token_ids, dense.logits)
    )
    # A misread window moves the logits (not only their last bits): the tokens change.
    assert check.passed == (output.token_ids == dense.token_ids)
    return check.passed


def test_a_hook_that_reads_one_key_short_of_the_window_fails_check_2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not _alone_run(monkeypatch, _one_key_short)


def test_a_hook_that_ignores_the_window_stops_at_the_first_skipped_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The allocator freed the blocks the window no longer reads; a hook reading them all
    # finds its table starting later and fails loudly, never reading a freed block.
    with pytest.raises(AssertionError, match=r"reads position 0, but its table starts at \d+"):
        _alone_run(monkeypatch, _no_window)


def _alone_check(store_type: type[PagedKVPool]) -> tuple[bool, bool]:
    """One Mistral request on a manager that reports a still-read block as skipped, and a
    pool of ``store_type``: whether check 2 passed, and whether a logit went NaN."""
    loaded = tiny_model("mistral", seed=0)
    request = Request("r0", tuple(random.Random(2).randrange(256) for _ in range(20)), 6)
    dense = generate_dense(loaded.model, request.prompt_ids, request.max_new_tokens, None)
    layout = kv_layout(loaded)
    manager = ReportsAHeldBlockAsSkipped(16, 4, group_windows=layout.group_windows)
    # Without prefix caching: a cached block a window skips keeps its K/V for later hits
    # and is never poisoned; an uncached one is handed over by take_transfers.
    engine = BatchInvariantEngine(
        loaded.model, manager, store_type(layout, 16, 4), None, prefix_caching=False
    )
    output = engine.run([request]).outputs["r0"]
    check = check_alone(
        "r0", TokenTrace(output.token_ids, output.logits), TokenTrace(dense.token_ids, dense.logits)
    )
    return check.passed, any(bool(row.isnan().any()) for row in output.logits)


def test_a_block_released_while_its_window_still_reads_it_fails_on_a_poisoned_pool() -> None:
    assert _alone_check(PoisonedKVPool) == (False, True)


def test_without_poisoning_the_early_release_goes_unseen() -> None:
    # The block is still held and unchanged: only poisoning shows the allocator's bug.
    assert _alone_check(PagedKVPool) == (True, False)


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


@pytest.mark.parametrize("scheduling", [["--speculate", "3"], ["--max-batch-tokens", "8"]])
def test_speculation_and_chunked_prefill_free_out_of_window_blocks_and_pass_on_gemma2(
    scheduling: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each forward's tokens are added in one operation, so the window rule sees the right
    # L0; a rollback poisons the rolled-back slots of every KV cache group's last block.
    directory = save_model_directory(tiny_model("gemma2", seed=0).model, tmp_path / "m")
    prompts = tmp_path / "prompts.jsonl"
    words = "a b c d e f g h i j k l m n o p q r s t u v w x y z"
    prompts.write_text(
        "".join(json.dumps({"prompt": words[: 2 * length - 1]}) + "\n" for length in (21, 15))
    )
    argv = ["--device", "cpu", "--model", str(directory), "--prompts-file", str(prompts)]
    argv += ["--block-size", "4", "--max-new-tokens", "12", "--poison-freed", *scheduling]
    assert main([*argv, "--json"]) == 0
    totals = json.loads(capsys.readouterr().out)["totals"]
    assert totals["blocks_freed_by_window"] > 0
    if scheduling[0] == "--speculate":
        assert totals["proposed_drafts"] > 0
    else:
        assert totals["chunks_per_prompt"] > 1


def test_the_engine_and_paged_cache_refuse_a_manager_without_the_models_groups() -> None:
    loaded = tiny_model("gemma2", seed=0)
    layout = kv_layout(loaded)
    pool = PagedKVPool(layout, 30, 4)
    with pytest.raises(
        ValueError,
        match=r"group_windows \[full attention\] are not the model's KV cache groups "
        r"\[full attention, window 8\]",
    ):
        Engine(loaded.model, KVCacheManager(30, 4), pool, None)
    with pytest.raises(
        ValueError,
        match=r"group_windows \[full attention\] are not the pool's KV cache groups "
        r"\[full attention, window 8\]",
    ):
        PagedCache(KVCacheManager(30, 4), pool, 1)
