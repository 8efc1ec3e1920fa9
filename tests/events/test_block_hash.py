"""``spec.block_hash``: our block hashes are vLLM's with ``sha256_cbor``, bit for bit,
checked against vLLM 0.33's own ``hash_block_tokens`` (installed for the conformance kit)."""

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.block_hash import (
    NONE_HASH,
    CborValue,
    compute_external_hash,
    compute_key_hash,
    encode_cbor,
    iter_block_hashes,
    salt_extra_key,
)
from spec.records import CacheKey

cbor2 = pytest.importorskip("cbor2", reason="cbor2 comes with the conformance extra")
kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="needs vLLM")
hashing = pytest.importorskip("vllm.utils.hashing", reason="needs vLLM")

cbor_values: st.SearchStrategy[CborValue] = st.recursive(
    st.none() | st.integers(-(2**64), 2**64 - 1) | st.binary(max_size=40) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5).map(tuple),
    max_leaves=20,
)


@given(cbor_values)
def test_our_cbor_is_cbor2_s_canonical_encoding(value: CborValue) -> None:
    assert encode_cbor(value) == cbor2.dumps(value, canonical=True)


@pytest.fixture(scope="module")
def vllm_sha256_cbor() -> Iterator[object]:
    """vLLM's hasher with its NONE_HASH seeded as a process without PYTHONHASHSEED seeds it
    (the fixed seed), restored afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("PYTHONHASHSEED", raising=False)
        if hasattr(kv_cache_utils, "NONE_HASH"):
            patch.setattr(kv_cache_utils, "NONE_HASH", kv_cache_utils.NONE_HASH)
        kv_cache_utils.init_none_hash(hashing.sha256_cbor)
        yield hashing.sha256_cbor


def vllm_hashes(
    hash_fn: object, token_ids: tuple[int, ...], block_size: int, salt: str | None
) -> list[bytes]:
    """vLLM's chain: each block hashed over its parent's hash, its tokens and its extra
    keys, the salt on the first block (``generate_block_hash_extra_keys``)."""
    parent = None
    hashes = []
    for index in range(len(token_ids) // block_size):
        extra = (("cache_salt", salt),) if index == 0 and salt else None
        block = list(token_ids[index * block_size : (index + 1) * block_size])
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, block, extra)
        hashes.append(parent)
    return hashes


@given(
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=40).map(tuple),
    block_size=st.integers(1, 8),
    salt=st.none() | st.text(min_size=1, max_size=8),
)
def test_our_block_hashes_are_vllm_s_with_sha256_cbor(
    vllm_sha256_cbor: object, token_ids: tuple[int, ...], block_size: int, salt: str | None
) -> None:
    ours = list(iter_block_hashes(token_ids, block_size, salt))
    assert ours == vllm_hashes(vllm_sha256_cbor, token_ids, block_size, salt)
    assert [compute_external_hash(h) for h in ours] == [
        kv_cache_utils.maybe_convert_block_hash(h) for h in ours
    ]


def test_none_hash_is_vllm_s_fixed_seed(vllm_sha256_cbor: object) -> None:
    assert kv_cache_utils.NONE_HASH == NONE_HASH


def test_an_empty_salt_is_a_namespace_of_its_own_unlike_in_vllm() -> None:
    empty, none = CacheKey("", (1, 2)), CacheKey(None, (1, 2))
    assert compute_key_hash(empty, 2) != compute_key_hash(none, 2)


def test_the_salt_changes_every_hash_after_the_first_block() -> None:
    salted = list(iter_block_hashes((1, 2, 3, 4), 2, "a"))
    plain = list(iter_block_hashes((1, 2, 3, 4), 2, None))
    assert salted[0] != plain[0] and salted[1] != plain[1]


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (23, b"\x17"),
        (24, b"\x18\x18"),
        (255, b"\x18\xff"),
        (256, b"\x19\x01\x00"),
        (65_535, b"\x19\xff\xff"),
        (65_536, b"\x1a\x00\x01\x00\x00"),
        (2**32, b"\x1b\x00\x00\x00\x01\x00\x00\x00\x00"),
        (2**64 - 1, b"\x1b" + b"\xff" * 8),
        (-257, b"\x39\x01\x00"),
    ],
)
def test_an_int_s_head_takes_the_fewest_bytes_at_each_size_s_edge(
    value: int, encoded: bytes
) -> None:
    # RFC 8949, 3.1: an argument below 24 in the head's byte, else in 1, 2, 4 or 8 bytes;
    # the random ints of the property above rarely land on an edge.
    assert encode_cbor(value) == encoded


def test_values_cbor_cannot_encode_without_a_tag_are_refused() -> None:
    with pytest.raises(ValueError, match="does not fit a CBOR head"):
        encode_cbor(2**64)
    with pytest.raises(ValueError, match="no bool"):
        encode_cbor(True)


def test_a_salt_utf8_cannot_encode_is_hashed_by_its_surrogatepass_bytes() -> None:
    """A JSON request's ``"\\ud800"``: accepted by the spec, no CBOR text string; its extra
    key holds its bytes (a CBOR byte string), so no text salt and no salt share its hashes."""
    lone = "\ud800"
    assert salt_extra_key(lone) == b"\xed\xa0\x80"
    hashes = {
        salt: compute_key_hash(CacheKey(salt, (1, 2)), 2)
        for salt in (lone, None, "", "\ufffd", "\xed\xa0\x80")
    }
    assert len(set(hashes.values())) == len(hashes)
    assert compute_key_hash(CacheKey(lone, (1, 2)), 2) == hashes[lone]  # deterministic
