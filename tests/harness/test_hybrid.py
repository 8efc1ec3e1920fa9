"""Hybrid models on the paged pool: LFM2 (short convolution beside attention) and
Qwen3-Next (gated DeltaNet beside attention), their recurrent states in the rows of a
state group (``RecurrentState(C)``), checkpointed on the chunk grid, restored by prefix
hits, copied at forks, recomputed from the last checkpoint after preemption.

Each run is on a tight, poisoned pool: a state row freed and read again is NaN. The
planted bugs at the end (a restore from the wrong row, a state read before it is
written, impl's tracker bugs) are each caught by the checks.
"""

import functools
import json
import random
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import JambaConfig, JambaForCausalLM

from harness.check import check_model
from harness.cli.main import main
from harness.kv_events import KVEventLog
from harness.limits import MEMORY_FRACTION, check_memory, kv_bytes
from harness.models import LoadedModel, UnsupportedModelError, check_supported, kv_layout
from harness.oracle.checks import TokenTrace, check_batch, tie_rule
from harness.oracle.dense import DenseOutput, generate_dense
from harness.oracle.equivalence import PoolConfig, run_equivalence
from harness.runtime.attention_backends import TRITON, VARLEN_EMULATED, PagedKernel
from harness.runtime.engine import Engine
from harness.runtime.kv_pool import PagedKVPool, PoisonedKVPool
from harness.runtime.paged_cache import PagedCache
from harness.runtime.requests import Request, RequestOutput
from harness.runtime.scheduler import Scheduling
from harness.runtime.state_mixer import PagedStateMixer
from harness.runtime.state_store import StateRows
from harness.settings import CheckSettingsError
from harness.tiny_models import HYBRID_ARCHITECTURES, save_tiny_model, tiny_model
from impl import KVCacheManager
from spec import BlockStored
from tests.support.state_planted_bugs import CommonHitIsTheMax, HitsPastTheLastCheckpoint

BLOCK_SIZE = 4
INTERVAL = 8  # two blocks
TIGHT_BLOCKS = 22  # preempts several times


def _requests(count: int = 6, new_tokens: int = 8, forks: bool = True) -> list[Request]:
    """``count`` staggered requests behind a shared 12-token prefix (a checkpoint at 8 every
    later one can hit, and attention blocks to 12 a wrong hit would take), every other one
    with two continuations (a fork) if ``forks``."""
    rng = random.Random(1)
    prefix = tuple(rng.randrange(256) for _ in range(12))
    return [
        Request(
            f"r{number}",
            prefix + tuple(rng.randrange(256) for _ in range(rng.randint(1, 30))),
            new_tokens,
            arrival_step=2 * number,
            num_continuations=1 + (forks and number % 2),
        )
        for number in range(count)
    ]


def _engine_requests() -> list[Request]:
    """The engine runs' requests: enough of them, long enough, that each planted bug flips
    a greedy token somewhere (a wrong state moves logits by ~2, not always past the top 2)."""
    return _requests(count=8, new_tokens=12, forks=False)


