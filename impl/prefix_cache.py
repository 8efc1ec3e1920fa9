"""The prefix cache: which free or held block already holds the K/V of a token prefix.

A full block is cached under a ``BlockKey``: its tokens, chained to the key of the block
before it, and the cache salt of the request that made it (``spec.CacheKey``'s two parts).
The salt is mixed into the first block's hash, so the whole chain of one salt hashes
apart from another's, and it is compared on every lookup, so not even a collision
crosses salts. Keys are found by hash and confirmed by comparing token ids down the chain
(``BlockKey.same_prefix``), so a hash collision can cost a comparison, never hand one
request another's K/V (the failure of vLLM advisory GHSA-rm76-4mrf-v9r8, where a hash
match alone was trusted).

This module knows keys and blocks, not requests, ref counts or queues: ``impl.manager``
decides when a block is cached (a prompt or an append fills it) and when it is evicted
(a cached free block is taken for new tokens). Every key it gains or drops one by one is
a KV cache event (``spec.events``), handed to the ``event_sink`` if there is one; the
caller clearing every cache at once emits the one ``AllBlocksCleared`` itself.
"""

from collections.abc import Callable, Iterator, Sequence

from spec import BlockRemoved, BlockStored, CacheKey, KVCacheEvent

BlockHash = Callable[[int, tuple[int, ...]], int]
# Where events go: a callable taking one event (``list.append`` of a list will do).
EventSink = Callable[[KVCacheEvent], object]

ROOT_HASH = 0


def check_hooks(block_hash: object, event_sink: object, host_event_sink: object = None) -> None:
    """Refuse (TypeError) a ``block_hash`` that is not callable, or an ``event_sink`` or a
    ``host_event_sink`` that is neither callable nor ``None``."""
    if not callable(block_hash):
        raise TypeError(
            f"block_hash must be callable, got {type(block_hash).__name__} {block_hash!r}"
        )
    for name, sink in (("event_sink", event_sink), ("host_event_sink", host_event_sink)):
        if sink is not None and not callable(sink):
            raise TypeError(f"{name} must be callable or None, got {type(sink).__name__} {sink!r}")


def default_block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Python's tuple hash of (parent hash, token ids): deterministic for ints, across runs."""
    return hash((parent_hash, token_ids))


class BlockKey:
    """A block's tokens, the key of its parent block (``None`` for a first block), a hash,
    and the cache salt of its chain (the same in every key of one chain).

    The hash is computed once, when the key is made: each block is hashed once in the
    life of a request.
    """

    __slots__ = ("cache_salt", "hash_value", "parent", "token_ids")

    def __init__(
        self,
        parent: "BlockKey | None",
        token_ids: tuple[int, ...],
        hash_value: int,
        cache_salt: str | None = None,
    ) -> None:
        self.parent = parent
        self.token_ids = token_ids
        self.hash_value = hash_value
        self.cache_salt = cache_salt

    def same_prefix(self, other: "BlockKey") -> bool:
        """Whether both keys stand for the same whole token prefix, compared token by token."""
        # NOTE: a loop, not recursion: a chain is as long as a prompt has blocks. Keys
        # made while walking a cached chain share parents, so this ends at once.
        mine: BlockKey | None = self
        theirs: BlockKey | None = other
        while mine is not theirs:
            if mine is None or theirs is None or mine.token_ids != theirs.token_ids:
                return False
            mine, theirs = mine.parent, theirs.parent
        return True

    def prefix(self) -> tuple[int, ...]:
        """The whole token prefix this key stands for (O(chain); for tests and checks)."""
        parts: list[tuple[int, ...]] = []
        key: BlockKey | None = self
        while key is not None:
            parts.append(key.token_ids)
            key = key.parent
        return tuple(token for part in reversed(parts) for token in part)


