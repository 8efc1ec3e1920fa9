"""``CheckSettings``: every setting's type and range checked when the settings are built,
the first bad one refused with a ``CheckSettingsError`` naming its keyword."""

from dataclasses import fields
from typing import get_type_hints

import pytest

import harness
from harness.cli.main import _settings, build_parser
from harness.settings import CheckSettings, CheckSettingsError, CheckSettingsKeywords
from spec import MAX_BLOCK_SIZE, MAX_TOTAL_BLOCKS

# (keyword, a value it refuses, the message). Per field: a value of another type, one
# below its range and, where it has one, one above.
REFUSED: list[tuple[str, object, str]] = [
    ("max_new_tokens", True, "max_new_tokens must be an int, got bool True"),
    ("max_new_tokens", 8.0, "max_new_tokens must be an int, got float 8.0"),
    ("max_new_tokens", None, "max_new_tokens must be an int, got NoneType None"),
    ("max_new_tokens", 0, "max_new_tokens must be >= 1, got 0"),
    ("block_size", "16", "block_size must be an int, got str '16'"),
    ("block_size", 0, "block_size must be in [1, 65,536], got 0"),
    ("block_size", MAX_BLOCK_SIZE + 1, "block_size must be in [1, 65,536], got 65,537"),
    ("total_blocks", 4.0, "total_blocks must be an int or None, got float 4.0"),
    ("total_blocks", 0, "total_blocks must be in [1, 16,777,216], got 0"),
    (
        "total_blocks",
        MAX_TOTAL_BLOCKS + 1,
        "total_blocks must be in [1, 16,777,216], got 16,777,217",
    ),
    ("attention", "fast", "attention must be one of ['gather', 'varlen-emulated', 'varlen', "),
    ("attention", None, "attention must be one of ['gather', "),
    ("prefix_cache", 1, "prefix_cache must be a bool, got int 1"),
    ("poison_freed", "yes", "poison_freed must be a bool, got str 'yes'"),
    ("n", False, "n must be an int, got bool False"),
    ("n", 0, "n must be >= 1, got 0"),
    ("arrival_gap", 2.5, "arrival_gap must be an int, got float 2.5"),
    ("arrival_gap", -1, "arrival_gap must be >= 0, got -1"),
    ("batch_invariant", None, "batch_invariant must be a bool, got NoneType None"),
    ("speculate", True, "speculate must be an int or None, got bool True"),
    ("speculate", 0, "speculate must be >= 1, got 0"),
    ("max_batch_tokens", 0, "max_batch_tokens must be >= 1, got 0"),
    ("salts", 1.5, "salts must be an int or None, got float 1.5"),
    ("salts", 0, "salts must be >= 1, got 0"),
    ("preempt", "evict", "preempt must be one of ['recompute', 'swap'], got 'evict'"),
    ("host_blocks", 4.0, "host_blocks must be an int or None, got float 4.0"),
    ("host_blocks", 0, "host_blocks must be in [1, 16,777,216], got 0"),
    (
        "host_blocks",
        MAX_TOTAL_BLOCKS + 1,
        "host_blocks must be in [1, 16,777,216], got 16,777,217",
    ),
    ("checkpoint_interval", 16.0, "checkpoint_interval must be an int or None, got float 16.0"),
    ("checkpoint_interval", 0, "checkpoint_interval must be >= 1, got 0"),
]


@pytest.mark.parametrize(("keyword", "value", "message"), REFUSED)
def test_a_setting_of_the_wrong_type_or_out_of_range_is_refused_naming_its_keyword(
    keyword: str, value: object, message: str
) -> None:
    with pytest.raises(CheckSettingsError) as refused:
        CheckSettings(**{keyword: value})  # type: ignore[arg-type]
    assert str(refused.value).startswith(message)
    assert refused.value.setting == keyword
    assert isinstance(refused.value, ValueError)


def test_every_setting_has_a_refused_value_of_another_type_and_out_of_range() -> None:
    refused = {keyword for keyword, _, _ in REFUSED}
    assert refused == {setting.name for setting in fields(CheckSettings)}


@pytest.mark.parametrize(
    "settings",
    [
        {"max_new_tokens": 1, "block_size": 1, "total_blocks": 1, "n": 1, "arrival_gap": 0},
        {"block_size": MAX_BLOCK_SIZE, "total_blocks": MAX_TOTAL_BLOCKS},
        {"host_blocks": MAX_TOTAL_BLOCKS, "preempt": "swap", "prefix_cache": False},
        {"speculate": 1, "max_batch_tokens": 1, "salts": 1, "host_blocks": 1},
        {"attention": "flex", "poison_freed": True, "batch_invariant": True},
    ],
)
def test_settings_at_the_edges_of_their_ranges_are_accepted(settings: dict[str, object]) -> None:
    built = CheckSettings(**settings)  # type: ignore[arg-type]
    assert all(getattr(built, keyword) == value for keyword, value in settings.items())


def test_a_host_tier_that_would_hold_nothing_is_refused() -> None:
    with pytest.raises(CheckSettingsError) as refused:
        CheckSettings(host_blocks=8, prefix_cache=False, preempt="recompute")
    assert refused.value.setting == "host_blocks"
    assert str(refused.value) == (
        "host_blocks 8 would hold nothing: a host tier keeps swapped requests (preempt swap) "
        "and cached prefixes (prefix caching on), and this run has neither"
    )
    CheckSettings(host_blocks=8, prefix_cache=False, preempt="swap")
    CheckSettings(host_blocks=8, prefix_cache=True, preempt="recompute")


def test_the_settings_are_frozen_and_exported() -> None:
    settings = harness.CheckSettings(block_size=4)
    with pytest.raises(AttributeError):
        settings.block_size = 0  # type: ignore[misc]
    assert harness.CheckSettingsError is CheckSettingsError
    assert issubclass(harness.CheckSettingsError, ValueError)


def test_check_models_keywords_are_the_settings_fields_with_their_types() -> None:
    assert get_type_hints(CheckSettingsKeywords) == get_type_hints(CheckSettings)
    assert list(CheckSettingsKeywords.__annotations__) == [s.name for s in fields(CheckSettings)]


def test_the_commands_defaults_are_the_settings_defaults() -> None:
    assert _settings(build_parser().parse_args([])) == CheckSettings()
