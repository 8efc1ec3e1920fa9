"""The KV memory comparison: every scheme's slots and stored tokens, step by step, by hand."""

from harness.bench.kv_memory import (
    CONTIGUOUS_FINAL,
    CONTIGUOUS_MAX,
    PAGED,
    PAGED_SHARING,
    measure_kv_memory,
    with_token_ids,
)
from harness.bench.prefix import PromptRequest
from harness.bench.traces import TraceRequest


def test_two_requests_sharing_a_block_cost_each_scheme_what_it_reserves() -> None:
    # Block size 2. "a": 3 prompt tokens, 2 to generate; "b": 5, 1; they share block (1, 2).
    # Step 0: a holds 3 tokens, b 5. Step 1: b has finished; a holds 4.
    trace = [PromptRequest("a", (1, 2, 3), 2), PromptRequest("b", (1, 2, 4, 5, 6), 1)]
    series = measure_kv_memory("tiny", trace, block_size=2, max_running=2, seed=0)
    assert series.reserved == {
        CONTIGUOUS_MAX: [2 * 6, 6],  # the longest request is b: 5 + 1 tokens
        CONTIGUOUS_FINAL: [5 + 6, 5],
        PAGED: [4 + 6, 4],
        PAGED_SHARING: [8, 4],  # block (1, 2) once: four blocks, then a's two
    }
    assert series.stored == {
        CONTIGUOUS_MAX: [8, 4],
        CONTIGUOUS_FINAL: [8, 4],
        PAGED: [8, 4],
        PAGED_SHARING: [6, 4],  # tokens 1, 2 stored once
    }
    assert series.share_holding_tokens(CONTIGUOUS_MAX) == 12 / 18
    assert series.share_holding_tokens(PAGED_SHARING) == 10 / 12


def test_seats_limit_the_requests_running_at_once() -> None:
    trace = [PromptRequest(f"r{i}", (i, i), 1) for i in range(3)]
    series = measure_kv_memory("seats", trace, block_size=2, max_running=2, seed=0)
    # Step 0: r0 and r1, two tokens each; step 1: r2 alone, in the seat r0 left.
    assert series.stored[PAGED] == [4, 2]


def test_the_length_trace_gets_prompt_token_ids_of_its_lengths() -> None:
    trace = [TraceRequest("a", 3, 7), TraceRequest("b", 1, 2)]
    requests = with_token_ids(trace, seed=0)
    assert [(r.request_id, len(r.token_ids), r.output_tokens) for r in requests] == [
        ("a", 3, 7),
        ("b", 1, 2),
    ]
    assert with_token_ids(trace, seed=0) == requests
