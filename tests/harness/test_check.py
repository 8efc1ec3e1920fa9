"""``harness.check_model``: the three checks on a model as the caller loaded it."""

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import harness
import harness.oracle.equivalence
from harness.check import CheckSettingsError, prompt_ids
from harness.cli.parsing import UsageError
from harness.kv_layout import KVLayout
from impl import KVCacheManager
from impl.prefix_cache import EventSink
from tests.support.harness_cases import SwappedBlockManager, save_model_directory, tiny_model

TOKEN_PROMPTS = [[5, 9, 13, 2, 7, 30, 31], [40, 41, 42], [5, 9, 13, 2, 7, 30, 31, 8, 8]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_directory(tiny_model().model, tmp_path_factory.mktemp("tiny"))


def test_the_package_exports_check_model_and_its_report() -> None:
    from harness.check import check_model  # noqa: PLC0415
    from harness.oracle.equivalence import EquivalenceReport  # noqa: PLC0415

    assert harness.check_model is check_model
    assert harness.EquivalenceReport is EquivalenceReport
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = harness.nothing


def test_token_id_prompts_pass_the_three_checks_without_a_tokenizer() -> None:
    report = harness.check_model(
        tiny_model().model, None, TOKEN_PROMPTS, max_new_tokens=6, block_size=4
    )
    assert report.passed, report.summary()
    assert report.failures == []
    assert [row.request_id for row in report.rows] == ["r00", "r01", "r02"]
    assert [row.prompt_tokens for row in report.rows] == [7, 3, 9]
    assert report.summary().endswith("RESULT: PASS")
    assert "passing all three checks: 3/3" in report.summary()
    # The CLI's default pool: a quarter of what the requests need at once, at least one.
    assert report.pool.total_blocks == max(4, -(-(4 + 3 + 4) // 4))
    assert report.prefix_hit_tokens > 0  # prefix caching is on by default


def test_a_corrupted_block_table_fails_with_one_line_per_failed_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def swapped(
        layout: KVLayout,
        total_blocks: int,
        block_size: int,
        *,
        event_sink: EventSink | None = None,
        **host_tier: object,
    ) -> KVCacheManager:
        return SwappedBlockManager(total_blocks, block_size, event_sink=event_sink)

    monkeypatch.setattr(harness.oracle.equivalence, "new_manager", swapped)
    report = harness.check_model(
        tiny_model().model, None, TOKEN_PROMPTS, max_new_tokens=6, block_size=4
    )
    assert not report.passed
    assert report.failures
    assert all(line.split(":")[0] in ("gate", "alone", "batch") for line in report.failures)
    assert any(line.startswith("gate: r00: step ") for line in report.failures)
    assert "paged token" in report.failures[0] and "margin" in report.failures[0]
    assert report.summary().endswith("RESULT: FAIL")
    assert all(f"  {line}" in report.summary() for line in report.failures)


def test_text_and_chat_prompts_go_through_the_chat_template(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    text = prompt_ids(tokenizer, "a b c")
    chat = prompt_ids(tokenizer, [{"role": "user", "content": "a b c"}])
    assert text == chat == (1, 2, 3)
    assert prompt_ids(None, [4, 5]) == (4, 5)


def test_a_model_loaded_from_a_directory_passes_with_text_prompts(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    report = harness.check_model(model, tokenizer, ["a b c d e", "f g"], max_new_tokens=4)
    assert report.passed, report.summary()
    assert report.model_name == str(tiny_dir)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"arrival_gap": -1}, "arrival_gap must be >= 0, got -1"),
        ({"speculate": 0}, "speculate must be >= 1, got 0"),
        ({"attention": "fast"}, "attention 'fast' is not one of"),
    ],
)
def test_bad_settings_are_refused_before_any_generation(
    settings: dict[str, int | str], message: str
) -> None:
    with pytest.raises(CheckSettingsError, match=message):
        harness.check_model(tiny_model().model, None, TOKEN_PROMPTS, **settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([], "no prompts to check"),
        ([[]], "a token-id prompt needs at least one token"),
        (["a b"], "text and chat prompts need a tokenizer"),
        ([[1, "a"]], "a prompt is a string, a list of chat messages or a list of token ids"),
    ],
)
def test_bad_prompts_are_refused(prompts: list[harness.Prompt], message: str) -> None:
    with pytest.raises(CheckSettingsError, match=message):
        harness.check_model(tiny_model().model, None, prompts)


def test_a_pool_too_small_for_one_request_is_refused() -> None:
    with pytest.raises(UsageError, match="cannot hold even one request"):
        harness.check_model(tiny_model().model, None, TOKEN_PROMPTS, total_blocks=1)
