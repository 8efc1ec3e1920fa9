"""``python -m harness --events FILE.jsonl``: the KV cache events of the main command's run,
written one per line, replay to exactly the cache the run ended with."""

import json
from collections import Counter
from pathlib import Path

import pytest

import spec
from harness.cli.main import main
from harness.kv_events import KVEventLog, event_json, read_events, write_events
from spec import AllBlocksCleared, BlockRemoved, BlockStored
from tests.support.harness_cases import keep_event_managers, save_model_directory, tiny_model

# Every prompt starts with the same system prompt, so later ones hit its blocks; a pool
# of 10 blocks of 4 tokens for six requests makes admissions evict cached free blocks
# (15 stored, 6 removed).
SYSTEM = "a b c d e f g h i j k l m n o p"
PROMPTS = ["q r s", "t u v w", "x y", "z a b c", "d e", "f g h"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_directory(tiny_model().model, tmp_path_factory.mktemp("tiny"))


def _argv(tiny_dir: Path, tmp_path: Path) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return [
        *("--device", "cpu", "--model", str(tiny_dir), "--prompts-file", str(prompts)),
        *("--system-prompt", SYSTEM, "--max-new-tokens", "6", "--block-size", "4"),
        *("--total-blocks", "10", "--arrival-gap", "1", "--poison-freed"),
    ]


def test_the_events_of_the_main_command_replay_to_the_cache_it_ended_with(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    managers = keep_event_managers(monkeypatch)
    path = tmp_path / "events.jsonl"
    assert main([*_argv(tiny_dir, tmp_path), "--events", str(path)]) == 0
    stamped = read_events(path)
    events = [event for _, event in stamped]
    kinds = Counter(type(event).__name__ for event in events)
    assert kinds["BlockStored"] > kinds["BlockRemoved"] > 1, kinds
    steps = [step for step, _ in stamped]
    assert steps == sorted(steps) and steps[-1] > 0
    (manager,) = managers  # only the continuous-batching run (check 3) records
    final = spec.get_cached_blocks(manager.to_spec())
    assert final and spec.replay_events(events) == final
    # The comparison can fail: a stream that lost one removal does not give the cache.
    lost = events.index(next(e for e in events if isinstance(e, BlockRemoved)))
    assert _replayed(events[:lost] + events[lost + 1 :]) != final


def _replayed(events: list[spec.KVCacheEvent]) -> frozenset[spec.CachedBlock] | None:
    """The view ``events`` replay to, or None when they contradict themselves."""
    try:
        return spec.replay_events(events)
    except spec.EventReplayError:
        return None


def test_each_line_is_one_event_with_its_type_step_and_fields(tmp_path: Path) -> None:
    log = KVEventLog()
    log.record(BlockStored(3, 0, None, (1, 2), "t1"))
    log.step_of = lambda: 7
    log.record(BlockRemoved(3, 0))
    log.record(AllBlocksCleared())
    path = tmp_path / "e.jsonl"
    write_events(path, log.events)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {
            "type": "BlockStored",
            "step": 0,
            "block_id": 3,
            "group": 0,
            "parent_block_id": None,
            "token_ids": [1, 2],
            "cache_salt": "t1",
        },
        {"type": "BlockRemoved", "step": 7, "block_id": 3, "group": 0},
        {"type": "AllBlocksCleared", "step": 7},
    ]
    assert read_events(path) == log.events
    assert event_json(1, AllBlocksCleared()) == {"type": "AllBlocksCleared", "step": 1}


def test_a_line_that_is_no_event_is_named_by_its_number(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    path.write_text('{"type": "AllBlocksCleared", "step": 0}\n{"type": "BlockMoved"}\n')
    with pytest.raises(ValueError, match=r"e\.jsonl:2: not a KV cache event: KeyError"):
        read_events(path)


def test_an_events_file_that_cannot_be_written_is_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "events.jsonl"
    assert main(["--device", "cpu", "--events", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"python -m harness: error: --events: no directory {str(missing.parent)!r} to write into"
    )
    assert "loading model" not in "".join(err)
