"""The absolute properties: what a target must cache, what it may evict, and how long its
hits must be, judged against the kit's own shadow of what should be cached.

The step properties of ``harness.conformance.properties`` judge a call against the spec's
operation on the state the target was in, its own cache included, so a target that never
caches a block it computed, or drops a cached prefix no allocation needed, passes them by
construction. These do not take the target's cache as given:

- ``computed_findable``: every block a step's calls filled with computed tokens is cached,
  under its key, when the step ends (one computed and evicted in the same step counts as
  an eviction);
- ``eviction_justified``: a call loses, over every group, at most as many keys as the
  spec's operation on the same state evicts (its ``BlockRemoved`` events), or on a reset;
  for a call the spec refuses and the target declares it may carry out, at most as many
  as the cached free blocks it took (``revived_counts``);
- ``shadow_hit_maximal``: the ``Shadow`` holds every key the target's calls computed or
  it cached, less those evicted; an admission's hit is at least the spec's hit rule over
  it. A hit is only asked of blocks whose forward pass ended before the admission's step.

For a target that shows its cached blocks the first two are checked on what it shows, and
the shadow follows its cache; for one that does not (``cached_block_ids`` empty), the
first two cannot be checked and the shadow forgets a key once no block the kit knows
holds it any more (its block was taken for other tokens), so lost hits still show.
"""

from collections.abc import Sequence
from dataclasses import replace

import spec
from harness.conformance.adapter import Observation
from harness.conformance.properties import Finding
from harness.conformance.view import Contents

Keys = list[frozenset[spec.CacheKey]]


def visible_keys(observation: Observation, contents: Contents, groups: int) -> Keys | None:
    """The keys of the blocks the target shows as cached, per group (a block whose content
    the kit never saw has none: ``cache_sound`` reports it); ``None`` if it shows none."""
    if not observation.cached_block_ids:
        return None
    found = []
    for group in range(groups):
        keys = (contents.key(group, block_id) for block_id in observation.cached_block_ids[group])
        found.append(frozenset(key for key in keys if key is not None))
    return found


