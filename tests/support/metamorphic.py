"""Metamorphic relations: one workload run on pools that differ in one setting, and what a
user is promised about the pair. Lockstep proves impl equals the spec; these hold the spec
itself (and impl with it) to what users want of it.

A ``PairMachine`` draws an engine's workload (prompts admitted by token ids, appends,
forks, rollbacks, preemptions, releases, the copies taken) and applies each operation to
a pair of pools, ``a`` and ``b``, built by ``make_pair`` from one drawn shape, once on the
spec (``SpecBackedManager``) and once on impl (``KVCacheManager``). After each step its
relation compares the pair:

- ``HostTierAddsHits``: ``b`` has a host prefix cache. The device side of ``b`` equals
  ``a``'s, every refusal is the same, and no admission and no cached prompt hits fewer
  tokens (the copies are taken after each admission, as an engine takes them before the
  forward, so a host hit's copy never waits across a release).
- ``LargerPoolKeepsHits``: ``b`` has more blocks. Until the pools first answer a step
  differently (``a`` out of blocks where ``b`` is not: after that they run different
  workloads) or ``b`` loses a duplicate (below), no admission and no cached prompt hits
  fewer tokens in ``b``.
- ``SaltNeverRaisesHits``: ``b`` admits each request under its id's cache salt. Until they
  first answer differently (``b`` out of blocks: its misses take more) or ``a`` loses a
  duplicate, no admission hits more tokens in ``b``, and no prompt is cached longer there
  under any salt.

Both stop at a duplicate lost by the pool they say hits more, because of the duplicate
rule (vLLM's too): a block filled with a prefix another block caches is not cached, so
when it is freed, or the cached copy is evicted first, the cache loses K/V it had, where
the other pool may have cached that block (the salted one keys it apart; the smaller one
had evicted the first copy before the duplicate was filled). Each relation fails there
otherwise (``docs/verification.md``: the counterexamples, and ``test_metamorphic.py``'s
scenario). For the same reason they stop where that pool forgets the key of a block a
table holds: a write after a rollback into a cached block the writer alone holds forgets
its key, and the one copy of that prefix goes, where a salted pool had given the writer a
copy of its own and keeps the shared one.
- ``ForkReleaseLeavesTheCache``: ``b`` also forks a request and releases the child at once.
  The pools stay equal but for the fork counter.
- ``ResetIsAFreshPool``: pools with a host prefix cache of 0 to 4 blocks; at a drawn step
  ``a`` releases everything, takes the copies and resets its prefix cache, and ``b`` starts
  there as a fresh pool; from then on both answer every step alike (refusals, hits, cached
  prompts, usage but for the running totals).

``run_relation(machine, factory)`` runs a machine against any ``KVCacheManager``
subclass alone (no spec side): how ``tests/allocator/test_metamorphic.py`` shows each
relation failing on a design bug planted in impl.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from impl import KVCacheManager
from impl.spec_backed import SpecBackedManager
from spec import AllocatorState, BlockAllocationError, CacheKey, HostTier, KVBlockUsage
from spec.state import SharingCounters

# Either kind of pool; both have every row of ``spec.api.OPERATIONS`` as a method.
Manager = Any  # Any: KVCacheManager or SpecBackedManager, called by the rows' names
Factory = Callable[..., Manager]
Pair = tuple[Manager, Manager]

REQUEST_IDS = ("r0", "r1", "r2", "r3")
# Prompts over a 6-token vocabulary, most behind one of a few shared starts, so that hits,
# partial hits and evictions of a shared chain are all frequent, and prompts apart too.
SHARED_STARTS = [(), (1, 2, 1, 2, 1, 2), (1, 2, 1, 2, 0, 0, 1), (2,) * 5]
PROMPTS = st.builds(
    lambda start, rest: start + rest,
    st.sampled_from(SHARED_STARTS),
    st.lists(st.integers(0, 5), max_size=6).map(tuple),
).filter(bool)
# Each request's salt when a pool admits under salts: two tenants and the unsalted one.
SALT_OF = {"r0": "a", "r1": "b", "r2": None, "r3": "a"}


@dataclass(frozen=True, slots=True)
class Answer:
    """What a pool answered one operation: the refusal's type and message, or the tokens
    an admission hit (``None`` for any other operation)."""

    refused: str | None = None
    cached_tokens: int | None = None


def answer(manager: Manager, name: str, *args: object) -> Answer:
    """Apply ``name`` to ``manager``; an allocator's refusal is an answer, not an error."""
    try:
        result = getattr(manager, name)(*args)
    except (BlockAllocationError, KeyError, ValueError) as error:
        return Answer(refused=f"{type(error).__name__}: {error}")
    return Answer(cached_tokens=getattr(result, "cached_tokens", None))