def _hybrid(architecture: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    loaded = tiny_model(architecture, seed=0)
    return replace(loaded, model=loaded.model.to(dtype))


def _engine_run(
    loaded: LoadedModel,
    pool_type: type[PagedKVPool] = PoisonedKVPool,
    manager_type: type[KVCacheManager] = KVCacheManager,
) -> dict[str, RequestOutput]:
    """Every request's output from one continuous-batching run of ``_engine_requests()``
    on a tight pool, chunks on the checkpoint grid; asserts that prefix hits restored
    states and that the run preempted."""
    layout = kv_layout(loaded, INTERVAL)
    manager = manager_type(TIGHT_BLOCKS, BLOCK_SIZE, group_windows=layout.group_windows)
    engine = Engine(
        loaded.model,
        manager,
        pool_type(layout, TIGHT_BLOCKS, BLOCK_SIZE),
        None,
        scheduling=Scheduling(checkpoint_interval=INTERVAL),
    )
    result = engine.run(_engine_requests())
    assert result.prefix_hit_tokens > 0
    assert result.preemptions > 0
    return result.outputs


@functools.cache
def _dense(architecture: str) -> dict[str, DenseOutput]:
    """``generate`` on each of ``_engine_requests()``."""
    model = _hybrid(architecture).model
    return {
        request.request_id: generate_dense(model, request.prompt_ids, request.max_new_tokens, None)
        for request in _engine_requests()
    }


def _batch_failures(outputs: dict[str, RequestOutput], architecture: str) -> list[str]:
    """The requests whose tokens and logits fail check 3 against ``generate``'s."""
    rule = tie_rule(torch.float32)
    return [
        request_id
        for request_id, output in outputs.items()
        if not check_batch(
            request_id,
            TokenTrace(output.token_ids, output.logits),
            TokenTrace(
                _dense(architecture)[request_id].token_ids, _dense(architecture)[request_id].logits
            ),
            rule,
        ).passed
    ]


@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
def test_prefix_hits_restore_the_state_and_tokens_equal_generate(architecture: str) -> None:
    outputs = _engine_run(_hybrid(architecture))
    dense = _dense(architecture)
    assert {r: o.token_ids for r, o in outputs.items()} == {
        r: d.token_ids for r, d in dense.items()
    }
    assert _batch_failures(outputs, architecture) == []


def _tight_pool() -> PoolConfig:
    """A pool too small for the requests at once, poisoned, checkpointing every INTERVAL."""
    return PoolConfig(
        total_blocks=TIGHT_BLOCKS,
        block_size=BLOCK_SIZE,
        pool_type=PoisonedKVPool,
        scheduling=Scheduling(checkpoint_interval=INTERVAL),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
def test_the_three_checks_pass_on_each_hybrid_with_hits_forks_and_preemption(
    architecture: str, dtype: torch.dtype
) -> None:
    pool = _tight_pool()
    report = run_equivalence(_hybrid(architecture, dtype), _requests(), pool, lambda _: None)
    assert report.failures == []
    assert report.prefix_hit_tokens > 0
    assert report.cow_copies > 0
    assert report.preemptions > 0
    # Every hit ends on a checkpoint: the state group's grid.
    assert all(row.prefix_hit_tokens % INTERVAL == 0 for row in report.rows)


@pytest.mark.parametrize(
    ("architecture", "backend"),
    [("lfm2", VARLEN_EMULATED), ("falcon_h1", TRITON)],
    ids=["lfm2-varlen-emulated", "falcon_h1-triton"],
)
def test_a_kernel_backend_computes_a_hybrid_s_attention_beside_its_state_layers(
    architecture: str, backend: PagedKernel
) -> None:
    # The kernel takes the attention group's tables (group 0); the state layers run per
    # request as under gather. Falcon-H1: every layer attends and holds a state.
    pool = replace(_tight_pool(), attention=backend)
    report = run_equivalence(_hybrid(architecture), _requests(), pool, lambda _: None)
    assert report.failures == []
    assert report.prefix_hit_tokens > 0 and report.preemptions > 0


def test_check_model_runs_on_a_users_hybrid_model() -> None:
    model = tiny_model("lfm2", seed=3).model
    rng = random.Random(4)
    shared = [rng.randrange(256) for _ in range(17)]
    prompts = [shared + [rng.randrange(256) for _ in range(n)] for n in (3, 9, 14)]
    report = check_model(
        model, None, prompts, max_new_tokens=6, block_size=4, checkpoint_interval=8
    )
    assert report.passed
    # The later prompts hit a state checkpointed on the grid, at 8 or 16.
    assert report.prefix_hit_tokens > 0
    assert all(row.prefix_hit_tokens % 8 == 0 for row in report.rows)


# Issue 49, item 7: an interval past what every request feeds ran with no checkpoint, so no
# hit, silently.
def test_an_interval_is_refused_past_the_last_checkpoint_the_longest_request_takes() -> None:
    model = tiny_model("lfm2", seed=0).model
    prompt = list(range(30, 40))
    # 10 prompt tokens and 5 of the 6 new fed: a checkpoint at 14 (a 15th follows), none at 15.
    log = KVEventLog()
    check_model(
        model, None, [prompt], max_new_tokens=6, block_size=1, checkpoint_interval=14, kv_events=log
    )
    states = [event for _, event in log.events if isinstance(event, BlockStored) and event.group]
    assert [len(event.token_ids) for event in states] == [14]
    with pytest.raises(CheckSettingsError) as refused:
        check_model(
            model, None, [prompt, [1, 2]], max_new_tokens=6, block_size=1, checkpoint_interval=15
        )
    assert refused.value.setting == "checkpoint_interval"
    assert str(refused.value) == (
        "checkpoint_interval 15 would checkpoint no state, so no prefix hit: a state is "
        "checkpointed at 15 tokens when a token follows, and the longest request feeds 15 "
        "(10 prompt tokens and 5 of its 6 new: the last is not fed)"
    )
    # The default interval is not the user's: it runs, unreached, on short prompts.
    assert check_model(model, None, [prompt], max_new_tokens=6, block_size=1).passed


# -- the command line ------------------------------------------------------------------


def _saved(architecture: str, tmp_path: Path) -> list[str]:
    """A saved tiny model and a prompts file: the command's arguments for them."""
    directory = save_tiny_model(architecture, 0, tmp_path / architecture)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": text}) + "\n" for text in ("What is a block table?", "hi"))
    )
    argv = ["--device", "cpu", "--model", str(directory), "--prompts-file", str(prompts)]
    return [*argv, "--block-size", "8", "--max-new-tokens", "6", "--poison-freed"]


@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
def test_python_m_harness_passes_on_a_saved_hybrid_with_state_hits(
    architecture: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*_saved(architecture, tmp_path), "--checkpoint-interval", "16", "--json"]
    assert main([*argv, "--pool-map", "1000"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["passed"]
    # The byte-level chat template's shared system turn is over 64 bytes long.
    assert result["totals"]["prefix_hit_tokens"] > 0
    assert result["checkpoint_interval"] == 16
    assert result["state_bytes"] > 0
    # The pool map names each request's state block and the checkpoints cached.
    assert "state group 1 (checkpoint every 16 tokens): running A:" in captured.err
    assert re.search(r"checkpoints \(block@tokens\) \d+@(16|32|48|64)\b", captured.err)


@pytest.mark.parametrize(
    "options",
    [
        ["--no-prefix-cache"],
        ["--max-batch-tokens", "24"],
        ["--n", "2"],
        ["--salts", "2"],
        ["--attention", "triton"],
    ],
)
def test_python_m_harness_passes_on_a_saved_hybrid_with_other_options(
    options: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*_saved("lfm2", tmp_path), "--checkpoint-interval", "16", "--json", *options]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["passed"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--speculate", "2"], "--speculate 2 is refused for a hybrid model: a rejected draft"),
        (["--preempt", "swap"], "--preempt swap is refused for a hybrid model"),
        (
            ["--checkpoint-interval", "12"],
            "--checkpoint-interval 12 is not a multiple of the block size 8",
        ),
        (
            ["--checkpoint-interval", str(10**12)],
            f"--checkpoint-interval {10**12} would checkpoint no state, so no prefix hit",
        ),
    ],
)
def test_what_a_recurrent_state_cannot_do_is_refused_in_one_line(
    options: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_saved("lfm2", tmp_path), *options]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error


# -- planted bugs ----------------------------------------------------------------------


class RestoresFromTheWrongRow(PoisonedKVPool):
    """A restore that reads the checkpoint from the wrong slot: every state copy reads the
    row after its source."""

    __slots__ = ()

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        super().copy_states([((source + 1) % self.total_blocks, dest) for source, dest in copies])


class PoisonsNoStateRow(PoisonedKVPool):
    """A poisoned pool that poisons K/V only: a freed state row keeps its stale state."""

    __slots__ = ()

    def poison_states(self, block_ids: list[int]) -> None:
        """Nothing: the state rows keep what they hold."""


def _has_nan(outputs: dict[str, RequestOutput]) -> bool:
    return any(bool(row.isnan().any()) for output in outputs.values() for row in output.logits)


@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
def test_a_restore_from_the_wrong_row_fails_check_3(architecture: str) -> None:
    outputs = _engine_run(_hybrid(architecture), pool_type=RestoresFromTheWrongRow)
    assert _batch_failures(outputs, architecture) != []


def _reads_before_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant a state layer that reads its row even with no token computed before (a fresh
    request's row holds a freed request's state, or the poison)."""
    original = PagedStateMixer._cache
    monkeypatch.setattr(
        PagedStateMixer, "_cache", lambda self, views, prior: original(self, views, prior + 1)
    )


def test_a_state_read_before_it_is_written_turns_nan_on_the_poisoned_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _reads_before_written(monkeypatch)
    assert _has_nan(_engine_run(_hybrid("lfm2")))


def test_without_poisoning_state_rows_the_stale_read_goes_unseen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _reads_before_written(monkeypatch)
    assert not _has_nan(_engine_run(_hybrid("lfm2"), pool_type=PoisonsNoStateRow))


@pytest.mark.parametrize("manager_type", [HitsPastTheLastCheckpoint, CommonHitIsTheMax])
def test_impls_planted_hit_bugs_fail_check_3(manager_type: type[KVCacheManager]) -> None:
    # Qwen3-Next: a gated DeltaNet state remembers every token (LFM2's short convolution
    # only its last three inputs, which attention then dilutes).
    outputs = _engine_run(_hybrid("qwen3_next"), manager_type=manager_type)
    assert _batch_failures(outputs, "qwen3_next") != []


def test_a_hybrid_whose_state_mixer_the_harness_does_not_know_is_refused() -> None:
    # Jamba's Mamba layers are `linear_attention` too, but its decoder layer calls the mixer
    # without the layer's keywords, so the step cannot reach a paged wrapper (and with the
    # step taken from the layer instead, tried on 2026-12-08, its tokens after a prefix hit
    # were not generate's): it is not in STATE_MIXERS, and is refused in one line, never
    # run with mixed requests.
    config = JambaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    )
    model = JambaForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match=r"layer_types has \['linear_attention'\]"):
        check_supported(model)


def test_paged_cache_under_generate_refuses_a_hybrid() -> None:
    layout = kv_layout(_hybrid("lfm2"), INTERVAL)
    pool = PagedKVPool(layout, 8, BLOCK_SIZE)
    manager = KVCacheManager(8, BLOCK_SIZE, group_windows=layout.group_windows)
    with pytest.raises(ValueError, match=r"PagedCache holds attention layers only; layers"):
        PagedCache(manager, pool, 1)


def test_the_table_names_the_state_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_saved("lfm2", tmp_path)) == 0
    assert (
        "recurrent state group: one state block per request, checkpointed every 64 tokens"
        in capsys.readouterr().out
    )


def test_the_memory_check_counts_the_state_rows() -> None:
    layout = kv_layout(_hybrid("qwen3_next"), INTERVAL)
    # The layout's arithmetic is what the rows really take.
    assert layout.state_bytes_per_block == StateRows(layout, 1).nbytes > 0
    requests = _requests()
    blocks = 40
    pool, contiguous = kv_bytes(requests, blocks, BLOCK_SIZE, layout)
    state = blocks * layout.state_bytes_per_block
    kv_alone = pool - state + contiguous
    # Room for the K/V and half the state rows: refused, the state rows named.
    available = int((kv_alone + state // 2) / MEMORY_FRACTION)
    with pytest.raises(CheckSettingsError, match=r"bytes of state rows a block"):
        check_memory(requests, blocks, BLOCK_SIZE, layout, available)
    check_memory(
        requests, blocks, BLOCK_SIZE, layout, int((pool + contiguous) / MEMORY_FRACTION) + 1
    )
