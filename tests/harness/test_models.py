"""The bundled SmolLM2 through the real loading path (marked ``model``; runs in CI)."""

import json
from pathlib import Path

import pytest
import torch

from harness.cli.main import main
from harness.models import find_bundled_gguf, get_cache_dir, kv_layout, load_model, publish_cache
from harness.prompts import render_prompt
from harness.runtime.paged_cache import PagedCache
from impl import KVCacheManager
from tests.support.harness_cases import poisoned_pool

pytestmark = pytest.mark.model

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_bundled_gguf_is_found_through_the_distribution() -> None:
    path = find_bundled_gguf()
    assert path.suffix == ".gguf"
    assert path.is_file()


def test_the_safetensors_cache_reloads_bit_identical_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    assert get_cache_dir() == tmp_path
    from_gguf = load_model(None, CPU, torch.float32)
    (cached,) = tmp_path.iterdir()
    assert (cached / "model.safetensors").is_file()
    from_cache = load_model(None, CPU, torch.float32)
    input_ids = torch.tensor([[1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47]])
    with torch.no_grad():
        expected = from_gguf.model(input_ids).logits
        actual = from_cache.model(input_ids).logits
    assert torch.equal(expected, actual)


def _filled(directory: Path, weights: bytes) -> Path:
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(weights)
    return directory


def test_a_cache_filled_by_another_process_first_is_kept_and_ours_removed(
    tmp_path: Path,
) -> None:
    cached = _filled(tmp_path / "model", b"theirs")
    ours = _filled(tmp_path / "model.partial-123", b"ours")
    publish_cache(ours, cached)
    assert [path.name for path in tmp_path.iterdir()] == ["model"]
    assert (cached / "model.safetensors").read_bytes() == b"theirs"
    # With no cache there yet, ours is renamed into place.
    fresh = _filled(tmp_path / "other.partial-7", b"ours")
    publish_cache(fresh, tmp_path / "other")
    assert (tmp_path / "other" / "model.safetensors").read_bytes() == b"ours"
    assert not fresh.exists()


def test_a_cache_rename_that_fails_with_no_finished_cache_raises(tmp_path: Path) -> None:
    # Something that is not a finished cache blocks the name: the error is not hidden.
    blocked = tmp_path / "model"
    blocked.mkdir()
    (blocked / "stray").write_text("x")
    with pytest.raises(OSError):
        publish_cache(_filled(tmp_path / "model.partial-1", b"ours"), blocked)


def test_a_bf16_model_is_loaded_as_hf_loads_it_with_float32_rotary_frequencies() -> None:
    float32 = load_model(None, CPU, torch.float32).model
    bfloat16 = load_model(None, CPU, torch.bfloat16).model
    assert next(bfloat16.parameters()).dtype == torch.bfloat16
    # A cast after loading would round these to bf16 (up to 1.4e-3 per frequency).
    inv_freq = bfloat16.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, float32.model.rotary_emb.inv_freq)


def test_the_main_command_passes_all_checks_on_a_few_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "What is the capital of France?"},
        {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
        {"prompt": "Summarize: " + "paged attention stores keys in blocks. " * 20},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["--device", "cpu", "--prompts-file", str(prompts), "--max-new-tokens", "16"]
    threads = torch.get_num_threads()
    try:
        # One thread: the per-request attention is many small ops, which two threads on a
        # busy CI machine slow down several times.
        exit_code = main([*argv, "--block-size", "8", "--poison-freed", "--threads", "1", "--json"])
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out)
    assert exit_code == 0, result
    assert result["passed"] and result["schedules_equal"]
    assert [r["alone"]["detail"] for r in result["requests"]] == ["bit-identical"] * 3
    assert result["totals"]["peak_requests"] < 3  # the tight pool made a request wait


def test_a_pool_too_small_for_one_request_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    argv = ["--device", "cpu", "--prompts-file", str(prompts), "--total-blocks", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--total-blocks 1 cannot hold even one request: r00 needs" in err
    assert "Traceback" not in err


def test_the_main_command_shares_a_system_prompt_and_checks_every_continuation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "What is the capital of France?"}, {"prompt": "Name a prime number."}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["--device", "cpu", "--prompts-file", str(prompts), "--max-new-tokens", "6"]
    system = ["--system-prompt", "You are a helpful assistant."]
    exit_code = main([*argv, *system, "--n", "2", "--block-size", "4", "--poison-freed", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert exit_code == 0, result
    assert [r["request_id"] for r in result["requests"]] == ["r00", "r00/1", "r01", "r01/1"]
    assert [r["alone"]["detail"] for r in result["requests"]] == ["bit-identical"] * 4
    totals = result["totals"]
    assert totals["prefix_hit_tokens"] > 0  # r01 reuses the system turn's blocks
    assert totals["cow_copies"] > 0
    assert totals["blocks_saved_by_sharing"] > 0
    assert set(totals) >= {"prefill_tokens", "preemptions"}


def test_generate_on_a_paged_cache_is_bit_identical_on_smollm2() -> None:
    loaded = load_model(None, CPU, torch.float32)
    assert loaded.tokenizer is not None and loaded.eos_token_id is not None
    prompts = [
        render_prompt(loaded.tokenizer, (("user", content),))
        for content in ("Name a prime number.", "Why is the sky blue? Answer in one line.")
    ]
    width = max(map(len, prompts))
    input_ids = torch.full((2, width), loaded.eos_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left-padded, as generate expects
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    pool = poisoned_pool(16, 8, kv_layout(loaded))
    kwargs = {
        "attention_mask": attention_mask,
        "max_new_tokens": 8,
        "do_sample": False,
        "pad_token_id": loaded.eos_token_id,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    with torch.no_grad(), PagedCache(KVCacheManager(16, 8), pool, 2) as cache:
        paged = loaded.model.generate(input_ids, past_key_values=cache, **kwargs)
        dense = loaded.model.generate(input_ids, **kwargs)
    assert torch.equal(paged.sequences, dense.sequences)
    for paged_logits, dense_logits in zip(paged.logits, dense.logits, strict=True):
        assert torch.equal(paged_logits, dense_logits)
