"""What the GPU check's environment stage asks torch's SDPA: which backend it picks for
each call the harness makes, by default and in the harness's order
(``harness.runtime.sdpa_order``), and what a call at a key count not seen before costs on
each backend (cuDNN builds a graph per new shape; the others have nothing to build)."""

import statistics
import warnings
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.bench.attention import timed
from harness.gpu_check.gpu_plan import DTYPES
from harness.runtime.sdpa_order import HARNESS_ORDER, harness_sdpa_order

# SmolLM2's attention: 9 query heads over 3 KV heads of 64.
QUERY_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# Decode calls at this many fresh key counts per backend (each backend its own counts, so
# none finds another's cached graph), then this many repeats of the last one.
NEW_SHAPES, REPEATS = 5, 5
FIRST_KEY_COUNT = 700


def sdpa_backends(device: torch.device, *, harness_order: bool = False) -> dict[str, str]:
    """Which SDPA backend torch picks for each call our attention makes, bf16 and fp32;
    in the harness's order when ``harness_order``, else torch's own.

    The calls: a whole prefill (``is_causal``), a one-query decode, a partial prefill with
    a bottom-right bool mask.
    """
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa  # noqa: PLC0415

    names = {int(backend.value): name for name, backend in SDPBackend.__members__.items()}
    order: AbstractContextManager[None] = (
        harness_sdpa_order(device) if harness_order else nullcontext()
    )
    chosen: dict[str, str] = {}
    with order:
        for dtype_name, dtype in DTYPES.items():
            for shape, (queries, keys, masked, causal) in {
                "prefill_256": (256, 256, False, True),
                "decode_1_of_512": (1, 512, False, False),
                "partial_prefill_16_of_512": (16, 512, True, False),
            }.items():
                query = torch.randn(1, QUERY_HEADS, queries, HEAD_DIM, dtype=dtype, device=device)
                key = torch.randn(1, KV_HEADS, keys, HEAD_DIM, dtype=dtype, device=device)
                mask = None
                if masked:
                    mask = torch.ones(queries, keys, dtype=torch.bool, device=device)
                    mask = mask.tril(keys - queries)[None, None]
                gqa = bool(use_gqa_in_sdpa(mask, key, key))
                if not gqa:  # HF's wrapper repeats the KV heads instead
                    key = key.repeat_interleave(QUERY_HEADS // KV_HEADS, dim=1)
                try:
                    choice = torch._fused_sdp_choice(
                        query, key, key, mask, 0.0, causal, scale=None, enable_gqa=gqa
                    )
                    name = names.get(int(choice), str(choice))
                    chosen[f"{dtype_name}/{shape}"] = f"{name} (gqa={gqa})"
                except Exception as error:  # a private API: report, never fail the stage
                    chosen[f"{dtype_name}/{shape}"] = f"unknown: {type(error).__name__}: {error}"
    return chosen


def sdpa_new_shape_cost(device: torch.device) -> dict[str, object]:
    """Per backend (forced alone), bf16 one-query decode at SmolLM2's heads: the median ms
    of a call at a key count not seen before, and of a repeated call; a backend that cannot
    take the call here is reported in one line."""
    cost: dict[str, object] = {}
    for number, backend in enumerate((*HARNESS_ORDER, SDPBackend.CUDNN_ATTENTION)):
        key_counts = [FIRST_KEY_COUNT + 64 * number + i for i in range(NEW_SHAPES)]
        try:
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")  # torch warns why each other kernel is out
                first = [_decode_call_ms(device, keys) for keys in key_counts]
                again = [_decode_call_ms(device, key_counts[-1]) for _ in range(REPEATS)]
        except RuntimeError as error:
            cost[backend.name] = f"unavailable: {str(error).splitlines()[0]}"
            continue
        cost[backend.name] = {
            "new_shape_ms": round(statistics.median(first), 3),
            "repeat_ms": round(statistics.median(again), 3),
        }
    return cost


def _decode_call_ms(device: torch.device, keys: int) -> float:
    query = torch.randn(1, QUERY_HEADS, 1, HEAD_DIM, dtype=torch.bfloat16, device=device)
    key = torch.randn(1, KV_HEADS, keys, HEAD_DIM, dtype=torch.bfloat16, device=device)
    attend = partial(
        torch.nn.functional.scaled_dot_product_attention, query, key, key, enable_gqa=True
    )
    return timed(attend, device) * 1000