def device_side(state: AllocatorState) -> AllocatorState:
    """``state`` without its host tier and running totals: what the device holds."""
    return replace(state, host=HostTier(), counters=SharingCounters())


def cached_tokens(manager: Manager, prompts: set[tuple[int, ...]], salt: str | None) -> list[int]:
    """How many tokens of each prompt (in sorted order) ``manager`` has cached under ``salt``."""
    return [manager.cached_prefix_tokens(prompt, salt) for prompt in sorted(prompts)]


def assert_hits_at_least(
    prompts: set[tuple[int, ...]],
    more: tuple[Manager, str | None, str],
    fewer: tuple[Manager, str | None, str],
) -> None:
    """Each prompt is cached at least as long in ``more``'s pool under its salt as in
    ``fewer``'s under its own (each: pool, salt, what the message calls it)."""
    (pool, salt, name), (other, other_salt, other_name) = more, fewer
    hits, other_hits = cached_tokens(pool, prompts, salt), cached_tokens(other, prompts, other_salt)
    assert all(h >= o for h, o in zip(hits, other_hits, strict=True)), (
        f"cached tokens of {sorted(prompts)}: {other_hits} {other_name}, {hits} {name}"
    )


class PairMachine(RuleBasedStateMachine):
    """Applies one workload to a pair of pools per kind (spec's, impl's)."""

    # The kinds of pool a relation runs on; ``run_relation`` narrows it to one.
    factories: ClassVar[tuple[Factory, ...]] = (SpecBackedManager, KVCacheManager)

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[Manager, Manager]] = []
        self.prompts: set[tuple[int, ...]] = set()
        self.running: list[str] = []
        self.diverged = False
        # The duplicates each pair's watched pool holds (``stops_at_a_duplicate_lost_by``),
        # and the cached blocks its tables held at the end of the last step.
        self.duplicates: dict[int, dict[int, CacheKey]] = {}
        self.cached_held: dict[int, dict[int, CacheKey]] = {}

    def make_pair(self, factory: Factory, shape: tuple[int, int], data: st.DataObject) -> Pair:
        """The two pools of one kind for a drawn ``shape`` (total blocks, block size)."""
        total_blocks, block_size = shape
        return factory(total_blocks, block_size), factory(total_blocks, block_size)

    @initialize(total_blocks=st.integers(2, 12), block_size=st.integers(1, 3), data=st.data())
    def build(self, total_blocks: int, block_size: int, data: st.DataObject) -> None:
        shape = (total_blocks, block_size)
        self.pairs = [self.make_pair(factory, shape, data) for factory in self.factories]

    def arguments(self, side: int, name: str, args: tuple[object, ...]) -> tuple[object, ...]:
        """The arguments pool ``side`` (0: ``a``, 1: ``b``) is called with."""
        return args

    # The side (0: ``a``, 1: ``b``) whose lost duplicates end the comparison, if any: the
    # side the relation says hits more, which the duplicate rule can make hit less (the
    # module's docstring); the other losing one only widens the gap the relation allows.
    stops_at_a_duplicate_lost_by: ClassVar[int | None] = None

    def step(self, name: str, *args: object) -> None:
        """Apply ``name`` to every pool and judge each pair's answers, then do what the
        engine does next (``after``)."""
        for a, b in self.pairs:
            answers = (
                answer(a, name, *self.arguments(0, name, args)),
                answer(b, name, *self.arguments(1, name, args)),
            )
            if not self.diverged:
                self.judge(f"{name}{args}", *answers)
        self.after(name)
        side = self.stops_at_a_duplicate_lost_by
        if side is None:
            return
        for index, pair in enumerate(self.pairs):
            # NOTE: one ``to_spec`` a step: a relation that watches a pool changes its
            # pools in ``step`` only, so what the tables held at the end of the last step is
            # what they hold at this one's start (a new pool's: nothing).
            state = pair[side].to_spec()
            held = held_block_ids(state)
            cached_held = held_keys(state, held)
            known = self.duplicates.get(index, {})
            self.duplicates[index], lost = track_duplicates(known, state)
            # Only a write forgets a held block's key (the rollback rule); a rule that
            # forgets one elsewhere (the planted rollback bug) is judged, not excused.
            before = self.cached_held.get(index, {}) if name == "append" else {}
            self.diverged |= lost or forgets_a_held_key(before, cached_held, held)
            self.cached_held[index] = cached_held

    def judge(self, step: str, a: Answer, b: Answer) -> None:
        """The relation on one step's answers; by default the same answer."""
        assert a == b, f"{step}: a answered {a}, b {b}"

    def after(self, name: str) -> None:
        """After an admission the engine takes the copies (a host hit's copy in) before the
        forward; the rules draw from the requests running in the spec's ``a`` (the same in
        every pool until they diverge)."""
        if name == "allocate":
            for a, b in self.pairs:
                a.take_transfers()
                b.take_transfers()
        self.running = sorted(self.pairs[0][0].to_spec().tables)

    @rule(request_id=st.sampled_from(REQUEST_IDS), prompt=PROMPTS)
    def admit(self, request_id: str, prompt: tuple[int, ...]) -> None:
        self.prompts.add(prompt)
        self.step("allocate", request_id, prompt)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), count=st.integers(1, 4))
    def decode(self, data: st.DataObject, count: int) -> None:
        request_id = data.draw(st.sampled_from(self.running))
        self.step("append", request_id, tuple(data.draw(st.integers(0, 5)) for _ in range(count)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), name=st.sampled_from(["release", "preempt"]))
    def finish(self, data: st.DataObject, name: str) -> None:
        self.step(name, data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), child=st.sampled_from(REQUEST_IDS))
    def fork(self, data: st.DataObject, child: str) -> None:
        self.step("fork", data.draw(st.sampled_from(self.running)), child)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), cut=st.integers(0, 8))
    def roll_back(self, data: st.DataObject, cut: int) -> None:
        request_id = data.draw(st.sampled_from(self.running))
        held = self.pairs[0][0].to_spec().tables[request_id].token_count
        self.step("truncate", request_id, max(held - cut, 0))

    @rule()
    def take_copies(self) -> None:
        self.step("take_transfers")


