"""``python -m harness.bench.attention``: ms per decode attention call, gather vs the kernels.

One decode step at SmolLM2-135M's attention shapes (9 query heads on 3 KV heads, head
dim 64) for ``--batch`` requests of about ``--context`` tokens on scattered blocks of a
pool, through the hook (``paged_attention_forward``) with each ``--attention`` backend:
the time of one layer's call (write + attention), median of ``--repeats`` after a
warm-up, the backends taking turns in every repeat; and the time of the step's setup
(the plan and the backend's ``prepare``, built once per step and shared by every
layer). Flex's first call (its compile) is timed separately. Each backend's output is
compared with SDPA on contiguous K/V. It is a script, not a test;
``scripts/gpu_check.py``'s kernel stage runs the same case.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from harness.dtypes import DTYPES
from harness.kv_layout import KVLayout
from harness.parsing import OneLineParser, fail, int_in, run_interruptible, thread_count
from harness.runtime.attention_backends import ATTENTION_BACKENDS, AttentionBackendError
from harness.runtime.kv_pool import PagedKVPool
from harness.runtime.paged_attention import paged_attention_forward
from harness.runtime.step_batch import RequestSlice, StepMetadata
from impl import AppendedSlots
from spec import MAX_BLOCK_SIZE, RequestBlockTable, blocks_for_tokens, slot_index

PROG = "python -m harness.bench.attention"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


class _AttentionModule:
    """What the attention function reads off HF's attention module: one layer, GQA 9/3."""

    layer_idx = 0
    num_key_value_groups = NUM_HEADS // NUM_KV_HEADS


@dataclass(slots=True)
class DecodeCase:
    """A decode step's inputs: request ``i`` holds ``context - i`` tokens on scattered
    blocks (most last blocks partly filled), one query each, random K/V in the pool."""

    pool: PagedKVPool
    tables: list[RequestBlockTable]
    query: torch.Tensor  # [1, NUM_HEADS, batch, HEAD_DIM]

    def step(self, backend: str, count: int) -> tuple[StepMetadata, Callable[[], torch.Tensor]]:
        """The first ``count`` requests' step through ``backend`` (prepared), and one layer's
        call of the hook on it, ``[1, count, NUM_HEADS, HEAD_DIM]``."""
        pool, block_size = self.pool, self.pool.block_size
        tables = self.tables[:count]
        plan = pool.plan(
            [
                AppendedSlots(
                    t.request_id,
                    t.token_count,
                    (t.block_ids,),
                    (0,),
                    ((slot_index(block_size, t.block_ids, t.token_count - 1),),),
                )
                for t in tables
            ]
        )
        # The decode token's own K/V are the ones already at its slot: the write is a no-op.
        key = pool.keys[0].view(-1, NUM_KV_HEADS, HEAD_DIM).index_select(0, plan.write_index)
        value = pool.values[0].view(-1, NUM_KV_HEADS, HEAD_DIM).index_select(0, plan.write_index)
        kernel = ATTENTION_BACKENDS[backend].prepare(pool, tables, plan)
        step = StepMetadata(pool, plan, tuple(RequestSlice(i, i + 1) for i in range(count)), kernel)
        query = self.query[:, :, :count]

        def call() -> torch.Tensor:
            output, _ = paged_attention_forward(
                _AttentionModule(),
                query,
                key.transpose(0, 1)[None],
                value.transpose(0, 1)[None],
                None,
                scaling=None,
                pagedkv_step=step,
            )
            return output

        return step, call

    def decode(self, backend: str, count: int) -> torch.Tensor:
        """The first ``count`` requests' outputs through ``backend``."""
        return self.step(backend, count)[1]()

    def contiguous(self) -> torch.Tensor:
        """SDPA per request on its K/V copied contiguous: ``[1, batch, NUM_HEADS, HEAD_DIM]``."""
        outputs = []
        flat_keys = self.pool.keys[0].view(-1, NUM_KV_HEADS, HEAD_DIM)
        flat_values = self.pool.values[0].view(-1, NUM_KV_HEADS, HEAD_DIM)
        for i, table in enumerate(self.tables):
            slots = self._slots(table, range(table.token_count))
            keys = flat_keys.index_select(0, slots).transpose(0, 1)[None].contiguous()
            values = flat_values.index_select(0, slots).transpose(0, 1)[None].contiguous()
            output = torch.nn.functional.scaled_dot_product_attention(
                self.query[:, :, i : i + 1], keys, values, enable_gqa=True
            )
            outputs.append(output.transpose(1, 2))
        return torch.cat(outputs, dim=1)

    def poison_tails(self, value: float) -> None:
        """Fill every row past each request's tokens in its last block with ``value``."""
        block_size = self.pool.block_size
        for table in self.tables:
            end = len(table.block_ids) * block_size
            slots = self._slots(table, range(table.token_count, end))
            self.pool.keys[0].view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = value
            self.pool.values[0].view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = value

    def _slots(self, table: RequestBlockTable, positions: range) -> torch.Tensor:
        block_size = self.pool.block_size
        slots = [slot_index(block_size, table.block_ids, p) for p in positions]
        return torch.tensor(slots, dtype=torch.int64, device=self.query.device)


