"""Shared pieces of the harness tests: the tiny model, token-id requests, planted bugs.

Not a conftest: the tests import what they use. The planted bugs are deliberately broken
collaborators; each harness test that guards against one shows it catches it.
"""

import dataclasses
import functools
import random
from collections.abc import Sequence
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
from harness.runtime.attention_backends import GATHER, AttentionBackend
from harness.runtime.contiguous_kv import ContiguousKVBuffers
from harness.runtime.engine import Engine
from harness.runtime.kv_pool import PagedKVPool, PoisonedKVPool, new_manager
from harness.runtime.kv_store import KVStore
from harness.runtime.requests import Request, RunningRequest
from harness.runtime.results import EngineResult
from harness.runtime.scheduler import Scheduler
from harness.tiny_models import tiny_llama
from impl import AppendedSlots, KVCacheManager, ReleasedBlocks, Transfers
from impl.prefix_cache import EventSink
from spec import RequestBlockTable, slot_index


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


def repeating_requests(count: int, max_new_tokens: int, seed: int = 7) -> list[Request]:
    """Prompts that quote themselves: a random text, then a stretch of it again."""
    rng = random.Random(seed)
    vocab = tiny_model().model.config.vocab_size
    requests = []
    for number in range(count):
        text = [rng.randrange(vocab) for _ in range(rng.randint(6, 14))]
        quoted = text[: rng.randint(2, len(text) - 1)]
        requests.append(
            Request(f"r{number}", tuple(text + quoted), max_new_tokens, arrival_step=number)
        )
    return requests


def run(
    requests: list[Request],
    store: KVStore,
    manager: KVCacheManager,
    engine_type: type[Engine] = Engine,
    *,
    prefix_caching: bool = True,
    attention: AttentionBackend = GATHER,
) -> EngineResult:
    """Run ``requests`` through ``engine_type`` on the tiny model."""
    engine = engine_type(
        tiny_model().model,
        manager,
        store,
        None,
        prefix_caching=prefix_caching,
        attention=attention,
    )
    return engine.run(requests)


def paged_and_contiguous(
    requests: list[Request],
    *,
    manager_type: type[KVCacheManager],
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
        prefix_caching=False,
        attention=attention,
    )
    max_tokens = max(request.max_tokens for request in requests)
    contiguous = run(
        requests,
        ContiguousKVBuffers(layout, max_tokens, block_size),
        KVCacheManager(total_blocks, block_size),
        engine_type,
        prefix_caching=False,
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


class SwappedBlockManager(KVCacheManager):
    """A corrupted block table: every decode token's slot points into the next block id."""

    def append(self, request_id: str, tokens: int | Sequence[int] = 1) -> AppendedSlots:
        step = super().append(request_id, tokens)
        pool_slots = self.total_blocks * self.block_size
        shifted = tuple((slot + self.block_size) % pool_slots for slot in step.slots[0])
        return step._replace(slots=(shifted, *step.slots[1:]))


class RecordingManager(KVCacheManager):
    """A correct manager that remembers which requests each block id was handed to."""

    def __init__(self, total_blocks: int, block_size: int = 16, **kwargs: Any) -> None:
        super().__init__(total_blocks, block_size, **kwargs)
        self.holders: dict[int, list[str]] = {}

    def release(self, request_id: str) -> ReleasedBlocks:
        released = super().release(request_id)
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
        manager: KVCacheManager,
        store: KVStore,
        eos_token_id: int | None,
        *,
        prefix_caching: bool = True,
        attention: AttentionBackend = GATHER,
    ) -> None:
        super().__init__(
            model,
            manager,
            store,
            eos_token_id,
            prefix_caching=prefix_caching,
            attention=attention,
        )
        self._early = _EarlyReleaseScheduler(self)
        self.scheduler = self._early

    def _release(self, running: RunningRequest) -> None:
        if not self._early.is_stale(running.request.request_id):
            super()._release(running)


class _EarlyReleaseScheduler(Scheduler):
    """``EarlyReleaseEngine``'s scheduler: its appends, stale two tokens before the end."""

    def __init__(self, engine: Engine) -> None:
        scheduler = engine.scheduler
        super().__init__(
            scheduler.manager, scheduler.scheduling, prefix_caching=scheduler.prefix_caching
        )
        self.engine = engine
        self._stale: dict[str, RequestBlockTable] = {}

    def grow(
        self,
        running: list[RunningRequest],
        scheduled: list[RunningRequest],
        grown: dict[str, AppendedSlots],
    ) -> RunningRequest | None:
        """Each scheduled request through this class's ``append``; no preemption (a pool
        with no room raises): its runs have room for every request."""
        for current in scheduled[len(grown) :]:
            grown[current.request.request_id] = self.append(current)
        return None

    def append(self, running: RunningRequest) -> AppendedSlots:
        request_id = running.request.request_id
        stale = self._stale.get(request_id)
        if stale is not None:
            grown = RequestBlockTable(request_id, stale.block_ids, stale.token_count + 1)
            self._stale[request_id] = grown
            slot = slot_index(self.manager.block_size, grown.block_ids, stale.token_count)
            blocks = (grown.block_ids,)
            return AppendedSlots(request_id, grown.token_count, blocks, (0,), ((slot,),))
        step = super().append(running)
        if running.request.max_new_tokens - len(running.output.token_ids) == 2:
            self._stale[request_id] = step.table()
            released = self.manager.release(request_id)
            self.engine.store.release(request_id, list(released.block_ids))
        return step

    def is_stale(self, request_id: str) -> bool:
        return request_id in self._stale


class ReportsAHeldBlockAsSkipped(KVCacheManager):
    """A window released one block early: whenever a window slides, the block each windowed
    table holds first (still inside its window, still read) is reported free as well.

    The table keeps the block, so nothing is reused; only a pool that poisons the skipped
    blocks ``take_transfers`` hands over turns the still-needed block into NaN.
    """

    def take_transfers(self) -> Transfers:
        transfers = super().take_transfers()
        if not transfers.skipped_block_ids:
            return transfers
        skipped = list(transfers.skipped_block_ids)
        for request_id in self.to_spec().tables:
            for window, table in zip(self.group_windows, self.tables(request_id), strict=True):
                if window is not None and table.skipped_blocks and table.block_ids:
                    skipped.append(table.block_ids[0])
        return dataclasses.replace(transfers, skipped_block_ids=tuple(skipped))


def keep_event_managers(monkeypatch: pytest.MonkeyPatch) -> list[KVCacheManager]:
    """Make the equivalence runs keep each manager given an event sink (the
    continuous-batching run's, check 3) in the list returned, so that a test of the main
    command can read the cache its events describe."""
    managers: list[KVCacheManager] = []

    def keeping(
        layout: KVLayout,
        total_blocks: int,
        block_size: int,
        *,
        event_sink: EventSink | None = None,
        host_blocks: int = 0,
        host_prefix_cache: bool = False,
        host_event_sink: EventSink | None = None,
    ) -> KVCacheManager:
        manager = new_manager(
            layout,
            total_blocks,
            block_size,
            event_sink=event_sink,
            host_blocks=host_blocks,
            host_prefix_cache=host_prefix_cache,
            host_event_sink=host_event_sink,
        )
        if event_sink is not None:
            managers.append(manager)
        return manager

    monkeypatch.setattr("harness.oracle.equivalence.new_manager", keeping)
    return managers
