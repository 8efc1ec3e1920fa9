"""The article's ``KVBlockManager`` is a thin layer over the table: each of its calls gives
what the table's operation gives on the spec, and leaves the state the spec leaves.

It has no row and no mirror of its own, so this is its one comparison with the spec: random
sequences of the article's calls (by count, the only way the layer allocates), each next
to the row it stands for on a ``SpecBackedManager``. Its one inlined path, ``append_slot``'s
in-block case, is the reason: a planted bug there must be caught.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impl import KVBlockManager, RequestBlockTable
from impl.spec_backed import SpecBackedManager

REFUSALS = (TypeError, ValueError, KeyError, RuntimeError)


@dataclass(frozen=True)
class Call:
    """One article call: its name and arguments."""

    name: str
    args: tuple[object, ...]


REQUEST_IDS = st.sampled_from(["a", "b", "c"])
CALLS = st.one_of(
    st.builds(lambda r, n: Call("allocate", (r, n)), REQUEST_IDS, st.integers(-1, 9)),
    st.builds(lambda r, n: Call("append_tokens", (r, n)), REQUEST_IDS, st.integers(-1, 6)),
    st.builds(lambda r: Call("append_slot", (r,)), REQUEST_IDS),
    st.builds(lambda r: Call("append_slot", (r,)), REQUEST_IDS),
    st.builds(lambda r: Call("release", (r,)), REQUEST_IDS),
    st.builds(lambda r: Call("snapshot_request", (r,)), REQUEST_IDS),
)


def _as_row(spec_manager: SpecBackedManager, call: Call) -> object:
    """What the table's row the article call stands for gives, in the article's shape."""
    request_id = call.args[0]
    assert isinstance(request_id, str)
    if call.name == "allocate":
        spec_manager.allocate(*call.args)
        return _article_table(spec_manager, request_id)
    if call.name == "append_tokens":
        spec_manager.append(*call.args)
        return _article_table(spec_manager, request_id)
    if call.name == "append_slot":
        return spec_manager.append(request_id, 1).slots[0][0]
    if call.name == "release":
        return list(spec_manager.release(request_id).block_ids)
    return _article_table(spec_manager, request_id)


def _article_table(spec_manager: SpecBackedManager, request_id: str) -> RequestBlockTable:
    table = spec_manager.tables(request_id)[0]
    return RequestBlockTable(request_id, list(table.block_ids), table.token_count)


def _outcome(call: Callable[[], object]) -> tuple[object, str | None]:
    try:
        return call(), None
    except REFUSALS as error:
        return None, f"{type(error).__name__}: {error}"


def run_in_lockstep(article_class: type[KVBlockManager], calls: list[Call], blocks: int) -> None:
    """Each call on an article manager and its row on the spec: same result or error, same
    state after."""
    article = article_class(blocks, 2)
    spec_manager = SpecBackedManager(blocks, 2)
    for call in calls:
        expected = _outcome(partial(_as_row, spec_manager, call))
        actual = _outcome(partial(getattr(article, call.name), *call.args))
        assert actual == expected, f"{call}: spec {expected}, article layer {actual}"
        assert article._manager.to_spec() == spec_manager.to_spec(), f"after {call}"
        assert article.usage() == spec_manager.usage()


@settings(max_examples=300, deadline=None)
@given(calls=st.lists(CALLS, max_size=30), blocks=st.integers(1, 8))
def test_every_article_call_is_its_rows_on_the_spec(calls: list[Call], blocks: int) -> None:
    run_in_lockstep(KVBlockManager, calls, blocks)


class SlotFromTheBlockBefore(KVBlockManager):
    """Planted: the inlined in-block ``append_slot`` gives the slot of the token before."""

    def append_slot(self, request_id: str) -> int:
        table = self._manager._tables.get(request_id)
        if table is not None and table.room:
            table.room -= 1
            table.token_count += 1
            return table.group_block_ids[0][-1] * self.block_size + (
                (table.token_count - 2) % self.block_size
            )
        return super().append_slot(request_id)


def test_a_planted_bug_in_the_inlined_append_slot_is_caught() -> None:
    @settings(max_examples=300, derandomize=True, database=None, deadline=None)
    @given(calls=st.lists(CALLS, max_size=30), blocks=st.integers(1, 8))
    def the_property_on_the_planted_bug(calls: list[Call], blocks: int) -> None:
        run_in_lockstep(SlotFromTheBlockBefore, calls, blocks)

    with pytest.raises(AssertionError, match="append_slot"):
        the_property_on_the_planted_bug()


# Scenarios with literal block ids: what the random calls above never draw (a count that is
# not an int, more than one KV cache group, a window that skips blocks).


def test_a_count_that_is_not_an_int_is_refused_naming_it() -> None:
    manager = KVBlockManager(8, 2)
    with pytest.raises(TypeError, match="token_count must be an int, got str '3'"):
        manager.allocate("a", "3")  # type: ignore[arg-type]
    manager.allocate("a", 1)
    for count in (1.5, True, "2"):
        with pytest.raises(TypeError, match=f"got {type(count).__name__} {count!r}"):
            manager.append_tokens("a", count)  # type: ignore[arg-type]
    assert manager.snapshot_request("a") == RequestBlockTable("a", [0], 1)


def test_append_tokens_adds_one_token_by_default_and_none_for_zero() -> None:
    manager = KVBlockManager(8, 2)
    manager.allocate("a", 0)
    assert manager.append_tokens("a") == RequestBlockTable("a", [0], 1)
    assert manager.append_tokens("a", 0) == RequestBlockTable("a", [0], 1)


def test_release_returns_the_blocks_of_each_group_in_turn() -> None:
    manager = KVBlockManager(8, 2, group_windows=(None, None))
    manager.allocate("a", 3)
    assert manager.release("a") == [0, 1, 2, 3]


def test_snapshot_request_gives_the_group_asked_and_refuses_a_bad_one() -> None:
    manager = KVBlockManager(8, 2, group_windows=(None, None))
    manager.allocate("a", 3)
    assert manager.snapshot_request("a", 1) == RequestBlockTable("a", [2, 3], 3)
    with pytest.raises(ValueError, match=r"\(the pool has 2 KV cache groups\), got 2"):
        manager.snapshot_request("a", 2)
    with pytest.raises(TypeError, match="group must be an int, got bool False"):
        manager.snapshot_request("a", False)
    one_group = KVBlockManager(8, 2)
    one_group.allocate("a", 3)
    with pytest.raises(ValueError, match=r"the pool has 1 KV cache groups\), got 1"):
        one_group.snapshot_request("a", 1)


def test_append_tokens_reports_the_blocks_a_window_skipped() -> None:
    manager = KVBlockManager(8, 2, group_windows=(2,))
    manager.allocate("a", 4)
    assert manager.append_tokens("a", 2) == RequestBlockTable("a", [1, 2], 6, skipped_blocks=1)
    assert manager.snapshot_request("a") == RequestBlockTable("a", [1, 2], 6, skipped_blocks=1)


class CountingAppends(KVBlockManager):
    """A subclass that overrides ``append_tokens`` and reaches the manager through the
    article's own method (``super()``), as the article's ``TrackingManager`` does."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.appends = 0

    def append_tokens(self, request_id: str, token_count: int = 1) -> RequestBlockTable:
        self.appends += 1
        if token_count == 1:
            return super().append_tokens(request_id)  # the article's default: one token
        return super().append_tokens(request_id, token_count)


def test_a_subclass_keeps_its_append_tokens_and_super_reaches_the_manager() -> None:
    manager = CountingAppends(8, 2)
    manager.allocate("a", 1)
    assert manager.append_tokens("a") == RequestBlockTable("a", [0], 2)
    assert manager.append_tokens("a", 3) == RequestBlockTable("a", [0, 1, 2], 5)
    assert manager.appends == 2
    with pytest.raises(KeyError):
        manager.append_tokens("b")
    assert manager.snapshot_request("a") == RequestBlockTable("a", [0, 1, 2], 5)
