"""How the engine asks the manager for a request's blocks: with token ids or by count.

With prefix caching, prompts go through ``allocate_prompt`` (cached full blocks are
reused) and tokens through ``append_token_id_slots`` (a block is cached when it fills);
without it, through ``allocate`` and ``append_slots`` by count, and nothing is ever cached.
Either append answers for every KV cache group in one call (``AppendedSlots``).
"""

from dataclasses import dataclass

from impl import AppendedSlots, KVBlockManager


@dataclass(frozen=True, slots=True)
class Allocation:
    """The manager calls of one run: ``prefix_caching`` picks the token-id calls."""

    prefix_caching: bool

    def allocate(
        self,
        manager: KVBlockManager,
        request_id: str,
        token_ids: tuple[int, ...],
        cache_salt: str | None = None,
    ) -> int:
        """Allocate the prompt ``token_ids`` of a request of salt ``cache_salt``; returns how
        many of them are cached already (under that salt)."""
        if self.prefix_caching:
            return manager.allocate_prompt(request_id, token_ids, cache_salt).cached_tokens
        manager.allocate(request_id, len(token_ids))
        return 0

    def cached_tokens(
        self, manager: KVBlockManager, token_ids: tuple[int, ...], cache_salt: str | None = None
    ) -> int:
        """How many tokens of the prompt ``token_ids`` ``allocate`` would find cached."""
        if not self.prefix_caching:
            return 0
        return manager.cached_prefix_tokens(token_ids, cache_salt)

    def append(
        self, manager: KVBlockManager, request_id: str, token_ids: tuple[int, ...]
    ) -> AppendedSlots:
        """Append the tokens one forward computes (a decode token and its drafts, a prefill
        chunk) in one operation; returns every group's table and the tokens' slots."""
        if self.prefix_caching:
            return manager.append_token_id_slots(request_id, token_ids)
        return manager.append_slots(request_id, len(token_ids))


PREFIX_CACHING = Allocation(prefix_caching=True)
NO_PREFIX_CACHING = Allocation(prefix_caching=False)
