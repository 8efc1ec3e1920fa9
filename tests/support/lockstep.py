"""The model-vs-target state machine: spec (``self.model``) and impl (``self.target``) in lockstep.

Every rule applies one operation to both, with valid and invalid arguments alike, and
compares the return value or the raised error (type and message). After every step the
invariants compare the whole states and run both invariant checks; a run ends by
releasing everything and asserting that the pool is full again.

``machine_for(cls)`` builds the machine against any ``KVBlockManager`` subclass, which is
how the planted-bug tests point it at broken allocators.
"""

from collections.abc import Callable
from typing import TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import spec
from impl import KVBlockManager
from spec import AllocatorState

T = TypeVar("T")

# A handful of ids, so duplicates and unknown ids come up often.
REQUEST_IDS = st.sampled_from(["r0", "r1", "r2", "r3", "r4"])
# Arbitrary counts, a few negative ones among them.
TOKEN_COUNTS = st.integers(min_value=-2, max_value=40)
# Prompts from a 4-token vocabulary, most starting with one of a few shared prefixes, so
# prefix hits, duplicate full blocks and hash collisions are all frequent.
SHARED_PREFIXES = [(), (1, 2, 3, 1, 2, 3, 1, 2), (1, 2, 3, 1, 2, 3, 0, 0, 1), (2,) * 6]
TOKEN_IDS = st.lists(st.integers(0, 3), max_size=6).map(tuple)
PROMPTS = st.builds(
    lambda prefix, suffix: prefix + suffix, st.sampled_from(SHARED_PREFIXES), TOKEN_IDS
)


