"""Kernel backends end to end on the tiny model, and what each refuses (without a GPU).

``varlen-emulated`` runs the engine's whole data path but the CUDA call, and ``triton``
runs the project's Triton kernel in Triton's interpreter: each must keep the allocator
gate bitwise (paged pool vs contiguous buffers read as pages, the same backend on both),
agree with gather, and still catch the planted allocator and engine bugs of
``tests/support/harness_cases.py``. (``flex``: ``test_flex_paged.py``; the Triton kernel
alone and its planted bugs: ``test_triton_paged.py``.)
"""

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import MistralConfig

from harness.bench.decode import main as decode_main
from harness.cli.main import main
from harness.kv_layout import KVLayout
from harness.oracle.checks import check_gate
from harness.runtime.attention_backends import (
    FLEX,
    GATHER,
    TRITON,
    VARLEN,
    VARLEN_EMULATED,
    AttentionBackend,
    AttentionBackendError,
    KernelStep,
    LayerAgreement,
    PagedKernel,
    PagedStore,
    unsupported_by_kernels,
)
from harness.runtime.contiguous_kv import ContiguousKVBuffers
from harness.runtime.engine import Engine
from harness.runtime.kv_pool import PagedKVPool, PoisonedKVPool
from harness.runtime.kv_store import KVPlan, KVStore
from harness.runtime.requests import Request
from harness.runtime.scheduler import Scheduling
from impl import KVCacheManager
from spec import RequestBlockTable
from tests.support.harness_cases import (
    EarlyReleaseEngine,
    SwappedBlockManager,
    make_requests,
    paged_and_contiguous,
    pool_layout,
    repeating_requests,
    run,
    save_model_directory,
    tiny_model,
    trace,
)

CPU = torch.device("cpu")


def _gate_failures(
    attention: AttentionBackend, manager_type: type[KVCacheManager] = KVCacheManager
) -> list[str]:
    requests = make_requests(4, max_new_tokens=8, arrival_gap=1)
    paged, contiguous = paged_and_contiguous(
        requests,
        manager_type=manager_type,
        total_blocks=40,
        block_size=4,
        attention=attention,
    )
    checks = [
        check_gate(r.request_id, trace(paged, r.request_id), trace(contiguous, r.request_id))
        for r in requests
    ]
    return [check.detail for check in checks if not check.passed]


KERNELS = pytest.mark.parametrize("kernel", [VARLEN_EMULATED, TRITON], ids=lambda k: k.name)


@KERNELS
def test_the_gate_stays_bitwise_with_the_kernel_on_both_sides(kernel: PagedKernel) -> None:
    assert _gate_failures(kernel) == []


@KERNELS
def test_the_kernel_gate_catches_a_corrupted_block_table(kernel: PagedKernel) -> None:
    assert len(_gate_failures(kernel, SwappedBlockManager)) == 4


@KERNELS
def test_the_kernel_emits_gathers_tokens_and_reports_its_agreement_per_layer(
    kernel: PagedKernel,
) -> None:
    requests = make_requests(5, max_new_tokens=8, arrival_gap=1)
    gathered = run(requests, PagedKVPool(pool_layout(), 48, 4), KVCacheManager(48, 4))
    agreement = LayerAgreement()
    emulated = run(
        requests,
        PagedKVPool(pool_layout(), 48, 4),
        KVCacheManager(48, 4),
        attention=replace(kernel, agreement=agreement),
    )
    for request in requests:
        ours = emulated.outputs[request.request_id]
        theirs = gathered.outputs[request.request_id]
        assert ours.token_ids == theirs.token_ids
    layers = tiny_model().model.config.num_hidden_layers
    assert sorted(agreement.max_abs_diff) == list(range(layers))
    assert max(agreement.max_abs_diff.values()) < 1e-5


@KERNELS
# The point: the kernel reads a poisoned (NaN) block, which Triton's interpreter remarks on.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_the_kernel_still_shows_a_use_after_free_on_a_poisoned_pool(kernel: PagedKernel) -> None:
    requests = make_requests(6, max_new_tokens=8, arrival_gap=1)
    block_size = 64  # one block per request: the stale table always covers the next token
    buggy = EarlyReleaseEngine(
        tiny_model().model,
        KVCacheManager(64, block_size),
        PoisonedKVPool(pool_layout(), 64, block_size),
        None,
        attention=kernel,
    ).run(requests)
    correct = run(
        requests,
        ContiguousKVBuffers(pool_layout(), 64, block_size),
        KVCacheManager(64, block_size),
        attention=kernel,
    )
    ruined = [
        r.request_id
        for r in requests
        if buggy.outputs[r.request_id].token_ids != correct.outputs[r.request_id].token_ids
    ]
    assert len(ruined) == len(requests), ruined