class HostTierAddsHits(PairMachine):
    """``b`` has a host prefix cache of 1 to 6 blocks: its device side is ``a``'s, every
    answer the same, no hit shorter."""

    def make_pair(self, factory: Factory, shape: tuple[int, int], data: st.DataObject) -> Pair:
        total_blocks, block_size = shape
        host_blocks = data.draw(st.integers(1, 6), label="host_blocks")
        return factory(total_blocks, block_size), factory(
            total_blocks, block_size, host_blocks=host_blocks, host_prefix_cache=True
        )

    def judge(self, step: str, a: Answer, b: Answer) -> None:
        assert a.refused == b.refused, f"{step}: a answered {a}, b (host tier) {b}"
        assert (b.cached_tokens or 0) >= (a.cached_tokens or 0), (
            f"{step}: the host tier lowered the hit from {a.cached_tokens} to {b.cached_tokens}"
        )

    @invariant()
    def host_tier_adds_hits(self) -> None:
        for a, b in self.pairs:
            assert device_side(b.to_spec()) == device_side(a.to_spec()), (
                "the host tier changed the device side"
            )
            assert_hits_at_least(
                self.prompts, (b, None, "with one"), (a, None, "without a host tier")
            )


class LargerPoolKeepsHits(PairMachine):
    """``b`` has 1 to 4 blocks more: until the pools first answer differently or ``b``
    loses a duplicate, no hit is shorter in ``b``."""

    stops_at_a_duplicate_lost_by = 1  # the larger pool

    def make_pair(self, factory: Factory, shape: tuple[int, int], data: st.DataObject) -> Pair:
        total_blocks, block_size = shape
        extra = data.draw(st.integers(1, 4), label="extra_blocks")
        return factory(total_blocks, block_size), factory(total_blocks + extra, block_size)

    def judge(self, step: str, a: Answer, b: Answer) -> None:
        assert not (b.refused and not a.refused), f"{step}: only the larger pool refused: {b}"
        if a.refused and not b.refused:
            self.diverged = True  # b admits what a cannot: from here they run different work
            return
        assert (b.cached_tokens or 0) >= (a.cached_tokens or 0), (
            f"{step}: the larger pool hit {b.cached_tokens} tokens, the smaller {a.cached_tokens}"
        )

    @invariant()
    def larger_pool_keeps_hits(self) -> None:
        if self.diverged:
            return
        for a, b in self.pairs:
            assert_hits_at_least(
                self.prompts, (b, None, "in the larger"), (a, None, "in the smaller pool")
            )


