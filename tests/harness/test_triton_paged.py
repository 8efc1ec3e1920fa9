"""The Triton paged-attention kernel (``--attention triton``) in Triton's interpreter.

Its arithmetic against the varlen emulator (the reference of the same contract, every
score materialised), the bits it must not change (where a request's blocks lie, who its
batch neighbours are), the pool's NaN poison it must not read, and the planted kernel bugs
those checks catch: each a one-line edit of the kernel's own source, compiled the same way.
"""

import importlib.util
import inspect
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from harness.runtime import triton_paged
from harness.runtime.step_tensors import PAD_BLOCK_ID, StepTensors, build_step_tensors
from harness.runtime.triton_paged import triton_paged_attention
from harness.runtime.varlen_emulator import varlen_attention_emulated
from spec import blocks_for_tokens

CPU = torch.device("cpu")
# Guard blocks around the pool, NaN like every block no request holds: a kernel that
# addresses a block just outside the pool (a padding entry of -1, one block too far) reads
# NaN there instead of memory the test does not own (the interpreter checks no bounds).
GUARD = 2


@dataclass(frozen=True)
class Step:
    """One packed step over a poisoned pool: the queries, the pages and the step tensors."""

    query: torch.Tensor  # [T, num_heads, head_dim]
    pages: tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, kv_heads, head_dim]
    tensors: StepTensors
    token_counts: list[int]
    new_token_counts: list[int]
    block_ids: list[list[int]]

    def rows(self, request: int) -> slice:
        """The request's rows of the packed queries and outputs."""
        start = sum(self.new_token_counts[:request])
        return slice(start, start + self.new_token_counts[request])


def make_step(
    token_counts: list[int],
    new_token_counts: list[int],
    *,
    block_size: int,
    num_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 12,
    contiguous: bool = False,
    seed: int = 0,
) -> Step:
    """Requests holding ``token_counts`` tokens, feeding their last ``new_token_counts``;
    their blocks scattered over a pool (or laid end to end with ``contiguous``); every
    block no request holds, and every row past a request's last token, NaN."""
    generator = torch.Generator().manual_seed(seed)
    needed = [blocks_for_tokens(block_size, count) for count in token_counts]
    num_blocks = sum(needed) + 5
    shape = (num_blocks + 2 * GUARD, block_size, num_kv_heads, head_dim)
    keys = torch.full(shape, float("nan"))
    values = torch.full(shape, float("nan"))
    order = (
        list(range(num_blocks))
        if contiguous
        else torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    )
    block_ids: list[list[int]] = []
    for count, blocks in zip(token_counts, needed, strict=True):
        ids, order = order[:blocks], order[blocks:]
        block_ids.append(ids)
        rows = torch.randn(count, num_kv_heads, head_dim, generator=generator)
        more = torch.randn(count, num_kv_heads, head_dim, generator=generator)
        for position in range(count):
            block = GUARD + ids[position // block_size]
            keys[block, position % block_size] = rows[position]
            values[block, position % block_size] = more[position]
    query = torch.randn(sum(new_token_counts), num_heads, head_dim, generator=generator)
    pages = (keys[GUARD:-GUARD], values[GUARD:-GUARD])
    tensors = build_step_tensors(block_ids, token_counts, new_token_counts, block_size, CPU)
    # The table as a view into one with a guard column and a guard row of -1, so that an
    # entry read one past a row's end (or past the last row) is a -1 the test owns.
    height, width = tensors.block_table.shape
    guarded = torch.full((height + 1, width + 1), PAD_BLOCK_ID, dtype=torch.int32)
    guarded[:height, :width] = tensors.block_table
    tensors = replace(tensors, block_table=guarded[:height, :width])
    return Step(query, pages, tensors, token_counts, new_token_counts, block_ids)


SCALE = 0.3
# (tokens held, tokens fed) per request: decodes, a whole prefill, prefill chunks, mixed.
STEPS = {
    "decodes": ([9, 1, 40, 5], [1, 1, 1, 1]),
    "a prefill": ([23], [23]),
    "chunks": ([30, 17], [12, 5]),
    "mixed": ([9, 1, 17, 5, 64], [3, 1, 17, 1, 20]),
}


def kernel_output(step: Step, kernel: Any = None) -> torch.Tensor:  # Any: a Triton function
    """The kernel's output for the step (``kernel``: a planted copy, else the real one)."""
    if kernel is None:
        return triton_paged_attention(step.query, step.pages, step.tensors, SCALE, None)
    return triton_paged_attention(step.query, step.pages, step.tensors, SCALE, None, kernel=kernel)


@pytest.mark.parametrize("block_size", [4, 6, 16])
@pytest.mark.parametrize("name", STEPS)
def test_the_kernel_agrees_with_the_emulator_and_reads_no_poison(
    name: str, block_size: int
) -> None:
    step = make_step(*STEPS[name], block_size=block_size)
    ours = kernel_output(step)
    reference = varlen_attention_emulated(step.query, *step.pages, step.tensors, SCALE)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 1), (12, 3)])
def test_every_query_head_group_agrees_with_the_emulator(num_heads: int, num_kv_heads: int) -> None:
    step = make_step(
        *STEPS["mixed"], block_size=8, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16
    )
    reference = varlen_attention_emulated(step.query, *step.pages, step.tensors, SCALE)
    torch.testing.assert_close(kernel_output(step), reference, rtol=1e-5, atol=1e-5)


