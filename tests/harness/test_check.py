"""``harness.check_model``: the three checks on a model as the caller loaded it."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import harness
import harness.check
import harness.oracle.equivalence
from harness import tiny_models
from harness.check import prompt_ids
from harness.kv_layout import KVLayout
from harness.settings import CheckSettingsError
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


@pytest.fixture
def no_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation fails the test: a refusal must come before anything runs."""

    def generate(*args: object, **kwargs: object) -> None:
        raise AssertionError("check_model started generating")

    monkeypatch.setattr(harness.check, "run_equivalence", generate)


# Issue 33, item 4: each ran, or failed with a raw error from deep inside, before the
# settings were checked up front.
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"host_blocks": 4.0}, "host_blocks must be an int or None, got float 4.0"),
        ({"salts": 1.5}, "salts must be an int or None, got float 1.5"),
        ({"max_new_tokens": True}, "max_new_tokens must be an int, got bool True"),
        (
            {"host_blocks": 8, "prefix_cache": False, "preempt": "recompute"},
            "host_blocks 8 would hold nothing",
        ),
        (
            {"host_blocks": 2**24 + 1, "block_size": 1},
            "host_blocks must be in [1, 16,777,216], got 16,777,217",
        ),
        ({"total_blocks": 0}, "total_blocks must be in [1, 16,777,216], got 0"),
        # Issue 49, item 7: ignored on a model with no recurrent state.
        (
            {"checkpoint_interval": 16},
            "checkpoint_interval 16 is for a hybrid model's recurrent state, and this model "
            "has none",
        ),
        ({"attention": "fast"}, "attention must be one of ['gather', "),
        ({"settings": {"block_size": 4}}, "settings must be a CheckSettings or None, got dict"),
        ({"block_sizes": 4}, "block_sizes is not a setting of check_model (one of ['max_new"),
        ({"name": 3}, "name must be a str or None, got int"),
        ({"progress": "stages"}, "progress must be callable or None, got str"),
        ({"observer": 1}, "observer must be callable or None, got int"),
        ({"kv_events": []}, "kv_events must be a harness.kv_events.KVEventLog or None, got list"),
    ],
)
@pytest.mark.usefixtures("no_generation")
def test_bad_settings_are_refused_naming_the_keyword_before_any_generation(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(CheckSettingsError) as refused:
        harness.check_model(tiny_model().model, None, TOKEN_PROMPTS, **settings)  # type: ignore[arg-type]
    assert str(refused.value).startswith(message)
    assert refused.value.setting == next(iter(settings))


@pytest.mark.usefixtures("no_generation")
def test_a_model_or_tokenizer_of_another_kind_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(CheckSettingsError, match=r"^model must be a transformers PreTrainedModel"):
        harness.check_model(None, None, TOKEN_PROMPTS)  # type: ignore[arg-type]
    with pytest.raises(CheckSettingsError, match=r"^tokenizer must be a transformers tokenizer"):
        harness.check_model(tiny_model().model, "x", ["a b"])


# Issue 49, item 5: a model on the meta device ran into generate and raised "Tensor.item()
# cannot be called on meta tensors" there.
@pytest.mark.parametrize("architecture", ["llama", "lfm2"])
@pytest.mark.usefixtures("no_generation")
def test_a_model_on_the_meta_device_is_refused_naming_model(architecture: str) -> None:
    with torch.device("meta"):
        model = tiny_models.tiny_model(architecture, seed=0).model
    count = len(list(model.parameters())) + len(list(model.buffers()))
    with pytest.raises(CheckSettingsError) as refused:
        harness.check_model(model, None, TOKEN_PROMPTS)
    assert refused.value.setting == "model"
    assert str(refused.value) == (
        f"model has its {count} parameters and buffers on meta ({count}, the first "
        "'model.embed_tokens.weight'): check_model runs on one device, the model's, "
        "with every value loaded (the meta device holds none: load the weights)"
    )


@pytest.mark.usefixtures("no_generation")
def test_a_model_with_one_buffer_elsewhere_is_refused_naming_both_devices() -> None:
    model = tiny_models.tiny_model("llama", seed=0).model  # its own: the shared one is cached
    rotary = model.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq.to("meta")
    count = len(list(model.parameters())) + len(list(model.buffers()))
    with pytest.raises(CheckSettingsError) as refused:
        harness.check_model(model, None, TOKEN_PROMPTS)
    assert str(refused.value).startswith(
        f"model has its {count} parameters and buffers on cpu ({count - 1}, the first "
        "'model.embed_tokens.weight') and meta (1, the first 'model.rotary_emb.inv_freq'): "
        "check_model runs on one device"
    )


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([], "prompts is empty: no prompts to check"),
        ([[]], "prompts[0]: a token-id prompt needs at least one token"),
        (["a b"], "prompts[0]: text and chat prompts need a tokenizer"),
        ([[1, "a"]], "prompts[0]: token 1 is str 'a'; token ids are ints >= 0"),
        # Issue 33, item 4: a flat list of ids raised TypeError; a string ran as prompts.
        ([1, 2, 3], "prompts[0] is int 1: a prompt is a string, a list of chat messages or"),
        ("abc", "prompts must be a list of prompts, got str 'abc'"),
        ([b"abc"], "prompts[0] is bytes b'abc': a prompt is a string"),
        # Issue 33, item 5: ids outside the vocabulary (256) ended in the embedding's
        # IndexError; booleans ran as 0 and 1.
        ([[1, 2, 256]], "prompts[0]: token 2 is 256, outside the model's vocabulary of 256 "),
        ([[5, 6], [1, -1]], "prompts[1]: token 1 is int -1; token ids are ints >= 0"),
        ([[True, 2]], "prompts[0]: token 0 is bool True; token ids are ints >= 0"),
        ([[{"role": "user"}]], "prompts[0][0]: a chat message is a mapping with string 'role'"),
        ([[{"role": "user", "content": 7}]], "prompts[0][0]: a chat message is a mapping"),
    ],
)
@pytest.mark.usefixtures("no_generation")
def test_bad_prompts_are_refused(prompts: list[harness.Prompt], message: str) -> None:
    with pytest.raises(CheckSettingsError) as refused:
        harness.check_model(tiny_model().model, None, prompts)
    assert str(refused.value).startswith(message)
    assert refused.value.setting == "prompts"


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ("abc", "prompts must be a list of prompts, got str 'abc'"),
        (["a \ud800"], "prompts[0]: a lone surrogate '\\ud800' at character 2 is not valid"),
        ([[{"role": "user", "content": "\udced"}]], "prompts[0][0]: a lone surrogate"),
    ],
)
@pytest.mark.usefixtures("no_generation")
def test_bad_text_prompts_are_refused_with_a_tokenizer(
    tiny_dir: Path, prompts: list[harness.Prompt], message: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    with pytest.raises(CheckSettingsError) as refused:
        harness.check_model(tiny_model().model, tokenizer, prompts)
    assert str(refused.value).startswith(message)


@pytest.mark.usefixtures("no_generation")
def test_a_tokenizer_without_a_chat_template_is_refused_for_text(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.chat_template = None
    with pytest.raises(CheckSettingsError) as refused:
        harness.check_model(tiny_model().model, tokenizer, ["a b"])
    assert refused.value.setting == "tokenizer"
    assert str(refused.value).startswith("tokenizer has no chat template, which prompts[0]")


@pytest.mark.usefixtures("no_generation")
def test_a_pool_too_small_for_one_request_is_refused_naming_total_blocks() -> None:
    # Issue 33, item 6: total_blocks=0 raised the CLI's UsageError naming --total-blocks.
    with pytest.raises(CheckSettingsError) as refused:
        harness.check_model(tiny_model().model, None, TOKEN_PROMPTS, total_blocks=1)
    assert str(refused.value).startswith("total_blocks 1 cannot hold even one request: r00 ")


def test_settings_and_keywords_combine_the_keywords_winning() -> None:
    settings = harness.CheckSettings(block_size=4, max_new_tokens=64)
    report = harness.check_model(tiny_model().model, None, [[5, 9, 13]], settings, max_new_tokens=3)
    assert report.passed, report.summary()
    assert (report.pool.block_size, report.rows[0].generated_tokens) == (4, 3)