class PrefixCache:
    """Cached prefixes of ``total_blocks`` blocks: hash buckets and each block's key.

    ``block_keys[b]`` is the key block ``b`` is cached under, or ``None``; ``buckets`` maps
    a hash to the blocks cached under keys with that hash (one, but for collisions).
    Both are public to ``impl.manager`` so its hot paths can read them without a call.
    ``group`` is the KV cache group this cache is, the one its events name.
    """

    __slots__ = ("block_hash", "block_keys", "buckets", "cached_blocks", "event_sink", "group")

    def __init__(
        self,
        total_blocks: int,
        block_hash: BlockHash,
        *,
        group: int,
        event_sink: EventSink | None = None,
    ) -> None:
        self.block_hash = block_hash
        self.buckets: dict[int, list[int]] = {}
        self.block_keys: list[BlockKey | None] = [None] * total_blocks
        self.cached_blocks = 0
        self.group = group
        self.event_sink = event_sink

    def lookup(
        self,
        parent: BlockKey | None,
        token_ids: tuple[int, ...],
        hash_value: int,
        cache_salt: str | None,
    ) -> int | None:
        """The block caching the prefix ``parent`` + ``token_ids`` under ``cache_salt``,
        confirmed token by token and salt by salt.

        ``None`` if no cached block holds it. The hash only narrows the candidates.
        """
        bucket = self.buckets.get(hash_value)
        if bucket is None:
            return None
        if len(bucket) == 1:
            # NOTE: the common hit inlined (one candidate, the very parent key object);
            # anything else goes through the full check below.
            candidate = self.block_keys[bucket[0]]
            if candidate is not None and candidate.parent is parent:
                if candidate.token_ids == token_ids and candidate.cache_salt == cache_salt:
                    return bucket[0]
                return None
        for block_id in bucket:
            cached = self.block_keys[block_id]
            assert cached is not None, "a block in the cache has a key"
            if cached.token_ids != token_ids or cached.cache_salt != cache_salt:
                continue
            # Walking a cached chain, the parents are the very same key objects.
            if cached.parent is parent or (
                cached.parent is not None
                and parent is not None
                and cached.parent.same_prefix(parent)
            ):
                return block_id
        return None

    def extend_keys(
        self,
        token_ids: Sequence[int],
        keys: list[BlockKey],
        block_size: int,
        cache_salt: str | None,
    ) -> None:
        """Append to ``keys`` the key of every full block of ``token_ids`` it lacks."""
        keys.extend(self.next_keys(token_ids, keys, (), block_size, cache_salt))

    def next_keys(
        self,
        token_ids: Sequence[int],
        keys: Sequence[BlockKey],
        new_token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None,
    ) -> list[BlockKey]:
        """The keys ``extend_keys`` would add once ``new_token_ids`` follow ``token_ids``
        (whose full blocks ``keys`` covers, under ``cache_salt``), made now so that nothing
        changes if the hash raises; O(block_size + new tokens)."""
        start = len(keys) * block_size
        tail = [*token_ids[start:], *new_token_ids]
        new_keys: list[BlockKey] = []
        parent = keys[-1] if keys else None
        for offset in range(0, len(tail) - block_size + 1, block_size):
            parent = self.chain_key(parent, tuple(tail[offset : offset + block_size]), cache_salt)
            new_keys.append(parent)
        return new_keys

    def chain_key(
        self, parent: BlockKey | None, token_ids: tuple[int, ...], cache_salt: str | None
    ) -> BlockKey:
        """The key of a full block of ``token_ids`` after ``parent`` (``None``: the first
        block, under ``cache_salt``)."""
        parent_hash = self.root_hash(cache_salt) if parent is None else parent.hash_value
        return BlockKey(parent, token_ids, self.block_hash(parent_hash, token_ids), cache_salt)

    def root_hash(self, cache_salt: str | None) -> int:
        """The parent hash of a chain's first block under ``cache_salt`` (``ROOT_HASH`` for
        none): the salt's UTF-8 bytes hashed as if they were a block, so it is deterministic
        too. Once per prompt, not per block."""
        if cache_salt is None:
            return ROOT_HASH
        # NOTE: surrogates pass: a JSON request may carry a lone one ("\ud800"), which the
        # spec accepts as any str. Their bytes are never valid UTF-8, so no other salt
        # encodes to them.
        return self.block_hash(ROOT_HASH, tuple(cache_salt.encode("utf-8", "surrogatepass")))

    def find(self, key: BlockKey) -> int | None:
        """The block caching ``key``'s prefix, or ``None`` (``lookup`` of a key)."""
        return self.lookup(key.parent, key.token_ids, key.hash_value, key.cache_salt)

    def insert(self, key: BlockKey, block_id: int) -> None:
        """Cache ``block_id`` under ``key``, unless a block holds that prefix already (then
        nothing happens, and no event)."""
        if self.find(key) is None:
            self.buckets.setdefault(key.hash_value, []).append(block_id)
            self.block_keys[block_id] = key
            self.cached_blocks += 1
            if self.event_sink is not None:
                self.event_sink(self.stored_event(key, block_id))

    def stored_event(self, key: BlockKey, block_id: int) -> BlockStored:
        """The ``BlockStored`` of ``block_id`` cached under ``key``: its parent is the block
        this cache holds the parent prefix in; with none, the event carries the whole
        prefix (``spec.events``). O(block_size), O(prefix) for an orphan."""
        parent = key.parent
        parent_id = None
        if parent is not None:
            parent_id = self.lookup(
                parent.parent, parent.token_ids, parent.hash_value, parent.cache_salt
            )
        token_ids = key.token_ids if parent_id is not None else key.prefix()
        return BlockStored(block_id, self.group, parent_id, token_ids, key.cache_salt)

    def evict(self, block_id: int) -> None:
        """Forget the prefix ``block_id`` holds: it is about to be overwritten."""
        key = self.block_keys[block_id]
        assert key is not None, "an evicted block was cached"
        bucket = self.buckets[key.hash_value]
        bucket.remove(block_id)
        if not bucket:
            del self.buckets[key.hash_value]
        self.block_keys[block_id] = None
        self.cached_blocks -= 1
        if self.event_sink is not None:
            self.event_sink(BlockRemoved(block_id, self.group))

    def clear(self) -> None:
        """Forget every cached prefix (O(pool)); emits nothing (see the module docstring)."""
        self.buckets.clear()
        self.block_keys[:] = [None] * len(self.block_keys)
        self.cached_blocks = 0

    def prefixes(self) -> Iterator[tuple[CacheKey, int]]:
        """Every cached (salt and whole token prefix, block id), in block id order (O(pool))."""
        for block_id, key in enumerate(self.block_keys):
            if key is not None:
                yield CacheKey(key.cache_salt, key.prefix()), block_id

    def is_index_consistent(self) -> bool:
        """The buckets, the block keys and the count describe the same cached blocks."""
        bucketed = {(h, b) for h, bucket in self.buckets.items() for b in bucket}
        keyed = {(key.hash_value, b) for b, key in enumerate(self.block_keys) if key}
        return bucketed == keyed and self.cached_blocks == len(keyed)