class StaleTableStore:
    """A planted seam bug: the kernel's block table kept from step to step and only ever
    extended, as a device-side table that hears of appends alone would be: the block a
    fork's copy-on-write puts in place of a shared one, or that a truncate gave back and
    an append took anew, never reaches it."""

    def __init__(self, store: KVStore) -> None:
        assert isinstance(store, PagedStore)
        self._store = store
        self._kept: dict[str, list[int]] = {}

    def __getattr__(self, name: str) -> Any:  # Any: whatever the store has
        return getattr(self._store, name)

    def block_ids_of(self, table: RequestBlockTable) -> list[int]:
        ids = self._store.block_ids_of(table)
        kept = self._kept.setdefault(table.request_id, [])
        kept.extend(ids[len(kept) :])
        del kept[len(ids) :]
        return list(kept)


@dataclass(frozen=True)
class StaleTables:
    """``kernel`` reading through ``StaleTableStore``."""

    kernel: PagedKernel
    stores: dict[int, StaleTableStore] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kernel.name

    @property
    def poisoned_pool_type(self) -> type[PoisonedKVPool]:
        return self.kernel.poisoned_pool_type

    def check(self, model: Any, layout: KVLayout, block_size: int) -> None:  # Any: HF model
        self.kernel.check(model, layout, block_size)

    def prepare(
        self, store: KVStore, tables: Sequence[RequestBlockTable], plan: KVPlan
    ) -> KernelStep | None:
        stale = self.stores.setdefault(id(store), StaleTableStore(store))
        return self.kernel.prepare(stale, tables, plan)


def _forking_requests() -> list[Request]:
    return [
        replace(request, num_continuations=2)
        for request in make_requests(3, max_new_tokens=8, arrival_gap=1)
    ]


@KERNELS
def test_a_stale_block_table_after_a_fork_is_caught_by_the_gate(kernel: PagedKernel) -> None:
    requests = _forking_requests()

    def failures(backend: AttentionBackend) -> list[str]:
        paged, contiguous = paged_and_contiguous(
            requests, manager_type=KVCacheManager, total_blocks=60, block_size=4, attention=backend
        )
        return [
            request_id
            for request_id in paged.outputs
            if not check_gate(
                request_id, trace(paged, request_id), trace(contiguous, request_id)
            ).passed
        ]

    assert failures(kernel) == []
    assert failures(StaleTables(kernel)) != []


@KERNELS
def test_a_stale_block_table_after_a_truncate_changes_the_tokens(kernel: PagedKernel) -> None:
    requests = repeating_requests(4, 16)

    def tokens(backend: AttentionBackend) -> dict[str, tuple[int, ...]]:
        total_blocks = sum(request.blocks_needed(4) for request in requests) + 4
        engine = Engine(
            tiny_model().model,
            KVCacheManager(total_blocks, 4),
            PagedKVPool(pool_layout(), total_blocks, 4),
            None,
            scheduling=Scheduling(speculate=4),
            attention=backend,
        )
        result = engine.run(requests)
        return {key: tuple(output.token_ids) for key, output in result.outputs.items()}

    plain = tokens(GATHER)
    assert tokens(kernel) == plain
    assert tokens(StaleTables(kernel)) != plain


# -- refusals --------------------------------------------------------------------------


def _layout(dtype: torch.dtype = torch.bfloat16, head_dim: int = 64) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=head_dim, dtype=dtype, device=CPU)


def test_varlen_refuses_a_cpu_pool_fp32_and_a_block_size_off_256_in_one_line() -> None:
    with pytest.raises(AttentionBackendError) as refused:
        VARLEN.check(tiny_model().model, _layout(torch.float32, head_dim=12), 16)
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        "--attention varlen cannot run this: it needs a CUDA device, the pool is on cpu; "
        "it needs float16 or bfloat16, got float32; block size 16 is not a multiple of 256; "
        "head_dim 12 is not a multiple of 8 up to 256"
    )


def test_flex_refuses_a_cuda_pool_in_one_line() -> None:
    """On CUDA the mask's query block size of 1 fails inductor's FlexAttention lowering
    (torch 2.11 on an H200, 2026-12-04): refused before a compile error."""
    cuda = replace(_layout(), device=torch.device("cuda"))
    with pytest.raises(AttentionBackendError) as refused:
        FLEX.check(tiny_model().model, cuda, 16)
    assert str(refused.value) == (
        "--attention flex cannot run this: its mask has one query per row, and "
        "FlexAttention on CUDA needs a query block size divisible by its tile (16 or more); "
        "use gather"
    )