def test_a_transposed_query_view_is_read_in_place_with_the_same_bits() -> None:
    # The attention hook hands the kernel query[0].transpose(0, 1) of a [1, H, T, D] tensor.
    step = make_step(*STEPS["mixed"], block_size=4)
    heads_first = step.query.transpose(0, 1).contiguous()  # [H, T, D]
    view = heads_first.transpose(0, 1)  # [T, H, D], strides (D, T * D, 1)
    assert not view.is_contiguous()
    ours = triton_paged_attention(view, step.pages, step.tensors, SCALE, None)
    assert ours.is_contiguous() and torch.equal(ours, kernel_output(step))


def test_where_the_blocks_lie_changes_no_bit() -> None:
    scattered = make_step(*STEPS["mixed"], block_size=4)
    contiguous = make_step(*STEPS["mixed"], block_size=4, contiguous=True)
    assert torch.equal(scattered.query, contiguous.query)
    assert torch.equal(kernel_output(scattered), kernel_output(contiguous))


def test_a_request_alone_gets_the_bits_it_gets_among_neighbours() -> None:
    step = make_step(*STEPS["mixed"], block_size=4)
    together = kernel_output(step)
    for request in range(len(step.token_counts)):
        rows = step.rows(request)
        alone = triton_paged_attention(
            step.query[rows],
            step.pages,
            build_step_tensors(
                [step.block_ids[request]],
                [step.token_counts[request]],
                [step.new_token_counts[request]],
                step.tensors.block_size,
                CPU,
            ),
            SCALE,
            None,
        )
        assert torch.equal(alone, together[rows]), request


# -- planted kernel bugs -----------------------------------------------------------------


def _checks(kernel: Any) -> Iterator[str]:  # Any: a Triton function
    """The failures of the tests above on ``kernel``; empty for a correct kernel."""
    for name, counts in STEPS.items():
        step = make_step(*counts, block_size=4)
        ours = kernel_output(step, kernel)
        reference = varlen_attention_emulated(step.query, *step.pages, step.tensors, SCALE)
        if ours.isnan().any():
            yield f"{name}: NaN (poison read)"
        elif not torch.allclose(ours, reference, rtol=1e-5, atol=1e-5):
            yield f"{name}: differs from the emulator"


# (what the bug is, the line of the kernel it edits, the line it becomes)
PLANTED_KERNEL_BUGS = {
    "an off-by-one block index": (
        "block_table_ptr + request * table_stride + keys // BLOCK_SIZE,",
        "block_table_ptr + request * table_stride + keys // BLOCK_SIZE + 1,",
    ),
    "the wrong KV head for a query head": (
        "head = kv_head * GROUP + rows % GROUP_P",
        "head = (rows % GROUP_P) * tl.num_programs(1) + kv_head",
    ),
    "no causal mask inside a prefill chunk": (
        "visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= position[:, None])",
        "visible = row_ok[:, None] & key_ok[None, :]",
    ),
    "a read one slot past the sequence's end": (
        "key_ok = keys < key_end",
        "key_ok = keys <= key_end",
    ),
}


def _planted_kernel(tmp_path: Path, old: str, new: str) -> Any:  # Any: a Triton function
    """The kernel module with ``old`` (a line found exactly once) replaced by ``new``,
    loaded from a file (Triton reads a kernel's source back from its file)."""
    source = inspect.getsource(triton_paged)
    assert source.count(old) == 1, f"the kernel no longer has the line {old!r}"
    path = tmp_path / "planted_triton_paged.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location("planted_triton_paged", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.paged_attention_kernel


def test_the_real_kernel_passes_the_checks_the_planted_bugs_fail() -> None:
    assert list(_checks(triton_paged.paged_attention_kernel)) == []


@pytest.mark.parametrize("bug", PLANTED_KERNEL_BUGS)
def test_each_planted_kernel_bug_is_caught(bug: str, tmp_path: Path) -> None:
    kernel = _planted_kernel(tmp_path, *PLANTED_KERNEL_BUGS[bug])
    assert list(_checks(kernel)) != [], bug


# -- the same kernel through Triton's compiler, for NVIDIA GPUs ---------------------------


def _without_the_interpreter(*argv: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=600, env=environment,
        check=False,
    )  # fmt: skip


def test_the_kernel_compiles_for_a100_and_h100_in_every_dtype() -> None:
    done = _without_the_interpreter("-m", "tests.support.triton_cuda_compile")
    assert done.returncode == 0, done.stdout + done.stderr
    builds = done.stdout.splitlines()
    assert [line.split(":")[0] for line in builds] == [
        f"sm_{capability} {dtype}" for capability in (80, 90) for dtype in ("fp32", "bf16", "fp16")
    ]


def test_the_compile_check_catches_what_the_interpreter_runs(tmp_path: Path) -> None:
    # Planted: an annotation naming a module global, which the interpreter ignores and
    # Triton's compiler cannot resolve inside a kernel (the first version had one).
    _planted_kernel(tmp_path, "    out_ptr: tl.tensor,\n", "    out_ptr: Any,\n")
    probe = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
        "from planted_triton_paged import paged_attention_kernel as kernel; "
        "from tests.support.triton_cuda_compile import build; build('bf16', 90, kernel)"
    )
    done = _without_the_interpreter("-c", probe)
    assert done.returncode != 0
    assert "Cannot access global variable Any" in done.stderr
