"""Shared pieces of the harness tests: the tiny model, token-id requests, planted bugs.

Not a conftest: the tests import what they use. The planted bugs are deliberately broken
collaborators; each harness test that guards against one shows it catches it.
"""

import functools
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from harness.kv_layout import KVLayout
from harness.models import LoadedModel, kv_layout
from harness.oracle.checks import TokenTrace
from harness.oracle.dense import DenseOutput, generate_dense
from harness.oracle.device_cases import poisoned_pool as layout_poisoned_pool
from harness.oracle.device_cases import staggered_requests
from harness.runtime.allocation import NO_PREFIX_CACHING, PREFIX_CACHING, Allocation
from harness.runtime.attention_backends import GATHER, AttentionBackend
from harness.runtime.contiguous_kv import ContiguousKVBuffers
from harness.runtime.engine import Engine
from harness.runtime.kv_pool import PagedKVPool, PoisonedKVPool, new_manager
from harness.runtime.kv_store import KVStore
from harness.runtime.requests import Request, RunningRequest
from harness.runtime.results import EngineResult
from harness.tiny_models import tiny_llama
from impl import AppendedSlots, KVBlockManager, ReleasedBlocks, RequestBlockTable
from impl.prefix_cache import EventSink
from spec import slot_index


@functools.cache
def tiny_model() -> LoadedModel:
    """The seeded tiny Llama, built once per test session (float32, CPU)."""
    return tiny_llama(seed=0)


def make_requests(
    count: int, max_new_tokens: int, arrival_gap: int, seed: int = 1
) -> list[Request]:
    """``count`` token-id requests for the tiny model (``staggered_requests``)."""
    vocab_size = tiny_model().model.config.vocab_size
    return staggered_requests(count, vocab_size, max_new_tokens, arrival_gap, seed)


def run(
    requests: list[Request],
    store: KVStore,
    manager: KVBlockManager,
    engine_type: type[Engine] = Engine,
    allocation: Allocation = PREFIX_CACHING,
    *,
    attention: AttentionBackend = GATHER,
) -> EngineResult:
    """Run ``requests`` through ``engine_type`` on the tiny model."""
    engine = engine_type(tiny_model().model, manager, store, None, allocation, attention=attention)
    return engine.run(requests)


def paged_and_contiguous(
    requests: list[Request],
    *,
    manager_type: type[KVBlockManager],
    total_blocks: int,
    block_size: int,
    pool_type: type[PagedKVPool] = PagedKVPool,
    engine_type: type[Engine] = Engine,
    attention: AttentionBackend = GATHER,
) -> tuple[EngineResult, EngineResult]:
    """The same requests on a paged pool and on contiguous buffers (the gate's two runs),
    both through ``attention``.

    Without prefix caching on both sides: contiguous buffers hold no K/V for a prefix hit.
    """
    layout = pool_layout()
    paged = run(
        requests,
        pool_type(layout, total_blocks, block_size),
        manager_type(total_blocks, block_size),
        engine_type,
        NO_PREFIX_CACHING,
        attention=attention,
    )
    max_tokens = max(request.max_tokens for request in requests)
    contiguous = run(
        requests,
        ContiguousKVBuffers(layout, max_tokens, block_size),
        KVBlockManager(total_blocks, block_size),
        engine_type,
        NO_PREFIX_CACHING,
        attention=attention,
    )
    return paged, contiguous


def pool_layout() -> KVLayout:
    """The tiny model's K/V layout."""
    return kv_layout(tiny_model())


