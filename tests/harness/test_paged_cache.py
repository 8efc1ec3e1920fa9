"""``PagedCache``: HF ``generate`` on the paged pool equals ``generate`` on its dense cache."""

from typing import Any

import pytest
import torch

from harness.runtime.kv_pool import PagedKVPool
from harness.runtime.paged_cache import PagedCache
from impl import BlockAllocationError, KVCacheManager
from tests.support.harness_cases import SwappedBlockManager, poisoned_pool, pool_layout, tiny_model

NEW_TOKENS = 10


def left_padded_batch(prompt_lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids ``[batch, width]``, each row left-padded to the longest, and its mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(prompt_lengths)
    vocab = tiny_model().model.config.vocab_size
    input_ids = torch.randint(vocab, (len(prompt_lengths), width), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, length in enumerate(prompt_lengths):
        input_ids[row, : width - length] = 0
        attention_mask[row, : width - length] = 0
    return input_ids, attention_mask


def generate(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: PagedCache | None
) -> Any:  # Any: transformers' GenerateDecoderOnlyOutput
    """Greedy ``generate`` with every step's logits, on ``cache`` or on HF's dense cache."""
    with torch.no_grad():
        return tiny_model().model.generate(
            input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )


@pytest.mark.parametrize(
    ("prompt_lengths", "block_size"), [([13], 1), ([13], 4), ([13, 9, 4], 4), ([7, 21], 16)]
)
def test_generate_on_a_paged_cache_is_bit_identical_to_its_dense_cache(
    prompt_lengths: list[int], block_size: int
) -> None:
    input_ids, attention_mask = left_padded_batch(prompt_lengths, seed=block_size)
    reference = generate(input_ids, attention_mask, None)
    manager = KVCacheManager(64, block_size)
    manager.allocate("filler", 3 * block_size)  # our blocks start at 3: ids differ from rows
    with PagedCache(manager, poisoned_pool(64, block_size), len(prompt_lengths)) as cache:
        paged = generate(input_ids, attention_mask, cache)
        # Every row holds the padded prompt and all but the last new token.
        table = manager.tables("row-0")[0]
        assert table.token_count == input_ids.shape[1] + NEW_TOKENS - 1
        assert table.block_ids[0] >= 3
    assert torch.equal(paged.sequences, reference.sequences)
    assert len(paged.logits) == len(reference.logits) == NEW_TOKENS
    for paged_logits, reference_logits in zip(paged.logits, reference.logits, strict=True):
        assert torch.equal(paged_logits, reference_logits)
    assert manager.usage().free_blocks == 61  # released at the end of the block
    assert set(manager.to_spec().tables) == {"filler"}
    manager.check_invariants()


def test_a_corrupted_block_table_makes_generate_on_the_paged_cache_diverge() -> None:
    input_ids, attention_mask = left_padded_batch([13, 9], seed=0)
    reference = generate(input_ids, attention_mask, None)
    manager = SwappedBlockManager(64, 4)
    with PagedCache(manager, PagedKVPool(pool_layout(), 64, 4), 2) as cache:
        paged = generate(input_ids, attention_mask, cache)
    assert not torch.equal(paged.logits[-1], reference.logits[-1])


def test_a_pool_too_small_refuses_the_step_and_changes_nothing() -> None:
    input_ids, attention_mask = left_padded_batch([8, 8], seed=0)
    manager = KVCacheManager(5, 4)  # 2 rows x 2 prompt blocks fit; the decode needs 2 more
    cache = PagedCache(manager, PagedKVPool(pool_layout(), 5, 4), 2)
    with pytest.raises(BlockAllocationError, match=r"needed=1 free=0 \(request 'row-1'\)"):
        generate(input_ids, attention_mask, cache)
    assert [manager.tables(r)[0].token_count for r in cache.request_ids] == [8, 8]
    assert manager.usage().free_blocks == 1
    cache.release()
    assert manager.usage().free_blocks == 5
    manager.check_invariants()


def test_a_paged_cache_refuses_a_pool_other_than_its_managers() -> None:
    with pytest.raises(ValueError, match=r"manager \(8 blocks of 4\) and pool \(8 blocks of 2\)"):
        PagedCache(KVCacheManager(8, 4), PagedKVPool(pool_layout(), 8, 2), 1)


def test_a_paged_cache_refuses_rows_the_manager_already_holds() -> None:
    manager = KVCacheManager(8, 4)
    manager.allocate("row-1", 3)
    cache = PagedCache(manager, PagedKVPool(pool_layout(), 8, 4), 2)
    input_ids, attention_mask = left_padded_batch([3, 3], seed=0)
    with pytest.raises(ValueError, match=r"already holds requests \['row-1'\]"):
        generate(input_ids, attention_mask, cache)
    assert set(manager.to_spec().tables) == {"row-1"}


def test_beam_search_on_a_paged_cache_is_refused_with_a_clear_error() -> None:
    input_ids, attention_mask = left_padded_batch([5], seed=0)
    manager = KVCacheManager(16, 4)
    with (
        PagedCache(manager, PagedKVPool(pool_layout(), 16, 4), 2) as cache,
        torch.no_grad(),
        pytest.raises(NotImplementedError, match="beam search"),
    ):
        tiny_model().model.generate(
            input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            max_new_tokens=3,
            num_beams=2,
            do_sample=False,
            pad_token_id=0,
        )
    assert manager.usage().free_blocks == 16
