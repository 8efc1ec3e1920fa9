"""How the engine asks the manager for a request's blocks: with token ids or by count.

With prefix caching, prompts go through ``allocate_prompt`` (cached full blocks are
reused) and tokens through ``append_token_slot`` / ``append_token_ids`` (a block is cached
when it fills); without it, through ``allocate``, ``append_slot`` and ``append_tokens``
by count, and nothing is ever cached.
"""

from dataclasses import dataclass

from impl import KVBlockManager, RequestBlockTable


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

    def append(self, manager: KVBlockManager, request_id: str, token_id: int) -> int:
        """Append ``token_id`` (whose K/V the next forward computes); returns its slot."""
        if self.prefix_caching:
            return manager.append_token_slot(request_id, token_id)
        return manager.append_slot(request_id)

    def cached_tokens(
        self, manager: KVBlockManager, token_ids: tuple[int, ...], cache_salt: str | None = None
    ) -> int:
        """How many tokens of the prompt ``token_ids`` ``allocate`` would find cached."""
        if not self.prefix_caching:
            return 0
        return manager.cached_prefix_tokens(token_ids, cache_salt)

    def extend(
        self, manager: KVBlockManager, request_id: str, token_ids: tuple[int, ...]
    ) -> RequestBlockTable:
        """Append several tokens in one operation (a prefill chunk, a token and its drafts)."""
        if self.prefix_caching:
            return manager.append_token_ids(request_id, token_ids)
        return manager.append_tokens(request_id, len(token_ids))


PREFIX_CACHING = Allocation(prefix_caching=True)
NO_PREFIX_CACHING = Allocation(prefix_caching=False)