def test_the_cpu_backends_accept_the_tiny_model() -> None:
    for backend in (GATHER, VARLEN_EMULATED, FLEX, TRITON):
        backend.check(tiny_model().model, _layout(torch.float32), 16)


def test_kernel_backends_refuse_a_sliding_window_and_softcapping() -> None:
    config = MistralConfig(sliding_window=64)
    config.attn_logit_softcapping = 50.0
    assert unsupported_by_kernels(config) == ["sliding_window=64", "attn_logit_softcapping=50.0"]
    assert unsupported_by_kernels(tiny_model().model.config) == []


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama as a model directory the command line can load."""
    return save_model_directory(tiny_model().model, tmp_path_factory.mktemp("tiny"))


def test_the_command_refuses_varlen_on_cpu_with_exit_2(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "cpu", "--model", str(tiny_dir), "--attention", "varlen"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("python -m harness: error: --attention varlen cannot run this: ")
    assert "it needs a CUDA device, the pool is on cpu" in error


def test_the_decode_benchmark_refuses_varlen_on_cpu_with_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert decode_main(["--tiny", "--attention", "varlen", "--batch-sizes", "1"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert "--attention varlen cannot run this: it needs a CUDA device" in error


def test_varlen_refuses_a_torch_whose_varlen_attn_takes_no_block_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's ``varlen_attn`` (the H200 of 2026-12-04) has no ``block_table``."""
    import torch.nn.attention.varlen as varlen_module  # noqa: PLC0415

    def varlen_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        raise AssertionError("never called: refused first")

    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_attn)
    with pytest.raises(AttentionBackendError) as refused:
        VARLEN.check(tiny_model().model, _layout(), 256)
    assert str(refused.value) == (
        "--attention varlen cannot run this: "
        f"torch {torch.__version__} has no varlen_attn taking a block_table; "
        "it needs a CUDA device, the pool is on cpu"
    )


def test_triton_in_the_interpreter_refuses_bfloat16_and_a_cuda_pool_in_one_line() -> None:
    """The test process runs Triton's interpreter (tests/conftest.py)."""
    with pytest.raises(AttentionBackendError) as refused:
        TRITON.check(tiny_model().model, _layout(torch.bfloat16), 16)
    assert str(refused.value) == (
        "--attention triton cannot run this: "
        "Triton's interpreter computes float32 only (triton#11584), got bfloat16"
    )
    cuda = replace(_layout(torch.float32), device=torch.device("cuda"))
    with pytest.raises(AttentionBackendError) as refused:
        TRITON.check(tiny_model().model, cuda, 16)
    assert str(refused.value) == (
        "--attention triton cannot run this: "
        "TRITON_INTERPRET=1 runs Triton's interpreter, which cannot read a cuda pool"
    )


def test_triton_on_cpu_without_the_interpreter_is_refused_in_one_line() -> None:
    """A process that imported triton without TRITON_INTERPRET=1 compiles for a GPU."""
    probe = (
        "import torch; from harness.kv_layout import KVLayout; "
        "from harness.runtime.attention_backends import TRITON; "
        "layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, "
        "device=torch.device('cpu')); print(TRITON.limits(layout, 16))"
    )
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=environment,
    )
    assert done.stdout == (
        "[\"on CPU it runs in Triton's interpreter, which this process did not start "
        '(set TRITON_INTERPRET=1 before starting it)"]\n'
    )


def test_the_command_runs_the_triton_kernel_on_cpu(tiny_dir: Path, tmp_path: Path) -> None:
    # A fresh process without TRITON_INTERPRET: the command turns the interpreter on before
    # anything imports triton. Three short prompts with a shared start: the interpreter runs
    # each program in Python, and the 14 built-in prompts take minutes in it.
    prompts = tmp_path / "prompts.jsonl"
    texts = ["a b c d e f g h i j", "a b c d e f g h k l m", "a b c d x y"]
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
    argv = ["--device", "cpu", "--model", str(tiny_dir), "--attention", "triton", "--json"]
    options = ["--prompts-file", str(prompts), "--max-new-tokens", "6", "--poison-freed"]
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "harness", *argv, *options],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env=environment,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["passed"] is True and report["attention"] == "triton"
    assert len(report["attention_agreement_max_abs_diff"]) > 0