def computed_keys(state: spec.AllocatorState, request_id: str, computed_from: int) -> Keys:
    """The keys of the blocks a call computed: ``request_id``'s full blocks in ``state``
    that end past token ``computed_from`` (its length before an append; 0 for an
    admission), per group, past skipped_blocks, whose tokens are all known (none for a
    request tracked by count); in a recurrent state group, the checkpoint of the state
    the call starts from when ``computed_from`` is on the group's grid (``spec.kinds``)."""
    token_ids = state.token_ids.get(request_id)
    salt = state.cache_salts.get(request_id)
    found: Keys = []
    for kind, tables in zip(state.group_windows, state.group_tables, strict=True):
        table = tables.get(request_id)
        if token_ids is None or table is None:
            found.append(frozenset())
            continue
        if isinstance(kind, spec.RecurrentState):
            # A state group checkpoints the state a call starts from, on its grid.
            on_grid = kind.is_checkpoint_at(computed_from)
            found.append(
                frozenset({spec.CacheKey(salt, token_ids[:computed_from])} if on_grid else ())
            )
            continue
        full = min(table.token_count, len(token_ids)) // state.block_size
        found.append(
            frozenset(
                spec.CacheKey(salt, token_ids[: (index + 1) * state.block_size])
                for index in range(
                    max(table.skipped_blocks, computed_from // state.block_size), full
                )
            )
        )
    return found


def evicted_counts(events: Sequence[spec.KVCacheEvent], groups: int) -> list[float]:
    """How many keys the spec's calls evicted, per group (a reset: any number)."""
    counts = [0.0] * groups
    for event in events:
        if isinstance(event, spec.AllBlocksCleared):
            return [float("inf")] * groups
        if isinstance(event, spec.BlockRemoved):
            counts[event.group] += 1
    return counts


def extra_state_blocks(
    before: spec.AllocatorState,
    after: spec.AllocatorState,
    expected: spec.AllocatorState,
    request_id: str,
) -> list[float]:
    """Per group, 1 where a recurrent state group's call took the request a new block
    that the spec's operation did not (vLLM's Mamba group takes one at every block
    boundary, the spec only to copy a cached or shared state): a block taken beyond the
    spec's may evict one more key. 0 elsewhere."""
    extra = []
    for kind, old, new, spec_new in zip(
        before.group_windows,
        before.group_tables,
        after.group_tables,
        expected.group_tables,
        strict=True,
    ):
        held, now, spec_now = old.get(request_id), new.get(request_id), spec_new.get(request_id)
        took = held is not None and now is not None and now.block_ids != held.block_ids
        spec_took = spec_now is not None and spec_now.block_ids != held.block_ids if held else True
        extra.append(
            1.0 if isinstance(kind, spec.RecurrentState) and took and not spec_took else 0.0
        )
    return extra


class Shadow:
    """What should be cached, per group, given the target's own admissions and evictions."""

    def __init__(self, groups: int) -> None:
        self.keys: list[set[spec.CacheKey]] = [set() for _ in range(groups)]

    def hit(
        self,
        state: spec.AllocatorState,
        token_ids: tuple[int, ...],
        cache_salt: str | None,
        visible_now: Keys | None,
        contents: Contents,
    ) -> int:
        """The spec's hit rule over the shadow, less the keys evicted earlier in this step:
        those the target no longer shows, or (if it shows none) no block holds any more."""
        caches = []
        for group, keys in enumerate(self.keys):
            kept = keys & (contents.held_keys(group) if visible_now is None else visible_now[group])
            caches.append(spec.FrozenMap(dict.fromkeys(kept, -1)))
        shadow_state = replace(state, group_caches=tuple(caches))
        return spec.cached_prefix_tokens(shadow_state, token_ids, cache_salt)

    def settle(
        self,
        *,
        visible_after: Keys | None,
        computed: list[dict[spec.CacheKey, str]],
        released: set[str],
        evicted: Keys,
        contents: Contents,
    ) -> list[Finding]:
        """End a step: the findings of ``computed_findable``, then the shadow's update.
        ``computed[g]``: each key the step's calls computed, and the request that computed
        it; ``released``: the requests released or preempted in the step; ``evicted[g]``:
        the keys its calls evicted (``eviction_findings`` judged each call).

        A finding's ``operation`` is ``release`` when every key computed and not cached
        was computed by a request the step then released (after its last forward)."""
        findings: list[Finding] = []
        for group in range(len(self.keys)):
            if visible_after is None:
                self.keys[group] |= computed[group].keys()
                self.keys[group] &= contents.held_keys(group)
                continue
            # The target shows its cache: what it shows is its own admissions and evictions.
            self.keys[group] = set(visible_after[group])
            lost = computed[group].keys() - visible_after[group] - evicted[group]
            if lost:
                last_forward = {computed[group][key] for key in lost} <= released
                findings.append(
                    Finding(
                        "computed_findable",
                        f"group {group}: computed, not cached: {_keys_text(frozenset(lost))}",
                        "every computed full block cached",
                        "release" if last_forward else None,
                    )
                )
        return findings


def eviction_findings(
    visible_before: Keys | None,
    visible_after: Keys | None,
    evicted: list[float],
    spare_duplicates: int,
) -> tuple[list[Finding], Keys]:
    """One call's ``eviction_justified`` finding and the keys it evicted (per group).
    ``evicted[g]``: how many keys the spec's operation evicted on the same state from
    group g; ``spare_duplicates``: the cached free blocks whose key another block caches
    too. The groups share one pool and which group's block goes first is a matter of
    order, so the count is the calls' over every group. A finding's ``operation`` is
    ``duplicate`` when evicting spare copies instead would have kept every key."""
    if visible_before is None or visible_after is None:
        return [], [frozenset() for _ in evicted]
    lost = [before - after for before, after in zip(visible_before, visible_after, strict=True)]
    allowed = sum(evicted)
    count = sum(len(keys) for keys in lost)
    if count <= allowed:
        return [], lost
    text = "; ".join(
        f"group {group}: {_keys_text(keys)}" for group, keys in enumerate(lost) if keys
    )
    spare = allowed + spare_duplicates >= count
    finding = Finding(
        "eviction_justified",
        f"{count} key(s) left the cache: {text}",
        f"at most {allowed:.0f} evicted",
        "duplicate" if spare else None,
    )
    return [finding], lost


def revived_counts(before: Observation, after: Observation) -> list[float]:
    """The bound ``eviction_justified`` takes for a call the spec refuses but the target
    carries out (a declared capacity difference), where the spec's operation evicts
    nothing to compare with: per group, the cached free blocks the call put into that
    group's tables. A key may leave the cache only with its block taken for other
    tokens; a key dropped from a block still free, or more keys than blocks taken, is
    still a finding. (A block revived by a prefix hit keeps its key, so it loosens the
    bound by one without excusing a lost key elsewhere.)"""
    cached_free = set(before.cached_free_block_ids)
    counts = []
    for tables_before, tables_after in zip(before.tables, after.tables, strict=True):
        held = {block_id for table in tables_before.values() for block_id in table.block_ids}
        taken = {block_id for table in tables_after.values() for block_id in table.block_ids}
        counts.append(float(len((taken - held) & cached_free)))
    return counts


def _keys_text(keys: frozenset[spec.CacheKey]) -> str:
    shown = sorted(keys, key=lambda key: (len(key.token_ids), key.token_ids))[:4]
    text = ", ".join(
        ("" if key.cache_salt is None else f"{key.cache_salt}:") + str(list(key.token_ids))
        for key in shown
    )
    return text + (f" and {len(keys) - len(shown)} more" if len(keys) > len(shown) else "")
