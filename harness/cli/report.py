"""The main command's report: a table per request and the totals, or the same as JSON.

One name per check everywhere: ``gate``, ``alone`` and ``batch`` in the table, the JSON and
``RequestReport``.
"""

import argparse

import torch

from harness.oracle.checks import CheckResult
from harness.oracle.equivalence import EquivalenceReport


def _mark(passed: bool, tie: bool = False) -> str:
    if not passed:
        return "FAIL"
    return "tie" if tie else "ok"


def print_table(report: EquivalenceReport) -> None:
    """The table of requests, the run's totals, then ``report.summary()``."""
    pool = report.pool
    print(
        f"model {report.model_name}; pool {pool.total_blocks} blocks x {pool.block_size} tokens; "
        f"{pool.engine_type.__name__}, {pool.pool_type.__name__}, "
        f"prefix caching {'on' if pool.prefix_caching else 'off'}; "
        f"attention {report.attention}"
    )
    header = (
        f"{'request':<8} {'prompt':>6} {'gen':>4} {'gate':>5} {'alone':>5} {'batch':>5} "
        f"{'max|dlogp|':>11} {'blocks':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in report.rows:
        print(
            f"{row.request_id:<8} {row.prompt_tokens:>6} {row.generated_tokens:>4} "
            f"{_mark(row.gate.passed):>5} {_mark(row.alone.passed):>5} "
            f"{_mark(row.batch.passed, row.batch.tie):>5} {row.max_logprob_delta:>11.3g} "
            f"{row.max_blocks:>6}"
        )
    mib = 1024 * 1024
    print()
    if report.attention_agreement:
        worst = max(report.attention_agreement, key=report.attention_agreement.__getitem__)
        print(
            f"{report.attention} vs gather, max |diff| of attention outputs over the batched "
            f"run: {report.attention_agreement[worst]:.3g} (layer {worst}, worst of "
            f"{len(report.attention_agreement)} layers)"
        )
    print(
        f"KV memory: paged pool {report.pool_bytes / mib:.1f} MiB, peak in use "
        f"{report.peak_paged_bytes / mib:.1f} MiB; contiguous reservation at max length for "
        f"{report.peak_requests} concurrent requests {report.contiguous_bytes / mib:.1f} MiB"
    )
    print(
        "block utilization (tokens per table / slots reserved, over steps; a shared token counts "
        "in every table holding it, so sharing can exceed 1): "
        f"{report.block_utilization:.3f}"
    )
    print(
        f"sharing: prefix hits {report.prefix_hit_tokens} tokens (prefill fed "
        f"{report.prefill_tokens} tokens); copy-on-write copies {report.cow_copies}; "
        f"preemptions {report.preemptions + report.host.swaps_out} (by swap and by "
        f"recompute); blocks saved by sharing (peak) "
        f"{report.blocks_saved_by_sharing}"
    )
    _print_host_tier(report)
    by_salt = report.prefix_hit_tokens_by_salt
    if by_salt:
        print(
            "prefix hits by cache salt (a prompt hits only its own salt's blocks): "
            + ", ".join(f"{salt} {tokens} tokens" for salt, tokens in sorted(by_salt.items()))
        )
    speculation = report.speculation
    if speculation.proposed_drafts:
        print(
            f"speculation: {speculation.accepted_drafts}/{speculation.proposed_drafts} drafts "
            f"accepted ({speculation.acceptance_rate:.3f}); "
            f"{speculation.tokens_per_forward:.2f} tokens per decode forward"
        )
    if report.chunks_per_prompt > 1:
        print(f"chunked prefill: {report.chunks_per_prompt:.2f} forwards per prompt (mean)")
    if report.checkpoint_interval:
        print(
            f"recurrent state group: one state block per request, checkpointed every "
            f"{report.checkpoint_interval} tokens (prefill chunks end there); a prefix hit "
            f"restores the state checkpointed at exactly its length; state rows "
            f"{report.state_bytes / 1024:.1f} KiB beside the K/V pool"
        )
    if report.blocks_freed_by_window:
        print(
            f"sliding windows: blocks freed {report.blocks_freed_by_window}; blocks saved "
            f"against keeping every block (peak) {report.peak_blocks_saved_by_window}"
        )
    print(
        f"decode throughput: dense generate (one request at a time) "
        f"{report.dense_tokens_per_s:.1f} tok/s; paged continuous batching "
        f"{report.paged_tokens_per_s:.1f} tok/s"
    )
    print(report.summary())


def _print_host_tier(report: EquivalenceReport) -> None:
    """The preemptions by kind and what moved through the host tier, when either happened."""
    host, pool = report.host, report.pool
    if not (pool.host_blocks or host.recomputes):
        return
    mib = 1024 * 1024
    block_bytes = report.pool_bytes // pool.total_blocks
    print(
        f"preemption ({pool.preemption}): swaps out {host.swaps_out}, in {host.swaps_in}; "
        f"by recompute {host.recomputes} ({host.recomputed_tokens} tokens recomputed); "
        f"{host.swap_s * 1000:.1f} ms in preemptions, swap-ins and swap copies"
    )
    if pool.host_blocks:
        print(
            f"host tier: {pool.host_blocks} blocks ({pool.host_blocks * block_bytes / mib:.1f} "
            f"MiB); blocks copied to host {host.blocks_to_host} "
            f"({host.blocks_to_host * block_bytes / mib:.1f} MiB), to device "
            f"{host.blocks_to_device} ({host.blocks_to_device * block_bytes / mib:.1f} MiB); "
            f"host prefix hits {host.host_prefix_hit_tokens} tokens "
            f"(host prefix cache {'on' if pool.host_prefix_cache else 'off'})"
        )


def as_json(
    report: EquivalenceReport, device: torch.device, args: argparse.Namespace
) -> dict[str, object]:
    """The report as JSON-ready data; ``args``: the main command's options."""
    pool = report.pool
    block_bytes = report.pool_bytes // pool.total_blocks

    def check(result: CheckResult) -> dict[str, object]:
        return {
            "passed": result.passed,
            "tie": result.tie,
            "margin_ulps": result.margin_ulps,
            "detail": result.detail,
        }

    return {
        "model": report.model_name,
        "device": str(device),
        "dtype": report.tie_rule.dtype_name,
        "total_blocks": pool.total_blocks,
        "block_size": pool.block_size,
        "batch_invariant": bool(args.batch_invariant),
        "poison_freed": bool(args.poison_freed),
        "prefix_caching": not args.no_prefix_cache,
        "system_prompt": args.system_prompt,
        "salts": args.salts,
        "n": args.n,
        "preempt": args.preempt,
        "host_blocks": pool.host_blocks,
        "host_prefix_cache": pool.host_prefix_cache,
        "attention": report.attention,
        "checkpoint_interval": report.checkpoint_interval,
        "state_bytes": report.state_bytes,
        "passed": report.passed,
        "schedules_equal": report.schedules_equal,
        "attention_agreement_max_abs_diff": {
            str(layer): difference for layer, difference in report.attention_agreement.items()
        },
        "tie_rule": {"dtype": report.tie_rule.dtype_name, "max_ulps": report.tie_rule.max_ulps},
        "requests": [
            {
                "request_id": row.request_id,
                "prompt_tokens": row.prompt_tokens,
                "generated_tokens": row.generated_tokens,
                "gate": check(row.gate),
                "alone": check(row.alone),
                "batch": check(row.batch),
                "max_abs_delta_logprob": row.max_logprob_delta,
                "max_blocks": row.max_blocks,
                "prefill_chunks": row.prefill_chunks,
                "cache_salt": row.cache_salt,
                "prefix_hit_tokens": row.prefix_hit_tokens,
            }
            for row in report.rows
        ],
        "totals": {
            "dense_tokens_per_s": report.dense_tokens_per_s,
            "paged_tokens_per_s": report.paged_tokens_per_s,
            "pool_bytes": report.pool_bytes,
            "peak_paged_bytes": report.peak_paged_bytes,
            "contiguous_bytes": report.contiguous_bytes,
            "block_utilization": report.block_utilization,
            "peak_requests": report.peak_requests,
            "prefill_tokens": report.prefill_tokens,
            "prefix_hit_tokens": report.prefix_hit_tokens,
            "prefix_hit_tokens_by_salt": report.prefix_hit_tokens_by_salt,
            "cow_copies": report.cow_copies,
            "preemptions": report.preemptions + report.host.swaps_out,
            "blocks_saved_by_sharing": report.blocks_saved_by_sharing,
            "speculate": args.speculate or 0,
            "proposed_drafts": report.speculation.proposed_drafts,
            "accepted_drafts": report.speculation.accepted_drafts,
            "acceptance_rate": report.speculation.acceptance_rate,
            "tokens_per_forward": report.speculation.tokens_per_forward,
            "max_batch_tokens": args.max_batch_tokens,
            "chunks_per_prompt": report.chunks_per_prompt,
            "blocks_freed_by_window": report.blocks_freed_by_window,
            "peak_blocks_saved_by_window": report.peak_blocks_saved_by_window,
            "batched_s": report.batched_s,
            "swaps_out": report.host.swaps_out,
            "swaps_in": report.host.swaps_in,
            "recompute_preemptions": report.host.recomputes,
            "recomputed_tokens": report.host.recomputed_tokens,
            "blocks_to_host": report.host.blocks_to_host,
            "blocks_to_device": report.host.blocks_to_device,
            "bytes_to_host": report.host.blocks_to_host * block_bytes,
            "bytes_to_device": report.host.blocks_to_device * block_bytes,
            "host_prefix_hit_tokens": report.host.host_prefix_hit_tokens,
            "swap_s": report.host.swap_s,
        },
    }
