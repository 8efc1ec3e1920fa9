"""The second HF hook: a ``Cache`` whose K/V live in the paged pool, for ``model.generate``.

``model.generate(..., past_key_values=PagedCache(manager, pool, batch_size))`` runs HF's own
generation loop, on one request or a static (left-padded) batch, with every token's K/V in
a ``PagedKVPool`` at the slot ``impl.KVCacheManager`` gives. Batch row ``r`` is the
manager's request ``request_ids[r]``. Each forward grows every row's table by the new
tokens (``allocate`` by count on the first, ``append`` after) before layer 0 writes, and
makes the manager's transfers (the blocks windows freed); each layer then writes the new
K/V at those slots and hands attention every row's K/V gathered back through its table.

It is *not* what the engine uses (``harness.runtime.paged_attention`` is): a ``Cache`` sees one
``[batch, kv_heads, tokens, head_dim]`` tensor per layer, so every row holds the same
number of tokens (padding included) and rows can neither join nor leave mid-run. It is the
drop-in for code that already calls ``generate``. Its blocks go back to the manager on
``release()`` (or at the end of a ``with`` block); a growth the pool cannot hold raises
``BlockAllocationError`` and changes nothing.
"""

from types import TracebackType
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionCacheLayerMixin,
)

from harness.runtime.kv_pool import PagedKVPool
from harness.runtime.kv_store import KVPlan
from impl import AppendedSlots, BlockAllocationError, KVCacheManager
from spec import blocks_for_tokens, first_window_token
from spec.kinds import kind_names


