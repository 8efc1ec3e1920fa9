"""A random packed step over a random pool, and gather's answer for it (kernel tests).

Not a conftest: the kernel tests import it.
"""

import math
import random

import torch
from torch.nn.functional import scaled_dot_product_attention

from harness.runtime.step_batch import partial_prefill_mask
from harness.runtime.step_tensors import StepTensors, build_step_tensors
from harness.runtime.varlen_emulator import varlen_attention_emulated
from spec import blocks_for_tokens, slot_index

HEAD_DIM = 8


class RandomStep:
    """A pool with ``len(token_counts)`` requests on shuffled blocks, queries for each
    request's last ``new_token_counts[b]`` tokens, and NaN in every row no request owns."""

    def __init__(
        self,
        token_counts: list[int],
        new_token_counts: list[int],
        block_size: int,
        heads: tuple[int, int],
        seed: int,
    ) -> None:
        rng = random.Random(seed)
        generator = torch.Generator().manual_seed(seed)
        num_heads, num_kv_heads = heads
        needs = [blocks_for_tokens(block_size, count) for count in token_counts]
        total_blocks = sum(needs) + 2  # two blocks no one holds
        order = list(range(total_blocks))
        rng.shuffle(order)
        self.block_ids = []
        for need in needs:
            self.block_ids.append(order[:need])
            order = order[need:]
        shape = (total_blocks, block_size, num_kv_heads, HEAD_DIM)
        self.keys = torch.full(shape, float("nan"))
        self.values = torch.full(shape, float("nan"))
        flat_keys, flat_values = self.keys.view(-1, *shape[2:]), self.values.view(-1, *shape[2:])
        for ids, count in zip(self.block_ids, token_counts, strict=True):
            slots = [slot_index(block_size, ids, position) for position in range(count)]
            flat_keys[slots] = torch.randn(count, num_kv_heads, HEAD_DIM, generator=generator)
            flat_values[slots] = torch.randn(count, num_kv_heads, HEAD_DIM, generator=generator)
        self.query = torch.randn(sum(new_token_counts), num_heads, HEAD_DIM, generator=generator)
        self.token_counts = token_counts
        self.new_token_counts = new_token_counts
        self.block_size = block_size
        self.scale = 1 / math.sqrt(HEAD_DIM)

    def tensors(self) -> StepTensors:
        return build_step_tensors(
            self.block_ids,
            self.token_counts,
            self.new_token_counts,
            self.block_size,
            torch.device("cpu"),
        )

    def emulated(self) -> torch.Tensor:
        return varlen_attention_emulated(
            self.query, self.keys, self.values, self.tensors(), self.scale
        )

    def gathered(self) -> torch.Tensor:
        """Gather's computation: each request's keys by slot, SDPA with the hook's mask."""
        outputs = []
        start = 0
        flat_keys = self.keys.flatten(0, 1)
        flat_values = self.values.flatten(0, 1)
        for ids, count, new in zip(
            self.block_ids, self.token_counts, self.new_token_counts, strict=True
        ):
            slots = [slot_index(self.block_size, ids, position) for position in range(count)]
            keys = flat_keys[slots].transpose(0, 1)[None]  # [1, kv_heads, count, dim]
            values = flat_values[slots].transpose(0, 1)[None]
            query = self.query[start : start + new].transpose(0, 1)[None]  # [1, heads, new, dim]
            mask = partial_prefill_mask(new, count, torch.device("cpu"))
            output = scaled_dot_product_attention(
                query,
                keys,
                values,
                attn_mask=mask,
                is_causal=mask is None and new > 1,
                scale=self.scale,
                enable_gqa=True,
            )
            outputs.append(output[0].transpose(0, 1))
            start += new
        return torch.cat(outputs)
