"""``--pool-map``: the engine tells its observer of every step, fork, preemption and release,
and the printer draws the pool at those moments; colour only on a terminal without NO_COLOR."""

import io
import random
from pathlib import Path

import pytest

from harness.cli.main import main as harness_main
from harness.cli.pool_map import PoolMapPrinter, wants_color
from harness.runtime.engine import Engine
from harness.runtime.events import PoolEvent, PoolObserver
from harness.runtime.kv_pool import PoisonedKVPool
from harness.runtime.requests import Request
from harness.runtime.results import EngineResult
from impl import KVCacheManager
from impl.block_map import LEGEND
from tests.support.harness_cases import poisoned_pool, pool_layout, tiny_model

# The scenario of test_sharing's copy-before-victim test: block size 4, pool 5; "p" (6
# tokens, two continuations) and "x" (8 tokens) arrive at once; "p/1" forks in step 0,
# is preempted in step 1 when "x" opens a block, and comes back in step 4.
EXPECTED_EVENTS = [
    ("fork", 0, ("p", "p/1")),
    ("step", 0, ()),
    ("preempt", 1, ("p/1",)),
    ("step", 1, ()),
    ("step", 2, ()),
    ("preempt", 3, ("x",)),
    ("step", 3, ()),
    ("release", 3, ("p",)),
    ("step", 4, ()),
    ("release", 4, ("x",)),
    ("step", 5, ()),
    ("step", 6, ()),
    ("release", 6, ("p/1",)),
]


def fork_and_preempt(observer: PoolObserver) -> EngineResult:
    rng = random.Random(2)
    vocab = tiny_model().model.config.vocab_size
    parent = Request("p", tuple(rng.randrange(vocab) for _ in range(6)), 4, num_continuations=2)
    other = Request("x", tuple(rng.randrange(vocab) for _ in range(8)), 4)
    engine = Engine(
        tiny_model().model, KVCacheManager(5, 4), poisoned_pool(5, 4), None, observer=observer
    )
    return engine.run([parent, other])


def test_the_engine_tells_its_observer_of_each_step_fork_preemption_and_release() -> None:
    events: list[tuple[str, int, tuple[str, ...]]] = []

    def record(event: PoolEvent, manager: KVCacheManager) -> None:
        events.append((event.kind, event.step, event.request_ids))

    result = fork_and_preempt(record)
    assert events == EXPECTED_EVENTS
    # Each step's sample counts the cached free blocks and the preemptions so far.
    assert [s.cached_free_blocks for s in result.usage] == [0, 0, 0, 2, 0, 2, 2]
    assert [s.preemptions for s in result.usage] == [0, 1, 1, 2, 2, 2, 2]


def test_the_printer_draws_the_fork_and_the_preemption_and_skips_odd_steps() -> None:
    stream = io.StringIO()
    fork_and_preempt(PoolMapPrinter(2, stream))
    maps = stream.getvalue().split("\n\n")
    titles = [text.splitlines()[0] for text in maps if text]
    assert titles == [
        "-- step 0: fork p -> p/1",
        "-- step 0: step",
        "-- step 1: preempt p/1",
        "-- step 2: step",
        "-- step 3: preempt x",
        "-- step 3: release p",
        "-- step 4: step",
        "-- step 4: release x",
        "-- step 6: step",
        "-- step 6: release p/1",
    ]
    assert maps[0] == "\n".join(
        [
            "-- step 0: fork p -> p/1",
            "pool: 5 blocks x 4 tokens; 4 used (2 shared), 0 cached free, 1 free",
            "0 [A* ][A*~][B  ][B  ][.  ]",
            "A  p: token_count = 6, block_ids = [0, 1]",
            "B  x: token_count = 8, block_ids = [2, 3]",
            "C  p/1: token_count = 6, block_ids = [0, 1]",
            "free_block_ids = [4]",
            "cached_free_block_ids = []",
            LEGEND,
        ]
    )
    # "p" copied its shared last block into block 4; preempting "p/1" freed block 1.
    assert maps[2] == "\n".join(
        [
            "-- step 1: preempt p/1",
            "pool: 5 blocks x 4 tokens; 4 used (0 shared), 0 cached free, 1 free",
            "0 [A  ][.  ][B  ][B  ][A ~]",
            "A  p: token_count = 7, block_ids = [0, 4]",
            "B  x: token_count = 8, block_ids = [2, 3]",
            "free_block_ids = [1]",
            "cached_free_block_ids = []",
            LEGEND,
        ]
    )
    # "p/1" comes back under its own label, C.
    assert "C  p/1: token_count = 7, block_ids = [0, 4]" in maps[6]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("stream", "no_color", "expected"),
    [
        (Terminal(), None, True),
        (Terminal(), "1", False),
        (Terminal(), "", True),
        (io.StringIO(), None, False),
    ],
)
def test_colour_only_on_a_terminal_and_only_without_no_color(
    monkeypatch: pytest.MonkeyPatch, stream: io.StringIO, no_color: str | None, expected: bool
) -> None:
    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    assert wants_color(stream) is expected


def test_a_step_interval_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="every must be >= 1, got 0"):
        PoolMapPrinter(0, io.StringIO())


def test_the_main_command_refuses_a_map_interval_below_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A missing model too: were --pool-map not checked first, its error would show instead.
    args = ["--device", "cpu", "--model", str(tmp_path / "no-model"), "--pool-map", "0"]
    with pytest.raises(SystemExit) as exited:
        harness_main(args)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().endswith("argument --pool-map: must be >= 1, got 0")


def test_the_main_commands_help_lists_the_map_and_the_plot(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        harness_main(["--help"])
    out = capsys.readouterr().out
    assert "--pool-map EVERY" in out and "--plot FILE.png" in out


def test_the_map_shows_the_host_tier_with_the_swapped_out_request() -> None:
    stream = io.StringIO()
    printer = PoolMapPrinter(1, stream)
    rng = random.Random(2)
    vocab = tiny_model().model.config.vocab_size
    requests = [
        Request(f"r{i}", tuple(rng.randrange(vocab) for _ in range(8)), 6) for i in range(2)
    ]
    pool = PoisonedKVPool(pool_layout(), 5, 4, host_blocks=6)
    pool.poison(list(range(5)))
    engine = Engine(
        tiny_model().model,
        KVCacheManager(5, 4, host_blocks=6),
        pool,
        None,
        observer=printer,
        preemption="swap",
    )
    result = engine.run(requests)
    assert result.host.swaps_out > 0
    text = stream.getvalue()
    swap_out = text[text.index("-- step 1: swap_out r1") :]
    # r1 (label B) holds its prompt's 2 host blocks until it is swapped back in.
    assert "host: 6 blocks; 2 held by swapped requests (B), 0 cached, 4 free\n" in swap_out
    assert "\n[S ][S ][. ][. ][. ][. ]\n" in swap_out
    swap_in = text[text.index("-- step 6: swap_in r1") :]
    assert "host: 6 blocks; 0 held by swapped requests (none), 0 cached, 6 free\n" in swap_in
