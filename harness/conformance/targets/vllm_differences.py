"""What vLLM's configurations break by design (declared differences, each with its reason)
and the findings a run may be asked to look past (``--known-findings``), by configuration:
``vllm-full``, ``vllm-hybrid`` (a sliding window beside full attention) and ``vllm-mamba``
(a Mamba group in align mode beside full attention). docs/conformance.md explains each.
"""

from collections.abc import Mapping
from types import MappingProxyType

_WHICH_COPY = (
    "with two cached blocks for a prefix, a hit takes the one cached first, evictable or "
    "held; reviving an evictable one costs a free block, so an admission can need a block "
    "more or less than the kit's model (one block per prefix) predicts"
)
FULL_DIFFERENCES: Mapping[str, str] = MappingProxyType(
    {
        "one_block_per_prefix": "a prompt's last full block, recomputed because the last "
        "token is never a hit, is cached again beside the block already caching its "
        "prefix (BlockHashToBlockMap keeps several blocks per hash)",
        "refusal_justified/allocate_prompt": _WHICH_COPY,
        "capacity_respected/allocate_prompt": _WHICH_COPY,
        "events_stored_twice": "each copy of a prefix (one_block_per_prefix) is stored, so "
        "its hash is stored again while present",
    }
)
HYBRID_DIFFERENCES: Mapping[str, str] = MappingProxyType(
    {
        **FULL_DIFFERENCES,
        "refusal_atomic/append_token_ids": "allocate_slots releases the blocks that left "
        "the window before it finds it cannot allocate, and keeps them released (its "
        "comment: 'We can do this even if we cannot schedule this request')",
    }
)

# The findings (docs/findings/), declared only when a run asks to look past them.
FINDINGS: Mapping[str, str] = MappingProxyType(
    {
        "eviction_justified/duplicate": "FINDING docs/findings/vllm-duplicate-blocks.md: a "
        "second cached block for a prefix is evicted in LRU order like a unique one, so a "
        "unique cached prefix goes while a redundant copy stays",
        "events_missing": "FINDING docs/findings/vllm-kv-events.md: evicting one copy of a "
        "prefix publishes BlockRemoved for its hash while another copy stays cached (vLLM "
        "#55092's class): a router's set of keys loses a prefix the engine still hits",
    }
)

_HELD = (
    "vLLM's Mamba table holds, beside the running state, the block it copies from (a hit's "
    "checkpoint, the previous running block) until remove_skipped_blocks frees it two "
    "steps later, and takes a new block at every block boundary, where the spec holds one "
    "block and takes one only to copy a cached or shared state: a request needs more "
    "blocks than the spec predicts"
)
MAMBA_DIFFERENCES: Mapping[str, str] = MappingProxyType(
    {
        **FULL_DIFFERENCES,
        "refusal_justified/append_token_ids": _HELD,
        "refusal_justified/whole_prompt": "with prefills chunked, the scheduler admits a "
        "request only if its whole prompt's blocks fit (allocate_slots' "
        "full_sequence_must_fit: get_num_blocks_to_allocate with apply_admission_cap), "
        "where the call admits its first chunk, all the spec's allocate_prompt is given",
        "refusal_justified/deferred": "a hit on a Mamba checkpoint cached in the same "
        "step is deferred to the next (MambaManager.get_num_blocks_to_allocate returns "
        "more blocks than the pool has while the block is in cached_blocks_this_step): "
        "vLLM caches a checkpoint when it schedules the chunk that writes it, before the "
        "forward, where the spec caches it at the request's next adding operation, after",
    }
)
