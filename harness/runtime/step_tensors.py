"""The step's metadata in the form paged-attention kernels take it, built once per step.

FlashAttention's varlen API (``torch.nn.attention.varlen.varlen_attn``), its CPU
emulator and the FlexAttention block mask all read the same few tensors: a padded
``block_table``, each request's key count ``seqused_k``, and the packed queries'
boundaries ``cu_seqlens_q``. They are built here from the store's block ids of each
request (the manager's for the paged pool), once per step, and every layer shares them.

The slots the step's new K/V rows are written to are *not* recomputed here: the write
index stays the plan's (``KVPlan.write_index``, the slots the manager handed out), so a
manager whose slot disagrees with its own table is caught by what attention then reads.
This module knows nothing of torch's attention functions.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from spec import blocks_for_tokens

# The block id in every padding entry of ``block_table``: never a valid block, so a kernel
# that addressed one would fault (an index of -1) instead of reading a real block.
PAD_BLOCK_ID = -1


@dataclass(frozen=True, slots=True)
class StepTensors:
    """One packed step of ``B`` requests, as the kernels take it (all on the pool's device).

    Request ``b`` feeds queries ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of the packed
    step and attends to its first ``seqused_k[b]`` keys, key ``t`` at row ``t %
    block_size`` of block ``block_table[b, t // block_size]``. Its queries are its last
    tokens: query ``i`` of ``q`` sits at position ``seqused_k[b] - q + i``.
    """

    block_table: torch.Tensor  # [B, max_blocks] int32, PAD_BLOCK_ID past each request's blocks
    seqused_k: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32, the running sum of seqused_k
    max_q: int
    max_k: int
    block_size: int

    @property
    def batch_size(self) -> int:
        """The requests of the step."""
        return int(self.seqused_k.shape[0])


def build_step_tensors(
    block_ids: Sequence[Sequence[int]],
    token_counts: Sequence[int],
    new_token_counts: Sequence[int],
    block_size: int,
    device: torch.device,
) -> StepTensors:
    """The step's tensors from each request's block ids, tokens held and tokens fed.

    ``block_ids[b]`` must hold exactly the blocks of ``token_counts[b]`` tokens, and a
    request feeds at least one and at most all of its tokens.
    """
    for index, (ids, tokens, new) in enumerate(
        zip(block_ids, token_counts, new_token_counts, strict=True)
    ):
        if len(ids) != blocks_for_tokens(block_size, tokens) or not 1 <= new <= tokens:
            raise ValueError(
                f"request {index} of the step: {len(ids)} blocks of {block_size} for "
                f"{tokens} tokens, {new} of them new"
            )
    seqused_k = kv_lengths(token_counts)
    return StepTensors(
        block_table=torch.tensor(table_rows(block_ids), dtype=torch.int32, device=device),
        seqused_k=torch.tensor(seqused_k, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(
            list(accumulate(new_token_counts, initial=0)), dtype=torch.int32, device=device
        ),
        cu_seqlens_k=torch.tensor(
            list(accumulate(seqused_k, initial=0)), dtype=torch.int32, device=device
        ),
        max_q=max(new_token_counts),
        max_k=max(token_counts),
        block_size=block_size,
    )


def table_rows(block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """``block_table``'s rows: request ``b``'s block ids in order, padded with
    ``PAD_BLOCK_ID`` to the longest table of the step."""
    max_blocks = max(len(ids) for ids in block_ids)
    return [list(ids) + [PAD_BLOCK_ID] * (max_blocks - len(ids)) for ids in block_ids]


def kv_lengths(token_counts: Sequence[int]) -> list[int]:
    """``seqused_k``: each request attends to every token it holds, this step's included."""
    return list(token_counts)