class SaltNeverRaisesHits(PairMachine):
    """``b`` admits each request under its id's salt (``SALT_OF``): until the pools first
    answer differently or ``a`` loses a duplicate, no hit is longer in ``b``, and no prompt
    cached longer under any salt."""

    stops_at_a_duplicate_lost_by = 0  # the unsalted pool

    def arguments(self, side: int, name: str, args: tuple[object, ...]) -> tuple[object, ...]:
        if side == 1 and name == "allocate":
            request_id = args[0]
            assert isinstance(request_id, str)
            return (*args, SALT_OF[request_id])
        return args

    def judge(self, step: str, a: Answer, b: Answer) -> None:
        if (a.refused is None) != (b.refused is None):
            self.diverged = True  # the salted pool misses more, so it runs out sooner
            return
        assert (b.cached_tokens or 0) <= (a.cached_tokens or 0), (
            f"{step}: under salts the hit grew from {a.cached_tokens} to {b.cached_tokens}"
        )

    @invariant()
    def salt_never_raises_hits(self) -> None:
        if self.diverged:
            return
        for a, b in self.pairs:
            for salt in sorted(set(SALT_OF.values()), key=str):
                assert_hits_at_least(
                    self.prompts, (a, None, "unsalted"), (b, salt, f"under salt {salt!r}")
                )


class ForkReleaseLeavesTheCache(PairMachine):
    """``b`` also forks a running request now and then and releases the child at once:
    the pools stay equal."""

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork_and_release_a_child(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.running))
        for _, b in self.pairs:
            b.fork(parent, "child")
            b.release("child")

    @invariant()
    def fork_release_leaves_the_cache(self) -> None:
        for a, b in self.pairs:
            assert b.to_spec() == a.to_spec(), "a fork released at once changed the pool"


class ResetIsAFreshPool(PairMachine):
    """At a drawn step ``a`` releases everything and resets its prefix cache, and ``b``
    starts there, fresh: from then on they answer alike, hit alike and report the same
    usage but for the running totals."""

    def make_pair(self, factory: Factory, shape: tuple[int, int], data: st.DataObject) -> Pair:
        host_blocks = data.draw(st.integers(0, 4), label="host_blocks")
        self.shape = shape
        # One setting for every kind: the pool ``reset`` starts is made with it.
        self.host = {"host_blocks": host_blocks, "host_prefix_cache": host_blocks > 0}
        return factory(*shape, **self.host), None

    @initialize(total_blocks=st.integers(2, 12), block_size=st.integers(1, 3), data=st.data())
    def build(self, total_blocks: int, block_size: int, data: st.DataObject) -> None:
        shape = (total_blocks, block_size)
        self.pairs = [self.make_pair(self.factories[0], shape, data)]
        self.pairs += [(factory(*shape, **self.host), None) for factory in self.factories[1:]]

    def step(self, name: str, *args: object) -> None:
        if self.reset_done:
            super().step(name, *args)
            return
        for a, _ in self.pairs:
            answer(a, name, *args)
        self.after(name)

    def after(self, name: str) -> None:
        if name == "allocate":
            for pair in self.pairs:
                for manager in pair:
                    if manager is not None:
                        manager.take_transfers()
        self.running = sorted(self.pairs[0][0].to_spec().tables)

    @property
    def reset_done(self) -> bool:
        return self.pairs[0][1] is not None

    @precondition(lambda self: not self.reset_done)
    @rule()
    def reset(self) -> None:
        pairs = []
        for (a, _), factory in zip(self.pairs, self.factories, strict=True):
            for request_id in sorted(a.to_spec().tables):
                a.release(request_id)
            a.take_transfers()
            a.reset_prefix_cache()
            pairs.append((a, factory(*self.shape, **self.host)))
        self.pairs = pairs
        self.running = []

    @invariant()
    def reset_is_a_fresh_pool(self) -> None:
        if not self.reset_done:
            return
        for a, b in self.pairs:
            reset, fresh = (
                cached_tokens(a, self.prompts, None),
                cached_tokens(b, self.prompts, None),
            )
            assert reset == fresh, (
                f"cached tokens of {sorted(self.prompts)}: {reset} after a reset, {fresh} fresh"
            )
            assert without_totals(a.usage()) == without_totals(b.usage()), (
                f"usage after a reset {a.usage()}, fresh {b.usage()}"
            )


