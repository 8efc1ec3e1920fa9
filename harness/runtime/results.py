"""What a run reports: per-request outputs, the pool after each step, sharing, speculation.

``usage_sample`` keeps what a step needs of the manager's usage report; the rest are
records the engine fills.
"""

from dataclasses import dataclass, field

from harness.runtime.requests import RequestOutput
from spec import KVBlockUsage


@dataclass(frozen=True, slots=True)
class UsageSample:
    """The pool after one step: blocks in use, tokens held/reserved, blocks named by tables.

    ``table_blocks`` counts a block once per table that holds it, so it exceeds
    ``used_blocks`` by exactly the blocks sharing saves at that step. ``cached_free_blocks``
    are free blocks still holding a cached prefix; ``preemptions`` counts the manager's
    preemptions so far (the steps where it grows are the steps that preempted).
    ``skipped_table_blocks`` counts the blocks sliding windows released from the running
    requests' tables, over all groups (once per table, like ``table_blocks``): what
    keeping every block would hold on top of ``used_blocks``.
    """

    used_blocks: int
    request_count: int
    allocated_tokens: int
    reserved_tokens: int
    table_blocks: int
    cached_free_blocks: int = 0
    preemptions: int = 0
    skipped_table_blocks: int = 0


@dataclass(slots=True)
class SpeculationCounts:
    """Drafts proposed and accepted, and the tokens decodes emitted per decode forward.

    A decode forward is one request's part of one step's forward (its pending token, plus
    its drafts when it speculates); without speculation each emits exactly one token.
    """

    proposed_drafts: int = 0
    accepted_drafts: int = 0
    decode_forwards: int = 0
    decode_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (0.0 when none was proposed)."""
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens emitted per decode forward (1.0 without speculation)."""
        return self.decode_tokens / self.decode_forwards if self.decode_forwards else 0.0


@dataclass(slots=True)
class HostTierCounts:
    """Preemptions by kind and what moved between the device and the host tier.

    ``recomputed_tokens``: prefill tokens fed again after recompute preemptions (positions
    whose K/V a preemption dropped; a prefix hit on re-admission saves some).
    ``blocks_to_host`` / ``blocks_to_device`` count every swap copy each way: swaps, the
    host prefix cache's copies of freed cached blocks and its hits' copies back.
    ``swap_s``: wall time of the preemptions (their copies included), the swap-ins and
    every other swap copy.
    """

    swaps_out: int = 0
    swaps_in: int = 0
    recomputes: int = 0
    recomputed_tokens: int = 0
    blocks_to_host: int = 0
    blocks_to_device: int = 0
    host_prefix_hit_tokens: int = 0
    swap_s: float = 0.0


@dataclass(slots=True)
class EngineResult:
    """A whole run: per-request outputs, which requests shared each forward, and pool usage.

    ``prefill_tokens`` counts the prompt tokens fed to forwards (a prefix hit's cached
    tokens are not; a preempted request's recompute is); the last four count what the
    manager counted over the run (``blocks_freed_by_window``: table entries sliding
    windows released).
    """

    outputs: dict[str, RequestOutput]
    schedule: list[tuple[str, ...]]
    usage: list[UsageSample]
    elapsed_s: float
    prefill_tokens: int = 0
    prefix_hit_tokens: int = 0
    cow_copies: int = 0
    preemptions: int = 0
    speculation: SpeculationCounts = field(default_factory=SpeculationCounts)
    blocks_freed_by_window: int = 0
    host: HostTierCounts = field(default_factory=HostTierCounts)

    @property
    def generated_tokens(self) -> int:
        """All tokens sampled in the run."""
        return sum(len(output.token_ids) for output in self.outputs.values())

    @property
    def peak_used_blocks(self) -> int:
        """The most blocks in use after any step."""
        return max((sample.used_blocks for sample in self.usage), default=0)

    @property
    def peak_requests(self) -> int:
        """The most requests holding blocks after any step."""
        return max((sample.request_count for sample in self.usage), default=0)

    @property
    def block_utilization(self) -> float:
        """Tokens held / token slots reserved, summed over all steps (1.0 = no waste).

        Tokens are counted per table, slots per block in use: with shared blocks (prefix
        hits, forks) it can exceed 1.
        """
        reserved = sum(sample.reserved_tokens for sample in self.usage)
        allocated = sum(sample.allocated_tokens for sample in self.usage)
        return allocated / reserved if reserved else 1.0

    @property
    def blocks_saved_by_sharing(self) -> int:
        """The most, after any step, by which the blocks all tables name exceed those in use."""
        return max((s.table_blocks - s.used_blocks for s in self.usage), default=0)

    @property
    def peak_blocks_saved_by_window(self) -> int:
        """The most blocks, after any step, that keeping every block would have held on
        top of those in use: the running tables' entries sliding windows released."""
        return max((s.skipped_table_blocks for s in self.usage), default=0)


def usage_sample(usage: KVBlockUsage) -> UsageSample:
    """The pool now, from the manager's usage report: blocks in use, tokens, the blocks its
    tables name and skipped over every KV cache group."""
    return UsageSample(
        usage.used_blocks,
        usage.request_count,
        usage.allocated_tokens,
        usage.reserved_tokens,
        usage.table_blocks,
        cached_free_blocks=usage.cached_free_blocks,
        preemptions=usage.preemptions,
        skipped_table_blocks=usage.table_skipped_blocks,
    )
