"""Kernel backends end to end on the tiny model, and what each refuses (without a GPU).

``varlen-emulated`` runs the engine's whole data path but the CUDA call: it must keep the
allocator gate bitwise (paged pool vs contiguous buffers read as pages, the same backend
on both), agree with gather, and still catch the planted allocator and engine bugs of
``tests/support/harness_cases.py``. (``flex``: ``test_flex_paged.py``.)
"""

from dataclasses import replace
from pathlib import Path

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
    VARLEN,
    VARLEN_EMULATED,
    AttentionBackend,
    AttentionBackendError,
    LayerAgreement,
    unsupported_by_kernels,
)
from harness.runtime.contiguous_kv import ContiguousKVBuffers
from harness.runtime.kv_pool import PagedKVPool, PoisonedKVPool
from impl import KVCacheManager
from tests.support.harness_cases import (
    EarlyReleaseEngine,
    SwappedBlockManager,
    make_requests,
    paged_and_contiguous,
    pool_layout,
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


def test_the_gate_stays_bitwise_with_the_emulator_on_both_sides() -> None:
    assert _gate_failures(VARLEN_EMULATED) == []


def test_the_emulator_gate_catches_a_corrupted_block_table() -> None:
    assert len(_gate_failures(VARLEN_EMULATED, SwappedBlockManager)) == 4


def test_the_emulator_emits_gathers_tokens_and_reports_its_agreement_per_layer() -> None:
    requests = make_requests(5, max_new_tokens=8, arrival_gap=1)
    gathered = run(requests, PagedKVPool(pool_layout(), 48, 4), KVCacheManager(48, 4))
    agreement = LayerAgreement()
    emulated = run(
        requests,
        PagedKVPool(pool_layout(), 48, 4),
        KVCacheManager(48, 4),
        attention=replace(VARLEN_EMULATED, agreement=agreement),
    )
    for request in requests:
        ours = emulated.outputs[request.request_id]
        theirs = gathered.outputs[request.request_id]
        assert ours.token_ids == theirs.token_ids
    layers = tiny_model().model.config.num_hidden_layers
    assert sorted(agreement.max_abs_diff) == list(range(layers))
    assert max(agreement.max_abs_diff.values()) < 1e-5


def test_the_emulator_still_shows_a_use_after_free_on_a_poisoned_pool() -> None:
    requests = make_requests(6, max_new_tokens=8, arrival_gap=1)
    block_size = 64  # one block per request: the stale table always covers the next token
    buggy = EarlyReleaseEngine(
        tiny_model().model,
        KVCacheManager(64, block_size),
        PoisonedKVPool(pool_layout(), 64, block_size),
        None,
        attention=VARLEN_EMULATED,
    ).run(requests)
    correct = run(
        requests,
        ContiguousKVBuffers(pool_layout(), 64, block_size),
        KVCacheManager(64, block_size),
        attention=VARLEN_EMULATED,
    )
    ruined = [
        r.request_id
        for r in requests
        if buggy.outputs[r.request_id].token_ids != correct.outputs[r.request_id].token_ids
    ]
    assert len(ruined) == len(requests), ruined


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
    for backend in (GATHER, VARLEN_EMULATED, FLEX):
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
