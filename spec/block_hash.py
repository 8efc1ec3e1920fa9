"""Block hashes: the name a router knows a cached prefix by.

A router never sees block ids or whole prefixes: it sees one hash per cached block,
chained so that a block's hash fingerprints the whole prefix it ends (vLLM's
``hash_block_tokens``). The rule, as vLLM 0.33 states it in
``vllm/v1/core/kv_cache_utils.py``:

    hash(block i) = H((hash(block i - 1) or NONE_HASH, tokens of block i, extra keys of i))

with ``NONE_HASH = H("vllm-none-hash")``, and the cache salt an extra key of the first
block only (``("cache_salt", salt)``), so a salt changes every hash after it. Ours is
vLLM's with ``--prefix-caching-hash-algo sha256_cbor``: H is SHA-256 over the canonical
CBOR encoding of its argument, which ``encode_cbor`` writes for the few types a block
hash needs (``tests/events/test_block_hash.py`` checks it equal to vLLM's own
``hash_block_tokens`` bit for bit). Where ours differs from vLLM's defaults:

- vLLM's default H is ``sha256`` over Python's ``pickle`` bytes, which only Python can
  reproduce; CBOR is language-neutral and needs nothing beyond the standard library.
- vLLM drops an empty salt (``if request.cache_salt``), so salt ``""`` and no salt share
  hashes; pagedkv's caches keep them apart (``spec.records.CacheKey``), so the hash does
  too: any salt that is not ``None`` is an extra key.
- vLLM's ``NONE_HASH`` seed is ``PYTHONHASHSEED`` when that is set (and random for
  xxhash); ours is always the fixed seed, so every process agrees.
- No LoRA, multimodal or prompt-embedding extra keys: pagedkv caches token ids only.
- A salt UTF-8 cannot encode (a lone surrogate, as JSON's ``"\ud800"`` decodes) is a salt
  the spec accepts, but no CBOR text string: its extra key holds its UTF-8 bytes written
  with ``surrogatepass`` (the bytes impl keys its caches by) as a CBOR byte string, which
  no text salt's hash shares (another major type). vLLM's ``sha256_cbor`` has no hash for
  such a salt (cbor2 refuses to encode it); the wire carries the same bytes
  (``salt_extra_key``).

A router receives the hash as vLLM sends it by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``): the last 8 bytes of the digest as an unsigned
64-bit integer (``compute_external_hash``). Two keys may share those 64 bits; the allocator
never trusts a hash (a hit compares token ids), a router does.
"""

import hashlib
from collections.abc import Iterator

from spec.records import CacheKey

NONE_HASH_SEED = "vllm-none-hash"

# What a block hash is computed over: a str, bytes, an int, None, or a tuple of those.
CborValue = str | bytes | int | None | tuple["CborValue", ...]

_MAX_CBOR_INT = 2**64 - 1


def encode_cbor(value: CborValue) -> bytes:
    """The canonical CBOR encoding (RFC 8949, shortest heads) of ``value``; a tuple is an
    array. ``ValueError`` for an int outside [-2**64, 2**64 - 1] (CBOR would need a tag)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        raise ValueError(f"no bool in a block hash, got {value!r}")
    if isinstance(value, int):
        if value >= 0:
            return _cbor_head(0, value)
        return _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    return _cbor_head(4, len(value)) + b"".join(encode_cbor(item) for item in value)


def _cbor_head(major: int, argument: int) -> bytes:
    """A data item's head: its major type and argument, in the fewest bytes."""
    if argument > _MAX_CBOR_INT:
        raise ValueError(f"{argument} does not fit a CBOR head (at most 2**64 - 1)")
    if argument < 24:
        return bytes([major << 5 | argument])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if argument < 1 << (8 * size):
            return bytes([major << 5 | extra]) + argument.to_bytes(size, "big")
    raise AssertionError("unreachable: the argument fits 8 bytes")


def hash_cbor(value: CborValue) -> bytes:
    """H: SHA-256 of ``value``'s canonical CBOR (vLLM's ``sha256_cbor``)."""
    return hashlib.sha256(encode_cbor(value)).digest()


NONE_HASH = hash_cbor(NONE_HASH_SEED)


def salt_extra_key(cache_salt: str) -> str | bytes:
    """The salt as its extra key holds it: itself, or for a salt UTF-8 cannot encode (a
    lone surrogate), its ``surrogatepass`` UTF-8 bytes (module docstring)."""
    try:
        cache_salt.encode("utf-8")
    except UnicodeEncodeError:
        return cache_salt.encode("utf-8", "surrogatepass")
    return cache_salt


def compute_extra_keys(
    block_index: int, cache_salt: str | None
) -> tuple[tuple[str, str | bytes]] | None:
    """The extra keys of block ``block_index`` of a prefix cached under ``cache_salt``: the
    salt on the first block, nothing elsewhere."""
    if block_index == 0 and cache_salt is not None:
        return (("cache_salt", salt_extra_key(cache_salt)),)
    return None


def compute_block_hash(
    parent_hash: bytes | None,
    token_ids: tuple[int, ...],
    extra_keys: tuple[tuple[str, str | bytes]] | None,
) -> bytes:
    """The hash of a block holding ``token_ids`` after the block hashed ``parent_hash``
    (``None``: the first block)."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    return hash_cbor((parent, token_ids, extra_keys))


def iter_block_hashes(
    token_ids: tuple[int, ...], block_size: int, cache_salt: str | None
) -> Iterator[bytes]:
    """The chained hash of each full block of ``token_ids`` under ``cache_salt``, in order."""
    parent: bytes | None = None
    for index in range(len(token_ids) // block_size):
        block = token_ids[index * block_size : (index + 1) * block_size]
        parent = compute_block_hash(parent, block, compute_extra_keys(index, cache_salt))
        yield parent


def compute_key_hash(key: CacheKey, block_size: int) -> bytes:
    """The hash of the last block of ``key``'s prefix (a whole number of blocks)."""
    *_, last = iter_block_hashes(key.token_ids, block_size, key.cache_salt)
    return last


def compute_external_hash(block_hash: bytes) -> int:
    """What a router receives for ``block_hash``: its last 8 bytes, big-endian, unsigned
    (vLLM's ``maybe_convert_block_hash``)."""
    return int.from_bytes(block_hash[-8:], "big")