def save_model_directory(
    # Any: a transformers PreTrainedModel.
    model: Any,
    directory: Path,
) -> Path:
    """``model`` saved as a HF directory with a word-level tokenizer (one id per word of
    ``"a b c ..."``) and a chat template, so ``--model`` can load it without a download."""
    words = {"[UNK]": 0, **{chr(ord("a") + i): i + 1 for i in range(26)}}
    backend = Tokenizer(WordLevel(words, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def poisoned_pool(
    total_blocks: int, block_size: int, layout: KVLayout | None = None
) -> PoisonedKVPool:
    """A pool whose every block is NaN until written (the tiny model's layout by default)."""
    return layout_poisoned_pool(layout or pool_layout(), total_blocks, block_size)


def dense(request: Request) -> DenseOutput:
    """``generate`` on one request of the tiny model."""
    return generate_dense(tiny_model().model, request.prompt_ids, request.max_new_tokens, None)


def trace(result: EngineResult, request_id: str) -> TokenTrace:
    """One request's tokens and logits from an engine run."""
    output = result.outputs[request_id]
    return TokenTrace(output.token_ids, output.logits)


def dense_trace(output: DenseOutput) -> TokenTrace:
    """The tokens and logits of a dense run."""
    return TokenTrace(output.token_ids, output.logits)


# -- planted bugs ----------------------------------------------------------------------


class SwappedBlockManager(KVBlockManager):
    """A corrupted block table: every decode token's slot points into the next block id."""

    __slots__ = ()

    def append_slots(self, request_id: str, token_count: int) -> AppendedSlots:
        step = super().append_slots(request_id, token_count)
        pool_slots = self.total_blocks * self.block_size
        shifted = tuple((slot + self.block_size) % pool_slots for slot in step.slots[0])
        return AppendedSlots(step.tables, (shifted, *step.slots[1:]))


class RecordingManager(KVBlockManager):
    """A correct manager that remembers which requests each block id was handed to."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.holders: dict[int, list[str]] = {}

    def release_blocks(self, request_id: str) -> ReleasedBlocks:
        released = super().release_blocks(request_id)
        for block_id in released.block_ids:
            self.holders.setdefault(block_id, []).append(request_id)
        return released


class EarlyReleaseEngine(Engine):
    """A use-after-free: a request's blocks go back to the pool two tokens before its end.

    It keeps decoding through the table it had, whose blocks are now free: the next
    admitted request may overwrite them, and a poisoned pool has filled them with NaN.
    Use a ``block_size`` no request outgrows, so the stale table always has the slot.
    """

    def __init__(
        self,
        model: object,
        manager: KVBlockManager,
        store: KVStore,
        eos_token_id: int | None,
        allocation: Allocation = PREFIX_CACHING,
        *,
        attention: AttentionBackend = GATHER,
    ) -> None:
        super().__init__(model, manager, store, eos_token_id, allocation, attention=attention)
        self._stale: dict[str, RequestBlockTable] = {}

    def _grow(self, running: RunningRequest) -> AppendedSlots:
        request_id = running.request.request_id
        stale = self._stale.get(request_id)
        if stale is not None:
            grown = RequestBlockTable(request_id, stale.block_ids, stale.token_count + 1)
            self._stale[request_id] = grown
            slot = slot_index(self.manager.block_size, grown.block_ids, stale.token_count)
            return AppendedSlots((grown,), ((slot,),))
        step = super()._grow(running)
        if running.request.max_new_tokens - len(running.output.token_ids) == 2:
            self._stale[request_id] = step.tables[0]
            self.store.release(request_id, self.manager.release(request_id))
        return step

    def _release(self, running: RunningRequest) -> None:
        if running.request.request_id not in self._stale:
            super()._release(running)


class ReportsAHeldBlockAsSkipped(KVBlockManager):
    """A window released one block early: whenever a window slides, the block each windowed
    table holds first (still inside its window, still read) is reported free as well.

    The table keeps the block, so nothing is reused; only a pool that poisons what
    ``take_skipped_blocks`` hands over turns the still-needed block into NaN.
    """

    def take_skipped_blocks(self) -> list[int]:
        skipped = super().take_skipped_blocks()
        if not skipped:
            return skipped
        for request_id in self.request_tables:
            for group, window in enumerate(self.group_windows):
                table = self.snapshot_request(request_id, group)
                if window is not None and table.skipped_blocks and table.block_ids:
                    skipped.append(table.block_ids[0])
        return skipped


def keep_event_managers(monkeypatch: pytest.MonkeyPatch) -> list[KVBlockManager]:
    """Make the equivalence runs keep each manager given an event sink (the
    continuous-batching run's, check 3) in the list returned, so that a test of the main
    command can read the cache its events describe."""
    managers: list[KVBlockManager] = []

    def keeping(
        layout: KVLayout,
        total_blocks: int,
        block_size: int,
        *,
        event_sink: EventSink | None = None,
        host_blocks: int = 0,
        host_prefix_cache: bool = False,
    ) -> KVBlockManager:
        manager = new_manager(
            layout,
            total_blocks,
            block_size,
            event_sink=event_sink,
            host_blocks=host_blocks,
            host_prefix_cache=host_prefix_cache,
        )
        if event_sink is not None:
            managers.append(manager)
        return manager

    monkeypatch.setattr("harness.oracle.equivalence.new_manager", keeping)
    return managers
