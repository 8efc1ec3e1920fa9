"""An adapter template: copy this file next to your allocator, replace ``TinyPrefixPool`` by
yours, keep ``TinyPrefixPoolAdapter``'s shape, then run

    python -m harness.conformance --target adapter_template:make --steps 5000

from the directory that holds it (or ``pagedkv conformance ...``; from a test suite:
``assert_conforms(make, steps=5000, seed=0)``). It needs pagedkv and Hypothesis, not torch.

``TinyPrefixPool`` is a whole allocator of its own design, small enough to read: a list of
free blocks, a prefix cache of full blocks keyed by their whole prefix, least recently
freed cached blocks evicted first. The kit checks it in refinement mode (its block order is
its own) and finds nothing: tests/conformance/test_wheel_adapter.py runs this very file
from a wheel install.
"""

from collections.abc import Mapping
from types import MappingProxyType

from harness.conformance import Observation, TargetTable
from spec import BlockAllocationError

Tokens = tuple[int, ...]


class TinyPrefixPool:
    """Your allocator: ``admit`` a prompt (reusing cached full blocks), ``extend`` a
    request, ``finish`` it. A request that does not fit is refused with ``None``/``False``
    and nothing changes."""

    def __init__(self, num_blocks: int = 12, block_size: int = 4) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))  # uncached free blocks; the head is free[0]
        self.evictable: dict[int, None] = {}  # cached free blocks, least recently freed first
        self.cache: dict[Tokens, int] = {}  # a whole prefix -> the block ending it
        self.key_of: dict[int, Tokens] = {}
        self.refs: dict[int, int] = {}  # held blocks only
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}

    def admit(self, request_id: str, prompt: Tokens) -> int | None:
        """Give ``request_id`` blocks for ``prompt``; the tokens found cached, or ``None``."""
        size = self.block_size
        hits: list[int] = []
        for end in range(size, len(prompt), size):  # the last token is never a hit
            block = self.cache.get(prompt[:end])
            if block is None:
                break
            hits.append(block)
        needed = -(-len(prompt) // size) - len(hits)
        revived = sum(1 for block in hits if block in self.evictable)
        if needed > len(self.free) + len(self.evictable) - revived:
            return None
        for block in hits:
            self.evictable.pop(block, None)
            self.refs[block] = self.refs.get(block, 0) + 1
        self.tables[request_id] = hits + self._take(needed)
        self.tokens[request_id] = list(prompt)
        self._cache_full_blocks(request_id)
        return len(hits) * size

    def extend(self, request_id: str, new_tokens: Tokens) -> bool:
        """Add ``new_tokens`` to a running request; ``False`` if it does not fit."""
        total = len(self.tokens[request_id]) + len(new_tokens)
        needed = -(-total // self.block_size) - len(self.tables[request_id])
        if needed > len(self.free) + len(self.evictable):
            return False
        self.tables[request_id] += self._take(needed)
        self.tokens[request_id] += new_tokens
        self._cache_full_blocks(request_id)
        return True

    def finish(self, request_id: str) -> None:
        """Give a request's blocks back, last block first; cached ones stay findable."""
        del self.tokens[request_id]
        for block in reversed(self.tables.pop(request_id)):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)

    def _take(self, count: int) -> list[int]:
        taken = []
        for _ in range(count):
            if self.free:
                block = self.free.pop(0)
            else:  # evict the least recently freed cached block
                block = next(iter(self.evictable))
                del self.evictable[block]
                del self.cache[self.key_of.pop(block)]
            self.refs[block] = 1
            taken.append(block)
        return taken

    def _cache_full_blocks(self, request_id: str) -> None:
        tokens, table, size = self.tokens[request_id], self.tables[request_id], self.block_size
        for index in range(len(tokens) // size):
            key = tuple(tokens[: (index + 1) * size])
            if key not in self.cache and table[index] not in self.key_of:
                self.cache[key] = table[index]
                self.key_of[table[index]] = key


class TinyPrefixPoolAdapter:
    """``TinyPrefixPool`` in the spec's vocabulary (docs/conformance.md, "Your own
    allocator", has the contract)."""

    name = "TinyPrefixPool"
    exact = False  # its block order is its own: judged on what any order must keep
    block_size = 4
    group_windows: tuple[int | None, ...] = (None,)  # one group, full attention
    pool_block_ids = range(12)
    supports = frozenset({"allocate_prompt", "append_token_ids", "release", "preempt"})
    # Property (or property/operation) -> why your allocator differs on it by design.
    differences: Mapping[str, str] = MappingProxyType({})

    def __init__(self) -> None:
        self.pool = TinyPrefixPool(num_blocks=12, block_size=4)

    def allocate_prompt(self, request_id: str, token_ids: Tokens) -> int:
        hit = self.pool.admit(request_id, token_ids)
        if hit is None:  # its own refusal signal, raised as the spec's
            raise BlockAllocationError(f"no room for {request_id}")
        return hit

    def append_token_ids(self, request_id: str, token_ids: Tokens) -> None:
        if not self.pool.extend(request_id, token_ids):
            raise BlockAllocationError(f"no room for {request_id}")

    def release(self, request_id: str) -> None:
        self.pool.finish(request_id)

    def preempt(self, request_id: str) -> None:
        self.pool.finish(request_id)  # no preemption of its own: a release

    def observe(self) -> Observation:
        pool = self.pool
        return Observation(
            tables=(
                {
                    request_id: TargetTable(tuple(blocks), len(pool.tokens[request_id]))
                    for request_id, blocks in pool.tables.items()
                },
            ),
            free_block_ids=tuple(pool.free),
            cached_free_block_ids=tuple(pool.evictable),
            cached_block_ids=(frozenset(pool.key_of),),
            ref_counts=dict(pool.refs),
        )


def make() -> TinyPrefixPoolAdapter:
    """The factory the kit calls: a fresh allocator for every test case."""
    return TinyPrefixPoolAdapter()