def decode_case(
    device: torch.device, dtype: torch.dtype, batch: int, context: int, block_size: int
) -> DecodeCase:
    """A seeded ``DecodeCase`` (the seed is ``batch * context``)."""
    blocks_each = blocks_for_tokens(block_size, context)
    pool = PagedKVPool(
        KVLayout(1, NUM_KV_HEADS, HEAD_DIM, dtype, device), batch * blocks_each, block_size
    )
    generator = torch.Generator().manual_seed(batch * context)
    # Scattered tables: a seeded permutation of the pool's blocks.
    order = torch.randperm(batch * blocks_each, generator=generator).tolist()
    tables = [
        RequestBlockTable(
            f"r{i}", tuple(order[i * blocks_each : (i + 1) * blocks_each]), context - i
        )
        for i in range(batch)
    ]
    for rows in (pool.keys[0], pool.values[0]):  # [total_blocks, block_size, 3, 64]
        rows.copy_(torch.randn(rows.shape, generator=generator).to(dtype))
    query = torch.randn(1, NUM_HEADS, batch, HEAD_DIM, generator=generator)
    return DecodeCase(pool, tables, query.to(device=device, dtype=dtype))


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options."""
    parser = OneLineParser(prog=PROG, description=__doc__)
    parser.add_argument("--batch", type=int_in(1), default=8)
    parser.add_argument("--context", type=int, default=256, help="tokens of request 0")
    parser.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE), default=16)
    parser.add_argument("--repeats", type=int_in(1), default=200)
    parser.add_argument(
        "--threads", type=thread_count, default=1, help="torch CPU threads (default 1)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--attention",
        default="gather,varlen-emulated,flex",
        help="comma-separated backends (default gather,varlen-emulated,flex)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Time every backend and print one table."""
    args = build_parser().parse_args(argv)
    names = args.attention.split(",")
    unknown = [name for name in names if name not in ATTENTION_BACKENDS]
    if unknown:
        return fail(PROG, f"--attention: unknown backends {unknown}")
    if args.context <= args.batch:
        return fail(PROG, f"--context must be > --batch, got {args.context} <= {args.batch}")
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    case = decode_case(device, dtype, args.batch, args.context, args.block_size)
    try:
        for name in names:
            ATTENTION_BACKENDS[name].check(_NoModel(), case.pool.layout, args.block_size)
    except AttentionBackendError as error:
        return fail(PROG, str(error))
    print(
        f"decode attention, one layer: batch {args.batch}, contexts {args.context}.."
        f"{args.context - args.batch + 1} tokens, block size {args.block_size}, heads "
        f"{NUM_HEADS}/{NUM_KV_HEADS} x {HEAD_DIM}, {args.dtype} on {args.device}, threads "
        f"{torch.get_num_threads()}, median of {args.repeats}"
    )
    reference = case.contiguous()
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    with torch.no_grad():
        for name in names:
            started = time.perf_counter()
            _, call = case.step(name, args.batch)
            difference = float((call().float() - reference.float()).abs().max())
            first = time.perf_counter() - started
            print(
                f"{name:<16} first call {1000 * first:9.1f} ms; max |diff| vs SDPA {difference:.3g}"
            )
            calls[name] = call
        timings: dict[str, list[float]] = {name: [] for name in names}
        prepares: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                timings[name].append(timed(calls[name], device))
                prepares[name].append(timed(partial(case.step, name, args.batch), device))
    print(f"{'attention':<16} {'ms/call':>8} {'ms/step setup':>14}")
    for name in names:
        print(
            f"{name:<16} {1000 * statistics.median(timings[name]):>8.3f} "
            f"{1000 * statistics.median(prepares[name]):>14.3f}"
        )
    return 0


class _NoModel:
    """A stand-in model for the backends' checks: a config with no window or softcap."""

    config = object()


def timed(call: Callable[[], object], device: torch.device) -> float:
    """Seconds ``call`` takes; on CUDA between two synchronizations (kernels are async:
    without them the clock would measure launches, not work)."""
    synchronize(device)
    started = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - started


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(run_interruptible(PROG, main))
