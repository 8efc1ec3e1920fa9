"""NVIDIA Dynamo's standalone KV indexer (``ai-dynamo-runtime`` 1.6.1, a real router) fed by
what pagedkv publishes: it holds the spec's keys and scores prompts by the spec's longest
cached prefix, after a run of the main command, a reset, a lost batch and a restart."""

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.kv_publisher import KVEventStream, ZmqEventPublisher
from harness.kv_wire import WireEncoder
from impl import KVCacheManager
from spec.event_consumers import (
    compute_prefix_score,
)
from spec.event_stream import (
    MEDIUM_GPU,
    PresentKey,
    StreamKey,
    compute_stream_key,
    get_present_keys,
)
from spec.records import CacheKey
from tests.events.loopback import Indexer, free_port_pair, wait_for
from tests.support.harness_cases import keep_event_managers, save_model_directory, tiny_model

BLOCK_SIZE = 4
WORKER = 1
# A shared system prompt, so later prompts hit its blocks, in a pool small enough that
# admissions evict cached blocks (as tests/harness/test_kv_events.py runs it).
SYSTEM = "a b c d e f g h i j k l m n o p"
PROMPTS = ["q r s", "t u v w", "x y", "z a b c", "d e", "f g h"]


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[Indexer]:
    running = Indexer(BLOCK_SIZE, tmp_path / "indexer.log")
    yield running
    running.close()


def stream_keys(manager: KVCacheManager) -> frozenset[StreamKey]:
    """What a router should hold of ``manager``'s caches: the spec's present keys."""
    return frozenset(compute_stream_key(p, BLOCK_SIZE) for p in get_present_keys(manager.to_spec()))


def held_by(indexer: Indexer, manager: KVCacheManager, what: str) -> set[int]:
    """Wait until the indexer holds exactly ``manager``'s keys; they."""
    expected = {key.block_hash for key in stream_keys(manager)}
    return wait_for(indexer.device_hashes, lambda held: held == expected, what)


def sampled_prompts(keys: frozenset[PresentKey]) -> list[list[int]]:
    """Prompts a router would score: each cached prefix plus a token, and the same with a
    token changed halfway (a shorter match, or none)."""
    prompts = []
    for present in sorted(keys, key=lambda p: p.key.token_ids)[:24]:
        tokens = [*present.key.token_ids, 1]
        changed = list(tokens)
        changed[len(changed) // 2] += 1
        prompts += [tokens, changed]
    return prompts


@pytest.mark.parametrize("wire_format", ["vllm", "vllm-array"])
def test_after_the_main_command_the_indexer_holds_and_scores_the_spec_s_keys(
    indexer: Indexer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    wire_format: str,
) -> None:
    managers = keep_event_managers(monkeypatch)
    port = free_port_pair()
    indexer.register(WORKER, port)
    model_dir = save_model_directory(tiny_model().model, tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    argv = [
        *("--device", "cpu", "--model", str(model_dir), "--prompts-file", str(prompts)),
        *("--system-prompt", SYSTEM, "--max-new-tokens", "6", "--block-size", str(BLOCK_SIZE)),
        *("--total-blocks", "10", "--arrival-gap", "1", "--threads", "1"),
        *("--events", f"zmq://127.0.0.1:{port}", "--events-format", wire_format),
    ]
    assert main(argv) == 0
    (manager,) = managers  # only the continuous-batching run (check 3) publishes
    held = held_by(indexer, manager, "the indexer to hold the run's keys")
    assert len(held) >= 4
    present = get_present_keys(manager.to_spec())
    keys = stream_keys(manager)
    queries = sampled_prompts(present)
    scores = [
        (indexer.score(p, WORKER), compute_prefix_score(keys, p, BLOCK_SIZE)) for p in queries
    ]
    assert all(router == spec for router, spec in scores), scores
    spec_scores = [spec for _, spec in scores]
    assert any(score >= 2 * BLOCK_SIZE for score in spec_scores)  # chains, not first blocks
    assert 0 in spec_scores  # and misses


class LossyPublisher(ZmqEventPublisher):
    """A publisher that fails to send the next ``losses`` batches (they stay in its replay
    buffer unless ``forget`` drops them from it too)."""

    losses = 0
    forget = False

    def send(self, seq: int, payload: bytes) -> None:
        if self.losses:
            self.losses -= 1
            if self.forget:
                self.buffer.pop()
            return
        super().send(seq, payload)


def publish(port: int) -> tuple[LossyPublisher, KVEventStream, KVCacheManager]:
    """A publisher bound at ``port`` (once a subscriber came) and a manager feeding it."""
    encoder = WireEncoder(BLOCK_SIZE, (None,), "vllm")
    endpoints = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    # ZeroMQ closes a socket in its I/O thread: a restart in the same process may find the
    # old publisher's port still bound for a moment.
    deadline = time.monotonic() + 10
    while True:
        try:
            publisher = LossyPublisher(*endpoints, encoder, subscriber_wait_s=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert publisher.subscribed
    stream = KVEventStream(publisher)
    return publisher, stream, KVCacheManager(16, BLOCK_SIZE, event_sink=stream.record)


def test_a_reset_a_lost_batch_and_a_restart_leave_the_indexer_with_the_spec_s_keys(
    indexer: Indexer,
) -> None:
    port = free_port_pair()
    indexer.register(WORKER, port)
    publisher, stream, manager = publish(port)
    system = list(range(100, 108))
    manager.allocate("a", [*system, 1, 2, 3, 4, 5])
    stream.flush()
    held_by(indexer, manager, "the first prompt's three blocks")
    assert indexer.score([*system, 1, 2, 3, 4, 9], WORKER) == 12

    # A lost batch: the next one shows the gap, and the indexer replays it from the buffer.
    publisher.losses = 1
    manager.allocate("b", [*system, 6, 7, 8, 9, 10])
    stream.flush()
    manager.allocate("c", [*system, 11, 12, 13, 14, 15])
    stream.flush()
    held_by(indexer, manager, "the lost batch's keys, replayed")

    # Lost and gone from the buffer too: replay cannot help; a resync does.
    publisher.losses, publisher.forget = 1, True
    manager.allocate("d", [*system, 16, 17, 18, 19, 20])
    stream.flush()
    manager.release("a")
    manager.allocate("e", [21, 22, 23, 24, 25])
    stream.flush()
    time.sleep(1)  # the indexer has the next batch, the gap, and an empty replay by now
    lost = PresentKey(0, MEDIUM_GPU, CacheKey(None, (*system, 16, 17, 18, 19)))
    held = indexer.device_hashes()
    assert compute_stream_key(lost, BLOCK_SIZE).block_hash not in held
    assert held < {key.block_hash for key in stream_keys(manager)}
    stream.resync()
    held_by(indexer, manager, "the resynced keys")

    # A reset empties the indexer.
    for request_id in "bcde":
        manager.release(request_id)
    manager.reset_prefix_cache()
    stream.flush()
    wait_for(indexer.device_hashes, lambda held: not held, "an empty indexer after the reset")
    assert indexer.score([*system, 1, 2, 3, 4, 9], WORKER) == 0

    # A restart: a new producer on the same port; its opening clear drops what the
    # indexer knew of the old one.
    manager.allocate("f", [*system, 1])
    stream.close()
    held_before = wait_for(indexer.device_hashes, lambda held: len(held) == 2, "f's blocks")
    _, restarted, fresh = publish(port)
    fresh.allocate("g", [7, 7, 7, 7, 7])
    restarted.flush()
    assert not held_before & held_by(indexer, fresh, "only the new producer's key")
    restarted.close()
