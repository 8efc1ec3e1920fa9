"""The synthetic serving traces the allocator benchmarks replay: ShareGPT-like lengths, and
a long-context trace for the sliding-window table. Fixed seeds, no model, no torch.

The ShareGPT-like shape follows ShareGPT-style serving benchmarks: lognormal prompt lengths
(mean ~160 tokens, p99 ~1,000) and output lengths (mean ~330, p99 ~1,800).
"""

import math
import random
from dataclasses import dataclass

# Lognormal (mu, sigma) solved from mean = exp(mu + sigma^2 / 2), p99 = exp(mu + 2.326 sigma).
PROMPT_MU, PROMPT_SIGMA = 4.570, 1.005  # mean ~160, p99 ~1,000 tokens
OUTPUT_MU, OUTPUT_SIGMA = 5.389, 0.906  # mean ~330, p99 ~1,800 tokens
MAX_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace: its prompt length and how many tokens it generates."""

    request_id: str
    prompt_tokens: int
    output_tokens: int


def make_trace(request_count: int, seed: int) -> list[TraceRequest]:
    """A fixed-seed list of requests with lognormal prompt and output lengths."""
    rng = random.Random(seed)

    def length(mu: float, sigma: float) -> int:
        return max(1, min(MAX_TOKENS, round(rng.lognormvariate(mu, sigma))))

    return [
        TraceRequest(f"req-{i}", length(PROMPT_MU, PROMPT_SIGMA), length(OUTPUT_MU, OUTPUT_SIGMA))
        for i in range(request_count)
    ]


def long_context_trace(request_count: int, seed: int) -> list[TraceRequest]:
    """A fixed-seed long-context trace: prompts log-uniform in [8k, 32k] tokens, outputs
    log-uniform in [1k, 8k]."""
    rng = random.Random(seed)

    def log_uniform(low: int, high: int) -> int:
        return round(math.exp(rng.uniform(math.log(low), math.log(high))))

    return [
        TraceRequest(f"long-{i}", log_uniform(8192, 32768), log_uniform(1024, 8192))
        for i in range(request_count)
    ]