def _outcome(call: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return call(), None
    except (ValueError, KeyError, RuntimeError) as error:
        return None, error


class AllocatorMachine(RuleBasedStateMachine):
    """Drives ``spec`` and one ``KVBlockManager`` class with the same operations."""

    target_class: type[KVBlockManager] = KVBlockManager

    def __init__(self) -> None:
        super().__init__()
        self.model: AllocatorState = spec.init(1, 1)
        self.target: KVBlockManager = self.target_class(1, 1)

    @initialize(total_blocks=st.integers(1, 12), block_size=st.integers(1, 5))
    def init_pool(self, total_blocks: int, block_size: int) -> None:
        self.model = spec.init(total_blocks, block_size)
        self.target = self.target_class(total_blocks, block_size)

    def _step(
        self,
        model_op: Callable[[AllocatorState], AllocatorState],
        target_op: Callable[[KVBlockManager], T],
    ) -> tuple[AllocatorState, T | None]:
        """Apply one operation to both; assert they agree on success or on the error."""
        before = self.model
        new_model, expected = _outcome(lambda: model_op(before))
        result, actual = _outcome(lambda: target_op(self.target))
        if expected is not None or actual is not None:
            assert type(actual) is type(expected), f"spec raised {expected!r}, impl {actual!r}"
            assert str(actual) == str(expected), f"messages differ: {expected} / {actual}"
            return before, None
        assert new_model is not None
        self.model = new_model
        return before, result

    @rule(request_id=REQUEST_IDS, token_count=TOKEN_COUNTS)
    def allocate(self, request_id: str, token_count: int) -> None:
        _, table = self._step(
            lambda s: spec.allocate(s, request_id, token_count),
            lambda t: t.allocate(request_id, token_count),
        )
        if table is not None:
            assert table == spec.block_table(self.model, request_id)

    @rule(request_id=REQUEST_IDS, blocks=st.integers(0, 6), delta=st.sampled_from([-1, 0, 1]))
    def allocate_at_block_boundary(self, request_id: str, blocks: int, delta: int) -> None:
        self.allocate(request_id, blocks * self.model.block_size + delta)

    @rule(request_id=REQUEST_IDS, token_count=st.integers(-1, 12))
    def append_tokens(self, request_id: str, token_count: int) -> None:
        _, table = self._step(
            lambda s: spec.append_tokens(s, request_id, token_count),
            lambda t: t.append_tokens(request_id, token_count),
        )
        if table is not None:
            assert table == spec.block_table(self.model, request_id)

    @rule(request_id=REQUEST_IDS)
    def append_slot(self, request_id: str) -> None:
        before, slot = self._step(
            lambda s: spec.append_tokens(s, request_id, 1),
            lambda t: t.append_slot(request_id),
        )
        if slot is not None:
            table = spec.block_table(self.model, request_id)
            position = before.tables[request_id].token_count
            assert slot == spec.slot_index(self.model.block_size, table.block_ids, position)

    @precondition(lambda self: len(self.model.tables) > 0)
    @rule(data=st.data())
    def decode_a_running_request_to_its_next_boundary(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.model.tables)))
        remaining = -self.model.tables[request_id].token_count % self.model.block_size
        for _ in range(remaining + 1):
            if request_id in self.model.token_ids:
                self.append_token_slot(request_id, data.draw(st.integers(0, 3)))
            else:
                self.append_slot(request_id)

    @rule(request_id=REQUEST_IDS, token_ids=PROMPTS)
    def allocate_prompt(self, request_id: str, token_ids: tuple[int, ...]) -> None:
        before, allocation = self._step(
            lambda s: spec.allocate_prompt(s, request_id, token_ids),
            lambda t: t.allocate_prompt(request_id, token_ids),
        )
        if allocation is not None:
            assert allocation.table == spec.block_table(self.model, request_id)
            hits = spec.cached_prefix_blocks(before, token_ids)
            assert allocation.cached_tokens == len(hits) * self.model.block_size

    @rule(request_id=REQUEST_IDS, token_ids=TOKEN_IDS)
    def append_token_ids(self, request_id: str, token_ids: tuple[int, ...]) -> None:
        _, table = self._step(
            lambda s: spec.append_token_ids(s, request_id, token_ids),
            lambda t: t.append_token_ids(request_id, token_ids),
        )
        if table is not None:
            assert table == spec.block_table(self.model, request_id)

    @rule(request_id=REQUEST_IDS, token_id=st.integers(0, 3))
    def append_token_slot(self, request_id: str, token_id: int) -> None:
        before, slot = self._step(
            lambda s: spec.append_token_ids(s, request_id, (token_id,)),
            lambda t: t.append_token_slot(request_id, token_id),
        )
        if slot is not None:
            table = spec.block_table(self.model, request_id)
            position = before.tables[request_id].token_count
            assert slot == spec.slot_index(self.model.block_size, table.block_ids, position)

    @rule(parent_id=REQUEST_IDS, child_id=REQUEST_IDS)
    def fork(self, parent_id: str, child_id: str) -> None:
        _, table = self._step(
            lambda s: spec.fork(s, parent_id, child_id),
            lambda t: t.fork(parent_id, child_id),
        )
        if table is not None:
            assert table == spec.block_table(self.model, child_id)

    @precondition(lambda self: 0 < len(self.model.tables) < 5)
    @rule(data=st.data())
    def fork_a_running_request_and_write_to_both(self, data: st.DataObject) -> None:
        """Parallel sampling: fork, then each side appends into what they share."""
        parent_id = data.draw(st.sampled_from(sorted(self.model.tables)))
        child_id = data.draw(REQUEST_IDS.filter(lambda r: r not in self.model.tables))
        self.fork(parent_id, child_id)
        for request_id in data.draw(st.permutations([parent_id, child_id])):
            if request_id in self.model.token_ids:
                self.append_token_slot(request_id, data.draw(st.integers(0, 3)))
            else:
                self.append_slot(request_id)

    @rule()
    def take_copies(self) -> None:
        assert self.target.take_copies() == list(self.model.pending_copies)
        self.model = spec.take_copies(self.model)

    @rule(request_id=REQUEST_IDS)
    def preempt(self, request_id: str) -> None:
        before, released = self._step(
            lambda s: spec.preempt(s, request_id),
            lambda t: t.preempt(request_id),
        )
        if released is not None:
            assert released == list(before.tables[request_id].block_ids)

    @precondition(lambda self: len(self.model.token_ids) > 0)
    @rule(data=st.data())
    def preempt_and_recompute(self, data: st.DataObject) -> None:
        """The engine's preemption: release, then readmit with prompt and generated tokens."""
        request_id = data.draw(st.sampled_from(sorted(self.model.token_ids)))
        token_ids = self.model.token_ids[request_id]
        self.preempt(request_id)
        self.allocate_prompt(request_id, token_ids)

    @rule(request_id=REQUEST_IDS)
    def release(self, request_id: str) -> None:
        before, released = self._step(
            lambda s: spec.release(s, request_id),
            lambda t: t.release(request_id),
        )
        if released is not None:
            assert released == list(before.tables[request_id].block_ids)

    @rule(request_id=REQUEST_IDS)
    def snapshot_request(self, request_id: str) -> None:
        def model_lookup(state: AllocatorState) -> AllocatorState:
            spec.block_table(state, request_id)  # raises KeyError for an unknown id
            return state

        _, table = self._step(model_lookup, lambda t: t.snapshot_request(request_id))
        if table is not None:
            assert table == spec.block_table(self.model, request_id)

    @invariant()
    def states_agree(self) -> None:
        assert self.target.to_spec() == self.model
        assert self.target.free_block_ids == self.model.free_block_ids
        assert self.target.request_tables == dict(self.model.tables)
        assert self.target.usage() == spec.usage(self.model)

    @invariant()
    def invariants_hold(self) -> None:
        broken = spec.violated_invariants(self.model)
        assert broken == [], f"the spec state breaks {broken}"
        self.target.check_invariants()

    def teardown(self) -> None:
        for request_id in sorted(self.model.tables):
            self.release(request_id)
        assert self.target.num_free_blocks == self.target.total_blocks, "a block leaked"
        free = self.target.free_block_ids + self.target.cached_free_block_ids
        assert sorted(free) == list(range(self.target.total_blocks))
        assert all(self.target.ref_count(b) == 0 for b in range(self.target.total_blocks))
        assert self.target.to_spec() == self.model


def machine_for(target_class: type[KVBlockManager]) -> type[AllocatorMachine]:
    """The state machine driving ``target_class`` against the spec."""
    return type(
        f"AllocatorMachineFor{target_class.__name__}",
        (AllocatorMachine,),
        {"target_class": target_class},
    )