class PagedCache(Cache):
    """HF's ``Cache`` over a ``PagedKVPool`` and a ``KVCacheManager``: one request per row."""

    def __init__(
        self, manager: KVCacheManager, pool: PagedKVPool, batch_size: int, name: str = "row"
    ) -> None:
        if (manager.total_blocks, manager.block_size) != (pool.total_blocks, pool.block_size):
            raise ValueError(
                f"manager ({manager.total_blocks} blocks of {manager.block_size}) and pool "
                f"({pool.total_blocks} blocks of {pool.block_size}) must match"
            )
        if manager.group_windows != pool.layout.group_windows:
            raise ValueError(
                f"the manager's group_windows {kind_names(manager.group_windows)} are not the "
                f"pool's KV cache groups {kind_names(pool.layout.group_windows)} "
                "(kv_pool.new_manager)"
            )
        if pool.layout.state_layers:
            raise ValueError(
                f"PagedCache holds attention layers only; layers {pool.layout.state_layers} "
                "hold a recurrent state (a hybrid runs through harness.runtime.engine)"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.manager = manager
        self.pool = pool
        self.request_ids = tuple(f"{name}-{row}" for row in range(batch_size))
        self.token_count = 0  # tokens every row holds, this step's included once it began
        self.plan: KVPlan | None = None  # the current step's, built before layer 0 writes
        # The parameter type of Cache.__init__, spelled out: a list is invariant.
        layers: list[CacheLayerMixin | LinearAttentionCacheLayerMixin | DummyLayer] = [
            _PagedLayer(self, layer_idx) for layer_idx in range(pool.layout.num_layers)
        ]
        super().__init__(layers=layers)

    def grow(self, new_tokens: int) -> KVPlan:
        """Give every row ``new_tokens`` more slots; the step's plan. All rows or none."""
        manager = self.manager
        block_size = manager.block_size
        groups = range(1, len(manager.group_windows))
        # Each KV cache group takes its own blocks (a window's skips not counted: the check
        # may refuse a step that would just fit, never pass one that does not).
        per_row = (1 + len(groups)) * (
            blocks_for_tokens(block_size, self.token_count + new_tokens)
            - blocks_for_tokens(block_size, self.token_count)
        )
        if self.token_count == 0:
            held = manager.to_spec().tables
            taken = [rid for rid in self.request_ids if rid in held]
            if taken:
                raise ValueError(f"the manager already holds requests {taken}")
        free = manager.usage().free_blocks
        if per_row * len(self.request_ids) > free:
            # The first row that growing row by row would have refused, with its numbers.
            row = free // per_row
            raise BlockAllocationError.out_of_blocks(
                self.request_ids[row], per_row, free - row * per_row
            )
        steps: list[AppendedSlots] = []
        for request_id in self.request_ids:  # one call per row: every group's table and slots
            if self.token_count == 0:
                steps.append(manager.allocate(request_id, new_tokens))
            else:
                steps.append(manager.append(request_id, new_tokens))
        self.token_count += new_tokens
        self.pool.transfer(manager.take_transfers())
        self.plan = self.pool.plan(steps)
        return self.plan

    def release(self) -> None:
        """Hand every row's blocks back (idempotent); the pool hears of them as released."""
        if self.token_count == 0:
            return
        for request_id in self.request_ids:
            released = self.manager.release(request_id)
            self.pool.release(request_id, list(released.freed_block_ids))
        self.token_count = 0
        self.plan = None
        for layer in self.layers:
            layer.reset()

    def __enter__(self) -> "PagedCache":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


class _PagedLayer(CacheLayerMixin):
    """One layer's view of a ``PagedCache``: writes and reads that layer of the pool.

    A layer with a sliding window W hands attention what HF's
    ``DynamicSlidingWindowLayer`` hands it: the new tokens and at most the W - 1 before
    them, with the mask sizes that layer reports, so the attention call is the dense one.
    """

    def __init__(self, cache: PagedCache, layer_idx: int) -> None:
        # transformers leaves CacheLayerMixin.__init__ unannotated; it sets keys, values and
        # is_initialized, which this layer keeps at None, None and its own flag.
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.layer_idx = layer_idx
        self.token_count = 0
        self.window = cache.pool.layout.window(layer_idx)
        self.is_sliding = self.window is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the pool exists already."""
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,  # [batch, num_kv_heads, new_tokens, head_dim]
        value_states: torch.Tensor,
        # Any: transformers passes cache kwargs through; none is needed here.
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V; every row's K/V ``[batch, num_kv_heads, tokens, head_dim]``."""
        cache = self.cache
        batch, num_kv_heads, new_tokens, head_dim = key_states.shape
        if batch != len(cache.request_ids):
            raise ValueError(f"the cache has {len(cache.request_ids)} rows, the batch {batch}")
        self.is_initialized = True
        # Layer 0 opens the step: every row's table grows before anything is written.
        plan = cache.grow(new_tokens) if self.layer_idx == 0 else cache.plan
        assert plan is not None and cache.token_count == self.token_count + new_tokens
        self.token_count = cache.token_count
        # rows: [batch * new_tokens, num_kv_heads, head_dim], row-major like the plan's slots
        rows = (batch * new_tokens, num_kv_heads, head_dim)
        cache.pool.write(
            self.layer_idx,
            plan,
            key_states.transpose(1, 2).reshape(rows),
            value_states.transpose(1, 2).reshape(rows),
        )
        read = cache.pool.read(self.layer_idx, plan)
        if self.window is not None:
            # keys, values: [1, num_kv_heads, kept, head_dim], the tokens before this step
            # that the window keeps (at most W - 1) and this step's
            kept = min(self.token_count - new_tokens, self.window - 1) + new_tokens
            read = [(keys[:, :, -kept:], values[:, :, -kept:]) for keys, values in read]
        if batch == 1:
            return read[0]
        return torch.cat([k for k, _ in read]), torch.cat([v for _, v in read])

    def reset(self) -> None:
        """Forget this layer's tokens (the cache released its blocks)."""
        self.token_count = 0
        self.is_initialized = False

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """How many keys ``update`` hands attention with ``query_length`` new tokens, and the
        position of the first: every past token, or a window's as
        ``DynamicSlidingWindowLayer`` counts them."""
        if self.window is None:
            return self.token_count + query_length, 0
        kept = min(self.token_count, self.window - 1)
        return kept + query_length, first_window_token(self.token_count, self.window)

    def get_seq_length(self) -> int:
        """Tokens this layer holds for every row."""
        return self.token_count

    def get_max_length(self) -> int:
        """A sliding layer's window; else no fixed maximum (the pool's free blocks are)."""
        return -1 if self.window is None else self.window

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Refused: beam search reorders rows, which would mean forking tables here."""
        raise NotImplementedError("PagedCache does not support beam search")

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: assisted decoding crops rejected tokens, which is not built here."""
        raise NotImplementedError("PagedCache does not support cropping (assisted decoding)")
