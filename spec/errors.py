"""The error family shared by spec and impl, and the argument checks that raise it.

Spec and impl refuse the same calls with the same error and the same message, so both
call these checks (impl inlines the cheap test on its hot paths and calls the check only
to raise). Where the article series has wording for an error, the message starts with it
and pagedkv's numbers follow, so code matching the article's messages keeps matching.

- ``TypeError``: an argument of the wrong type (a ``bool`` or ``float`` count, a token id
  that is not an ``int``, a request id that is not a ``str``);
- ``ValueError``: bad configuration, a negative count, a token id out of range, a
  duplicate request id, the wrong kind of append;
- ``KeyError``: an unknown request id;
- ``BlockAllocationError`` (a ``RuntimeError``): too few free blocks.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar, NoReturn, TypeGuard

if TYPE_CHECKING:  # spec.kinds imports this module (through spec.rules)
    from spec.kinds import GroupKind


# The largest pool and block a manager accepts. NOTE: impl keeps a few words per block
# (free queue, ref counts, cache keys), so 2**24 blocks cost ~0.5 GiB and ~3 s to set up;
# a real GPU pool is far smaller (an 80 GiB H100 holds ~40k blocks of 16 tokens for an
# 8B model in bf16).
MAX_TOTAL_BLOCKS = 2**24
MAX_BLOCK_SIZE = 2**16
# Token ids are vocabulary indices; 2**32 bounds every tokenizer in use.
MAX_TOKEN_ID = 2**32 - 1


class BlockAllocationError(RuntimeError):
    """Raised when the KV block pool cannot satisfy an allocation.

    Constructs from a message, as the article's does. pagedkv raises it through
    ``out_of_blocks``, which also sets ``request_id``, ``needed_blocks`` and
    ``free_blocks`` (``None`` on an error built from a message alone).
    """

    request_id: str | None = None
    needed_blocks: int | None = None
    free_blocks: int | None = None
    # The blocks the message names ("not enough free KV blocks").
    blocks: ClassVar[str] = "KV blocks"

    @classmethod
    def out_of_blocks(
        cls, request_id: str, needed_blocks: int, free_blocks: int
    ) -> "BlockAllocationError":
        """The error for ``request_id``: ``needed_blocks`` more blocks, ``free_blocks`` free."""
        error = cls(
            f"not enough free {cls.blocks}: needed={needed_blocks} free={free_blocks} "
            f"(request {request_id!r})"
        )
        error.request_id = request_id
        error.needed_blocks = needed_blocks
        error.free_blocks = free_blocks
        return error


class HostBlockAllocationError(BlockAllocationError):
    """Raised when the host tier cannot take a swap-out: too few free host blocks
    (``HostBlockAllocationError.out_of_blocks``: "not enough free host blocks: ..."), or
    no host tier at all (``no_host_tier``)."""

    blocks: ClassVar[str] = "host blocks"

    @classmethod
    def no_host_tier(cls, request_id: str, needed_blocks: int) -> "BlockAllocationError":
        """The error for a swap-out of ``request_id`` from a manager made with no host tier."""
        error = cls(
            f"no host tier to swap request {request_id!r} out to: "
            f"needed={needed_blocks} host_blocks=0"
        )
        error.request_id = request_id
        error.needed_blocks = needed_blocks
        error.free_blocks = 0
        return error


def check_host_room(
    request_id: str, needed_blocks: int, free_blocks: int, host_blocks: int
) -> None:
    """Refuse a swap-out the host tier cannot take (``HostBlockAllocationError``): none at
    all (``host_blocks`` 0, even for a request holding no block), or fewer free host blocks
    than the request holds."""
    if host_blocks == 0:
        raise HostBlockAllocationError.no_host_tier(request_id, needed_blocks)
    if needed_blocks > free_blocks:
        raise HostBlockAllocationError.out_of_blocks(request_id, needed_blocks, free_blocks)


def check_pool_shape(total_blocks: object, block_size: object) -> None:
    """Refuse a pool that cannot be served: non-int sizes, sizes below 1 or above the bounds."""
    for name, value, limit in (
        ("total_blocks", total_blocks, MAX_TOTAL_BLOCKS),
        ("block_size", block_size, MAX_BLOCK_SIZE),
    ):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
        if value > limit:
            raise ValueError(f"{name} must be at most {limit:,}, got {value:,}")


def check_group(group: object, group_count: int) -> int:
    """Refuse a KV cache group index that is not an ``int`` (TypeError) in
    [0, group_count) (ValueError); return it."""
    return _check_index("group", group, group_count, "KV cache groups")


def check_block_id(block_id: object, total_blocks: int) -> int:
    """Refuse a block id that is not an ``int`` (TypeError) in [0, total_blocks)
    (ValueError); return it."""
    return _check_index("block_id", block_id, total_blocks, "blocks")


def _check_index(name: str, value: object, count: int, things: str) -> int:
    if type(value) is not int:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= value < count:
        raise ValueError(
            f"{name} must be in [0, {count}) (the pool has {count} {things}), got {value}"
        )
    return value


def check_token_count(token_count: object) -> None:
    """Refuse a token count that is not a non-negative ``int`` (``bool`` is refused too)."""
    if type(token_count) is not int:
        raise TypeError(
            f"token_count must be an int, got {type(token_count).__name__} {token_count!r}"
        )
    if token_count < 0:
        raise ValueError(f"token_count must be non-negative, got {token_count}")


def check_prompt(token_ids: object) -> tuple[int, ...]:
    """Refuse (``TypeError``) a prompt that is not a sequence of token ids (a ``str``, bytes,
    or no sequence at all: ``None``, a set), then its ids as ``check_token_ids`` says;
    returns them as a tuple."""
    if not is_token_ids(token_ids):
        raise TypeError(
            f"token_ids must be a sequence of token ids, got {type(token_ids).__name__}"
            f" {token_ids!r}"
        )
    ids = tuple(token_ids)
    check_token_ids(ids)
    return ids


def check_token_ids(token_ids: Iterable[object]) -> None:
    """Refuse token ids that are not ``int`` in [0, MAX_TOKEN_ID], naming the first bad one."""
    for index, token_id in enumerate(token_ids):
        if type(token_id) is not int:
            raise TypeError(
                f"token id {index} must be an int, got {type(token_id).__name__} {token_id!r}"
            )
        if not 0 <= token_id <= MAX_TOKEN_ID:
            raise ValueError(f"token id {index} must be in [0, {MAX_TOKEN_ID}], got {token_id}")


def check_cache_salt(cache_salt: object) -> None:
    """Refuse a cache salt that is neither a ``str`` nor ``None`` (no salt)."""
    if cache_salt is not None and type(cache_salt) is not str:
        raise TypeError(
            f"cache_salt must be a str or None, got {type(cache_salt).__name__} {cache_salt!r}"
        )


def check_request_id(request_id: object) -> None:
    """Refuse a new request id that is not a ``str`` (the API's type; ``nan`` and ``None``
    would break the tables' invariants)."""
    if type(request_id) is not str:
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")


def duplicate_request(request_id: str) -> NoReturn:
    """Raise the ``ValueError`` for a request id that already holds blocks."""
    raise ValueError(f"request already has allocated blocks: {request_id}")


def unknown_request(request_id: object) -> NoReturn:
    """Raise the ``KeyError`` for a request id that holds no blocks, or the ``TypeError`` of
    ``check_request_id`` for one that is not a ``str`` (no request has such an id)."""
    check_request_id(request_id)
    raise KeyError(f"request has no allocated blocks: {request_id}") from None


# Not mutated: mutmut's trampoline hides the TypeGuard from mypy (docs/verification.md).
def is_token_ids(tokens: object) -> TypeGuard[Sequence[int]]:  # pragma: no mutate block
    """Whether ``tokens`` (what ``allocate`` and ``append`` add) are token ids, not a count:
    any sequence but a ``str`` or ``bytes``. Anything else is a count, and checked as one
    (``check_token_count``)."""
    return isinstance(tokens, Sequence) and not isinstance(tokens, str | bytes)


def check_allocate(
    request_id: str,
    tokens: int | Sequence[int],
    cache_salt: str | None,
    is_known: Callable[[str], bool],
) -> int | tuple[int, ...]:
    """Refuse an ``allocate`` in the one order spec and impl share: the request id's type
    (TypeError), an id ``is_known`` holds (ValueError); then token ids (``check_token_ids``)
    and the salt's type, or a count (``check_token_count``), the salt's type and a salt at
    all (ValueError: a count is never cached). Returns the ids as a tuple, or the count."""
    check_request_id(request_id)
    if is_known(request_id):
        duplicate_request(request_id)
    if is_token_ids(tokens):
        ids = tuple(tokens)
        check_token_ids(ids)
        check_cache_salt(cache_salt)
        return ids
    check_token_count(tokens)
    check_cache_salt(cache_salt)
    if cache_salt is not None:
        counted_with_salt(request_id)
    assert isinstance(tokens, int)  # narrowed by check_token_count
    return tokens


def tracks_token_ids(request_id: str, tokens: object) -> NoReturn:
    """Raise the ``ValueError`` for a count appended to a request allocated by token ids."""
    raise ValueError(
        f"cannot append a count ({tokens!r}) to request {request_id!r}: it tracks token ids, "
        "so append the ids of the tokens"
    )


def allocated_by_count(request_id: str, token_count: int) -> NoReturn:
    """Raise the ``ValueError`` for token ids appended to a request allocated by count."""
    raise ValueError(
        f"cannot append {token_count} token ids to request {request_id!r}: it was allocated "
        "by count, so append a count"
    )


def counted_with_salt(request_id: str) -> NoReturn:
    """Raise the ``ValueError`` for a cache salt given to a request allocated by count
    (its blocks are never cached, so a salt would mean nothing)."""
    raise ValueError(f"request {request_id!r} is allocated by count: a cache salt needs token ids")


def check_truncate(
    request_id: str,
    token_count: int,
    held_tokens: int,
    *,
    block_size: int,
    group_windows: "Sequence[GroupKind]",
    skipped_blocks: Sequence[int],
) -> None:
    """Refuse (ValueError) to truncate a request holding ``held_tokens`` to more tokens, to
    fewer where a group's kind cannot be rewound (``GroupKind.check_truncate``: a
    recurrent state), or to a length whose next token would read, in some group, from a
    block its window released: ``skipped_blocks[g] * block_size`` past the kind's
    ``first_read(token_count)``."""
    if token_count > held_tokens:
        raise ValueError(
            f"cannot truncate request {request_id!r} to {token_count} tokens: "
            f"it holds {held_tokens}"
        )
    for group, kind in enumerate(group_windows):
        kind.check_truncate(group, request_id, held_tokens, token_count)
    for group, (kind, skipped) in enumerate(zip(group_windows, skipped_blocks, strict=True)):
        first_read = kind.first_read(token_count)
        if skipped * block_size > first_read:
            raise ValueError(
                f"cannot truncate request {request_id!r} to {token_count} tokens: group "
                f"{group} ({kind.name}) released its first {skipped} blocks "
                f"({skipped * block_size} tokens), and the next token would read "
                f"from token {first_read}"
            )


def check_host_tier(host_blocks: object, host_prefix_cache: object) -> None:
    """Refuse a host tier that cannot be served: ``host_blocks`` not an ``int`` (TypeError)
    in [0, MAX_TOTAL_BLOCKS] (ValueError), ``host_prefix_cache`` not a ``bool`` (TypeError),
    or ``True`` with no host block to demote to (ValueError)."""
    if type(host_blocks) is not int:
        raise TypeError(
            f"host_blocks must be an int, got {type(host_blocks).__name__} {host_blocks!r}"
        )
    if not 0 <= host_blocks <= MAX_TOTAL_BLOCKS:
        raise ValueError(f"host_blocks must be in [0, {MAX_TOTAL_BLOCKS:,}], got {host_blocks:,}")
    if type(host_prefix_cache) is not bool:
        raise TypeError(
            "host_prefix_cache must be a bool, got "
            f"{type(host_prefix_cache).__name__} {host_prefix_cache!r}"
        )
    if host_prefix_cache and host_blocks == 0:
        raise ValueError(
            "host_prefix_cache needs a host tier to demote freed prefixes to: host_blocks is 0"
        )


def not_swapped(request_id: object) -> NoReturn:
    """Raise the ``KeyError`` for ``swap_in`` of a request that is not swapped out (the
    ``TypeError`` of ``check_request_id`` for an id that is not a ``str``)."""
    check_request_id(request_id)
    raise KeyError(f"request is not swapped out: {request_id}") from None


def awaits_copy(request_id: str, block_id: int) -> NoReturn:
    """Raise the ``ValueError`` for a swap-out of a request one of whose blocks a pending
    copy has not written yet (its K/V is not there to copy out)."""
    raise ValueError(
        f"cannot swap out request {request_id!r}: block {block_id} awaits a pending copy "
        "into it (take_transfers first)"
    )