def full_blocks(state: AllocatorState) -> dict[int, CacheKey]:
    """Every full block a table tracking token ids holds, with the key of its prefix."""
    block_size = state.block_size
    found: dict[int, CacheKey] = {}
    for tables in state.group_tables:
        for request_id, table in tables.items():
            token_ids = state.token_ids.get(request_id)
            if token_ids is None:
                continue
            salt = state.cache_salts.get(request_id)
            for index, block_id in enumerate(table.block_ids, start=table.skipped_blocks):
                end = (index + 1) * block_size
                if end <= len(token_ids):
                    found[block_id] = CacheKey(salt, token_ids[:end])
    return found


def track_duplicates(
    known: dict[int, CacheKey], state: AllocatorState
) -> tuple[dict[int, CacheKey], bool]:
    """The duplicates the tables of ``state`` hold, a step after they held ``known``, and
    whether the step lost one. A duplicate is a full block whose prefix another block
    caches (so it is not cached itself); one stays known while a table holds it with that
    prefix. Lost: no table holds it any more (freed uncached), or its prefix is cached
    nowhere (the cached copy evicted). The cache then lacks K/V it had, where a pool that
    cached that block would still hit it."""
    held = full_blocks(state)
    cached = {key: block_id for cache in state.group_caches for key, block_id in cache.items()}
    lost = any(
        block_id not in held or key not in cached
        for block_id, key in known.items()
        if held.get(block_id, key) == key
    )
    now = {b: k for b, k in held.items() if cached.get(k, b) != b}
    now.update({b: k for b, k in known.items() if held.get(b) == k and k in cached})
    return now, lost


def held_block_ids(state: AllocatorState) -> set[int]:
    """Every block a table of ``state`` holds."""
    return {b for tables in state.group_tables for t in tables.values() for b in t.block_ids}


def held_keys(state: AllocatorState, held: set[int]) -> dict[int, CacheKey]:
    """The cached blocks of ``held`` (``held_block_ids(state)``), with their keys."""
    return {
        block_id: key
        for cache in state.group_caches
        for key, block_id in cache.items()
        if block_id in held
    }


def forgets_a_held_key(
    before: dict[int, CacheKey], now: dict[int, CacheKey], held: set[int]
) -> bool:
    """Whether a block a table held cached ``before`` a step is still held (in ``held``),
    its key gone (not in ``now``, the held cached blocks after it): a write into a block a
    rollback cut into forgot it. The cache lost K/V it had, where a pool in which the writer
    held its own copy (a salted one) keeps the shared one."""
    return any(b in held and now.get(b) != key for b, key in before.items())


def without_totals(usage: KVBlockUsage) -> KVBlockUsage:
    """``usage`` with its running totals at 0: what the pool holds now."""
    return replace(
        usage,
        prefix_hit_tokens=0,
        evictions=0,
        cow_copies=0,
        preemptions=0,
        skipped_blocks=0,
        swapped_out_blocks=0,
        swapped_in_blocks=0,
        host_hit_blocks=0,
    )


RELATIONS: tuple[type[PairMachine], ...] = (
    HostTierAddsHits,
    LargerPoolKeepsHits,
    SaltNeverRaisesHits,
    ForkReleaseLeavesTheCache,
    ResetIsAFreshPool,
)


def run_relation(machine: type[PairMachine], factory: Factory, profile: settings) -> None:
    """Run ``machine`` on pools made by ``factory`` alone (no spec side)."""
    narrowed = type(machine.__name__, (machine,), {"factories": (factory,)})
    run_state_machine_as_test(narrowed, settings=profile)
