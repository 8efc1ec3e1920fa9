"""The host tier (preemption by swap), with literal block ids, on spec and impl alike."""

from collections.abc import Callable

import pytest

from impl import BlockAllocationError, HostBlockAllocationError, KVCacheManager
from impl.spec_backed import SpecBackedManager
from spec import ReleasedBlocks, RequestBlockTable, Transfers
from tests.support.reading import cached_free_ids, free_ids, is_swapped, ref_count, table

Manager = KVCacheManager | SpecBackedManager
Factory = Callable[..., Manager]


@pytest.fixture(params=[SpecBackedManager, KVCacheManager], ids=["spec", "impl"])
def make(request: pytest.FixtureRequest) -> Factory:
    factory: Factory = request.param
    return factory


def test_a_swap_out_copies_every_block_and_holds_them_in_flight_until_the_copies_are_taken(
    make: Factory,
) -> None:
    pool = make(8, 4, host_blocks=4)
    pool.allocate("a", 9)  # blocks 0, 1, 2
    pool.allocate("b", 4)  # block 3
    assert pool.swap_out("a") == ReleasedBlocks((0, 1, 2), (2, 1, 0), ())
    assert is_swapped(pool, "a") and not is_swapped(pool, "b")
    # In flight: in no queue, not counted free, until the copies out are handed over.
    assert free_ids(pool) == (4, 5, 6, 7)
    assert pool.usage().free_blocks == 4
    assert pool.usage().host_swapped_blocks == 3
    assert pool.take_transfers() == Transfers(device_to_host=((0, 0), (1, 1), (2, 2)))
    # Then they go where release sends them: last block first, to the tail.
    assert list(free_ids(pool)) == [4, 5, 6, 7, 2, 1, 0]
    assert pool.swap_in("a") == (RequestBlockTable("a", (4, 5, 6), 9),)
    assert pool.usage().host_free_blocks == 1  # its host blocks wait for the copies in
    assert pool.take_transfers() == Transfers(host_to_device=((0, 4), (1, 5), (2, 6)))
    usage = pool.usage()
    assert (usage.host_free_blocks, usage.swapped_out_blocks, usage.swapped_in_blocks) == (4, 3, 3)
    pool.append("a", 3)  # it runs on: 12 tokens fill its three blocks
    assert table(pool, "a") == RequestBlockTable("a", (4, 5, 6), 12)


def test_a_block_in_flight_is_handed_to_no_one_before_its_copy_out_is_taken(
    make: Factory,
) -> None:
    pool = make(3, 4, host_blocks=2)
    pool.allocate("a", 8)  # blocks 0, 1
    pool.swap_out("a")
    assert pool.allocate("b", 4).table().block_ids == (2,)
    assert pool.usage().free_blocks == 0
    with pytest.raises(BlockAllocationError, match=r"needed=1 free=0 \(request 'c'\)"):
        pool.allocate("c", 1)
    pool.take_transfers()
    assert pool.allocate("c", 1).table().block_ids == (1,)


@pytest.mark.parametrize("token_count", [9, 0])
def test_a_swap_out_with_no_host_tier_says_so_and_changes_nothing(
    make: Factory, token_count: int
) -> None:
    pool = make(4, 4)
    pool.allocate("a", token_count)
    before = (pool.to_spec(), pool.usage())
    with pytest.raises(HostBlockAllocationError) as refused:
        pool.swap_out("a")
    needed = -(-token_count // 4)
    assert str(refused.value) == (
        f"no host tier to swap request 'a' out to: needed={needed} host_blocks=0"
    )
    assert (refused.value.needed_blocks, refused.value.free_blocks) == (needed, 0)
    assert (pool.to_spec(), pool.usage()) == before


def test_a_swap_out_the_host_tier_cannot_take_is_refused_with_the_numbers_and_changes_nothing(
    make: Factory,
) -> None:
    pool = make(4, 4, host_blocks=2)
    pool.allocate("a", 9)
    with pytest.raises(HostBlockAllocationError) as refused:
        pool.swap_out("a")
    assert str(refused.value) == "not enough free host blocks: needed=3 free=2 (request 'a')"
    assert isinstance(refused.value, BlockAllocationError)
    assert (refused.value.needed_blocks, refused.value.free_blocks) == (3, 2)
    assert table(pool, "a") == RequestBlockTable("a", (0, 1, 2), 9)
    assert free_ids(pool) == (3,)
    assert pool.usage().host_free_blocks == 2
    assert not is_swapped(pool, "a")


def test_a_swap_in_the_device_cannot_take_is_refused_and_changes_nothing(make: Factory) -> None:
    pool = make(3, 4, host_blocks=3)
    pool.allocate("a", 8)
    pool.swap_out("a")
    pool.take_transfers()
    pool.allocate("b", 8)  # blocks 2 and 1
    assert pool.usage().free_blocks == 1  # a needs 2
    with pytest.raises(BlockAllocationError, match=r"needed=2 free=1 \(request 'a'\)"):
        pool.swap_in("a")
    assert is_swapped(pool, "a")
    pool.release("b")
    assert pool.swap_in("a") == (RequestBlockTable("a", (0, 1), 8),)


def test_a_swapped_request_is_known_only_to_swap_in_release_and_the_queries(
    make: Factory,
) -> None:
    pool = make(4, 4, host_blocks=4)
    pool.allocate("a", 5)
    pool.swap_out("a")
    with pytest.raises(ValueError, match="request already has allocated blocks: a"):
        pool.allocate("a", 1)
    with pytest.raises(KeyError, match="request has no allocated blocks: a"):
        pool.append("a", 1)
    with pytest.raises(KeyError, match="request has no allocated blocks: a"):
        pool.swap_out("a")
    with pytest.raises(KeyError, match="request is not swapped out: b"):
        pool.swap_in("b")
    assert "a" not in pool.to_spec().tables


def test_a_swap_out_is_refused_while_a_copy_into_one_of_its_blocks_is_pending(
    make: Factory,
) -> None:
    pool = make(4, 4, host_blocks=4)
    pool.allocate("p", 2)  # block 0, partly filled
    pool.fork("p", "c")
    pool.append("c", 1)  # copy-on-write: (0, 1) pending, c holds block 1
    with pytest.raises(ValueError, match="block 1 awaits a pending copy into it"):
        pool.swap_out("c")
    assert pool.take_transfers().copies == ((0, 1),)
    assert pool.swap_out("c").block_ids == (1,)
    pool.swap_in("c")  # block 2 waits for its copy in
    with pytest.raises(ValueError, match="block 2 awaits a pending copy into it"):
        pool.swap_out("c")


def test_a_shared_block_is_copied_once_and_stays_with_its_other_holder(make: Factory) -> None:
    pool = make(6, 4, host_blocks=4)
    pool.allocate("a", 6)  # blocks 0, 1
    pool.fork("a", "b")
    assert pool.swap_out("a") == ReleasedBlocks((0, 1), (), ())
    assert (ref_count(pool, 0), ref_count(pool, 1)) == (1, 1)
    assert table(pool, "b") == RequestBlockTable("b", (0, 1), 6)
    pool.take_transfers()
    # Swap-in takes fresh blocks: sharing is not restored.
    assert pool.swap_in("a") == (RequestBlockTable("a", (2, 3), 6),)
    assert pool.usage().shared_blocks == 0
    pool.append("b", 1)  # b writes in place: nobody shares block 1 now
    assert pool.take_transfers().copies == ()


def test_releasing_a_swapped_request_drops_its_pending_copies_and_lands_its_blocks(
    make: Factory,
) -> None:
    pool = make(4, 4, host_blocks=4)
    pool.allocate("a", 8)  # blocks 0, 1
    pool.swap_out("a")
    released = pool.release("a")
    assert (released.block_ids, released.freed_block_ids) == ((), (1, 0))
    assert free_ids(pool) == (2, 3, 1, 0)
    assert pool.take_transfers() == Transfers()
    assert pool.usage().host_free_blocks == 4


def test_releasing_a_swapped_request_reports_every_cached_block_it_lands(
    make: Factory,
) -> None:
    pool = make(4, 2, host_blocks=4)
    pool.allocate("a", [1, 2, 3, 4, 5])  # blocks 0 (1, 2) and 1 (3, 4) cached, 2
    pool.swap_out("a")  # all three in flight
    assert pool.release("a") == ReleasedBlocks((), (2,), (1, 0))
    assert (free_ids(pool), cached_free_ids(pool)) == ((3, 2), (1, 0))


def test_a_swap_in_before_the_copies_out_are_taken_reads_what_they_write(make: Factory) -> None:
    pool = make(4, 4, host_blocks=2)
    pool.allocate("a", 5)  # blocks 0, 1
    pool.swap_out("a")
    assert pool.swap_in("a") == (RequestBlockTable("a", (2, 3), 5),)
    # Copies out first, then copies in: host blocks 0 and 1 are written, then read.
    assert pool.take_transfers() == Transfers(
        device_to_host=((0, 0), (1, 1)), host_to_device=((0, 2), (1, 3))
    )
    assert free_ids(pool) == (1, 0)


def test_a_windowed_swap_copies_only_the_blocks_in_the_window(make: Factory) -> None:
    pool = make(6, 1, group_windows=(2,), host_blocks=4)
    pool.allocate("a", 3)  # blocks 0, 1, 2
    pool.append("a", 1)  # at L0 = 3 block index 0 and 1 leave a window of 2
    assert table(pool, "a") == RequestBlockTable("a", (2, 3), 4, 2)
    assert pool.swap_out("a").block_ids == (2, 3)
    pool.take_transfers()
    assert pool.swap_in("a") == (RequestBlockTable("a", (4, 5), 4, 2),)


def test_a_prefix_hit_revives_a_cached_block_in_flight(make: Factory) -> None:
    pool = make(4, 2, host_blocks=2)
    pool.allocate("a", [1, 2, 3])  # blocks 0 (cached, full) and 1
    assert pool.swap_out("a").cached_block_ids == (0,)
    hit = pool.allocate("b", [1, 2, 9])
    assert (hit.table().block_ids, hit.cached_tokens) == ((0, 2), 2)
    pool.take_transfers()  # block 0 is held again: it does not land
    assert free_ids(pool) == (3, 1)
    assert ref_count(pool, 0) == 1


# -- the host prefix cache: cached blocks demoted when freed, revived by a later prompt --

PROMPT = [1, 2, 3, 4, 5]  # two full blocks of 2 (1..2, 1..4) and one token


def test_a_freed_cached_block_is_copied_to_the_host_and_revived_from_it_after_eviction(
    make: Factory,
) -> None:
    pool = make(3, 2, host_blocks=2, host_prefix_cache=True)
    pool.allocate("a", PROMPT)  # blocks 0 (1..2) and 1 (1..4) cached, 2
    pool.release("a")
    # Write-through at free time: 1 and 0 get host copies (the head first) and join the
    # cached free queue at once, where they would go without a host tier.
    assert (free_ids(pool), cached_free_ids(pool)) == ((2,), (1, 0))
    assert pool.take_transfers() == Transfers(device_to_host=((0, 0), (1, 1)))
    assert cached_free_ids(pool) == (1, 0)
    pool.allocate("b", 6)  # takes 2, then evicts 1 and 0 from the device
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 9]) == 4  # found on the host
    pool.release("b")
    hit = pool.allocate("c", [1, 2, 3, 4, 9])
    assert (hit.table().block_ids, hit.cached_tokens) == ((0, 1, 2), 4)
    # Host block 0 holds 1..2 and 1 holds 1..4: copied into the new blocks 0 and 1.
    assert pool.take_transfers() == Transfers(host_to_device=((0, 0), (1, 1)))
    usage = pool.usage()
    assert (usage.host_cached_blocks, usage.host_hit_blocks, usage.prefix_hit_tokens) == (2, 2, 4)
    # The device caches the keys again and the host has them: freed, they are not copied
    # out again, and the next prompt hits them on the device, with no copy.
    pool.release("c")
    assert pool.take_transfers() == Transfers()
    assert pool.allocate("d", [1, 2, 3, 4, 7]).table().block_ids == (0, 1, 2)
    assert pool.take_transfers() == Transfers()


def test_a_prefix_hit_can_take_its_first_block_from_the_device_and_the_next_from_the_host(
    make: Factory,
) -> None:
    pool = make(3, 2, host_blocks=2, host_prefix_cache=True)
    pool.allocate("a", PROMPT)  # blocks 0 (1..2) and 1 (1..4) cached, 2
    pool.release("a")
    assert pool.take_transfers() == Transfers(device_to_host=((0, 0), (1, 1)))
    pool.allocate("b", 4)  # takes 2, then evicts 1 (1..4) from the device; 0 stays cached
    assert table(pool, "b").block_ids == (2, 1)
    pool.release("b")
    hit = pool.allocate("c", [1, 2, 3, 4, 9])
    # 1..2 is a device hit on block 0, 1..4 a host hit on host block 1, copied into 1.
    assert (hit.table().block_ids, hit.cached_tokens) == ((0, 1, 2), 4)
    assert pool.take_transfers() == Transfers(host_to_device=((1, 1),))
    usage = pool.usage()
    assert (usage.host_hit_blocks, usage.prefix_hit_tokens, usage.evictions) == (1, 4, 1)


def test_a_full_host_tier_evicts_its_least_recently_used_prefix_but_never_a_swapped_block(
    make: Factory,
) -> None:
    pool = make(4, 2, host_blocks=2, host_prefix_cache=True)
    pool.allocate("a", [1, 2])  # block 0 cached
    pool.allocate("s", 1)  # block 1
    pool.swap_out("s")  # host block 0
    pool.release("a")  # block 0 demoted to host block 1, the last free one
    assert pool.take_transfers() == Transfers(device_to_host=((1, 0), (0, 1)))
    pool.allocate("b", [3, 4])
    pool.release("b")  # host block 1 (key 1, 2) is evicted for key 3, 4
    assert pool.take_transfers().device_to_host == ((2, 1),)
    assert pool.usage().host_cached_blocks == 1
    assert is_swapped(pool, "s")
    assert pool.swap_in("s") == (RequestBlockTable("s", (3,), 1),)
    assert pool.take_transfers() == Transfers(host_to_device=((0, 3),))


def test_a_demoted_prefix_keeps_its_salt(make: Factory) -> None:
    pool = make(3, 2, host_blocks=2, host_prefix_cache=True)
    pool.allocate("a", [1, 2, 3], "t1")  # block 0 cached under t1
    pool.release("a")
    pool.take_transfers()
    pool.allocate("x", 6)  # evicts block 0 from the device
    pool.release("x")
    assert pool.cached_prefix_tokens([1, 2, 3]) == 0
    assert pool.cached_prefix_tokens([1, 2, 3], "t1") == 2
    assert pool.allocate("b", [1, 2, 3], "t1").cached_tokens == 2


def test_a_host_tier_smaller_than_a_freed_chain_keeps_its_head_and_loses_no_hit(
    make: Factory,
) -> None:
    # Issue 49's reproduction: 13 tokens in blocks of 2 fill blocks 0..5 (cached) and 6.
    # Without a host tier, evicting one block (the tail, 5: a table is freed last block
    # first) leaves a 10-token hit; a 3-block host tier used to cost 6 of those tokens.
    prompt = list(range(1, 14))
    hits = []
    for host_blocks in (0, 3):
        pool = make(9, 2, host_blocks=host_blocks, host_prefix_cache=host_blocks > 0)
        pool.allocate("a", prompt)
        pool.release("a")
        demoted = pool.take_transfers().device_to_host
        assert cached_free_ids(pool) == (5, 4, 3, 2, 1, 0)  # the same with a host tier
        pool.allocate("b", [99] * 8)  # takes 7, 8, 6, then evicts 5
        hits.append(pool.cached_prefix_tokens(prompt))
    # The host copies the chain's head, the blocks every hit on it needs, head first.
    assert demoted == ((0, 0), (1, 1), (2, 2))
    assert hits == [10, 10]


def test_an_eviction_before_its_copy_is_taken_makes_a_demotion_moot(make: Factory) -> None:
    pool = make(3, 2, host_blocks=2, host_prefix_cache=True)
    pool.allocate("a", PROMPT)  # blocks 0 (1..2) and 1 (1..4) cached, 2
    pool.release("a")  # 0 and 1 demoted to host blocks 0 and 1, copies pending
    pool.allocate("b", 4)  # takes 2, then evicts 1 before its copy is taken
    # Block 1 now holds b's K/V: its copy out is dropped, its host key forgotten and host
    # block 1 freed; block 0 (1..2) keeps its demotion.
    assert pool.take_transfers() == Transfers(device_to_host=((0, 0),))
    usage = pool.usage()
    assert (usage.host_cached_blocks, usage.host_free_blocks) == (1, 2)
    assert pool.cached_prefix_tokens(PROMPT) == 2


def test_after_a_host_hit_the_host_still_evicts_a_chain_s_tail_before_its_head(
    make: Factory,
) -> None:
    pool = make(3, 2, host_blocks=2, host_prefix_cache=True)
    pool.allocate("a", PROMPT)  # blocks 0 (1..2) and 1 (1..4) cached, 2
    pool.release("a")  # demoted to host blocks 0 (1..2) and 1 (1..4): the head newer
    pool.take_transfers()
    pool.allocate("x", 6)  # every device block: the host alone caches 1..2 and 1..4
    pool.release("x")
    pool.allocate("c", [1, 2, 3, 4, 9])  # a hit on both host blocks
    pool.release("c")
    pool.take_transfers()
    pool.allocate("x", 6)  # the device forgets them again
    pool.release("x")
    pool.allocate("s", 1)
    pool.swap_out("s")  # takes the least recently used host block: the chain's tail
    assert pool.take_transfers().device_to_host == ((0, 1),)
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 9]) == 2


def _a_prompt_copied_to_the_host(make: Factory) -> Manager:
    """3 blocks of 2, 2 host blocks with a prefix cache: PROMPT's blocks 0 (1..2) and 1
    (1..4) cached, freed, and copied to host blocks 1 and 0; the device still caches them."""
    pool = make(3, 2, host_blocks=2, host_prefix_cache=True)
    pool.allocate("a", PROMPT)
    pool.release("a")
    pool.take_transfers()
    return pool


def test_a_prompt_hitting_the_host_is_refused_without_a_free_device_block_per_host_hit(
    make: Factory,
) -> None:
    pool = _a_prompt_copied_to_the_host(make)
    pool.allocate("b", 4)  # takes 2, then evicts 1 (1..4); 0 (1..2) stays cached and free
    # 1..2 revives block 0 and 1..4 needs a device block to be copied into, plus one for
    # token 9: two blocks, and block 0 was the only free one.
    with pytest.raises(BlockAllocationError, match=r"needed=2 free=0 \(request 'c'\)"):
        pool.allocate("c", [1, 2, 3, 4, 9])
    assert cached_free_ids(pool) == (0,)
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 9]) == 4
    assert pool.take_transfers() == Transfers()
    assert pool.usage().host_hit_blocks == 0
    pool.release("b")
    assert pool.allocate("c", [1, 2, 3, 4, 9]).table().block_ids == (0, 1, 2)


def test_a_prefix_cache_reset_frees_the_host_cached_blocks_but_one_a_copy_in_reads(
    make: Factory,
) -> None:
    pool = _a_prompt_copied_to_the_host(make)
    pool.allocate("b", 6)  # evicts 1 and 0 from the device: the host alone caches them
    pool.release("b")
    pool.allocate("c", [1, 2, 3, 4, 9])  # copies both host blocks in
    pool.release("c")  # the device caches 1..2 and 1..4 again
    pool.allocate("d", [1, 2, 5])  # a device hit: no copy
    assert pool.usage().host_free_blocks == 0
    pool.reset_prefix_cache()
    # Both host blocks are read by the copies in, not taken yet: they stay out of the queue.
    assert pool.usage().host_free_blocks == 0
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 9]) == 0
    pool.take_transfers()
    usage = pool.usage()
    assert (usage.host_free_blocks, usage.host_cached_blocks) == (2, 0)


def test_a_prefix_cache_reset_frees_the_host_cached_blocks_and_keeps_a_swapped_one(
    make: Factory,
) -> None:
    pool = make(4, 2, host_blocks=3, host_prefix_cache=True)
    pool.allocate("s", 1)  # block 0, swapped out to host block 0 below
    pool.allocate("a", PROMPT)  # blocks 1 (1..2) and 2 (1..4) cached, 3
    pool.swap_out("s")
    pool.release("a")  # 2 and 1 demoted to host blocks 1 and 2
    pool.take_transfers()
    assert pool.usage().host_cached_blocks == 2
    pool.reset_prefix_cache()
    usage = pool.usage()
    assert (usage.host_free_blocks, usage.host_cached_blocks) == (2, 0)
    assert pool.cached_prefix_tokens([1, 2, 3, 4, 9]) == 0
    assert is_swapped(pool, "s")


def test_releasing_a_swapped_request_lands_its_blocks_but_not_those_a_copy_out_still_reads(
    make: Factory,
) -> None:
    pool = make(5, 2, host_blocks=4, host_prefix_cache=True)
    pool.allocate("s", 3)  # blocks 0 and 1
    pool.allocate("a", PROMPT)  # blocks 2 (1..2) and 3 (1..4) cached, 4
    pool.swap_out("s")  # 1 and 0 in flight, copied to host blocks 0 and 1
    usage = pool.usage()
    assert (usage.host_blocks, usage.swapped_requests, usage.host_swapped_blocks) == (4, 1, 2)
    pool.release("a")  # 2 and 3 demoted to host blocks 2 and 3, cached free; 4 free
    # Blocks in flight (0 and 1) are used, but no group's table reserves them.
    usage = pool.usage()
    assert (usage.used_blocks, usage.group_reserved_tokens) == (2, (0,))
    assert (free_ids(pool), cached_free_ids(pool)) == ((4,), (3, 2))
    pool.release("s")  # host blocks 0 and 1 freed: their copies are moot, 1 and 0 land
    assert (free_ids(pool), cached_free_ids(pool)) == ((4, 1, 0), (3, 2))
    usage = pool.usage()
    assert (usage.used_blocks, usage.group_reserved_tokens) == (0, (0,))
    assert pool.take_transfers() == Transfers(device_to_host=((2, 2), (3, 3)))
    assert cached_free_ids(pool) == (3, 2)


def test_blocks_a_window_skips_stay_cached_on_the_device_and_are_not_copied_out(
    make: Factory,
) -> None:
    pool = make(8, 2, group_windows=(3,), host_blocks=4, host_prefix_cache=True)
    pool.allocate("a", [1, 2, 3, 4, 5, 6, 7])  # blocks 0..2 cached, 3
    appended = pool.append("a", [8])  # tokens 0..3 out of the window: 0 and 1 go
    assert appended.table() == RequestBlockTable("a", (2, 3), 8, skipped_blocks=2)
    assert cached_free_ids(pool) == (0, 1)
    assert pool.take_transfers() == Transfers()
    assert pool.usage().host_cached_blocks == 0


def test_a_prompt_hits_the_host_in_every_group(make: Factory) -> None:
    pool = make(6, 2, group_windows=(None, None), host_blocks=4, host_prefix_cache=True)
    pool.allocate("a", [1, 2, 3])  # 1..2 cached in block 0 (group 0) and 2 (group 1)
    pool.release("a")
    assert pool.take_transfers() == Transfers(device_to_host=((0, 0), (2, 1)))
    pool.allocate("x", 6)  # every block: 0 and 2 evicted, the host alone caches 1..2
    pool.release("x")
    hit = pool.allocate("c", [1, 2, 9])
    assert (hit.table(), hit.cached_tokens) == (RequestBlockTable("c", (1, 5), 3), 2)
    assert table(pool, "c", 1) == RequestBlockTable("c", (4, 2), 3)
    assert pool.take_transfers() == Transfers(host_to_device=((0, 1), (1, 4)))


def test_the_impl_maps_a_host_tier_with_every_kind_of_record_to_the_spec_state() -> None:
    def run(pool: Manager) -> None:
        pool.allocate("a", [1, 2, 3, 4, 5], "s")  # salted, token ids tracked
        pool.allocate("b", 3)
        pool.allocate("c", [7, 8, 9])
        pool.swap_out("a")
        pool.swap_out("b")
        pool.release("c")  # its full block demoted to the host

    impl, model = (
        kind(16, 2, group_windows=(None, 4), host_blocks=16, host_prefix_cache=True)
        for kind in (KVCacheManager, SpecBackedManager)
    )
    assert isinstance(impl, KVCacheManager) and isinstance(model, SpecBackedManager)
    run(impl)
    run(model)
    assert model.state.host.pending_device_to_host  # copies out pending: blocks in flight
    assert impl.to_spec() == model.state
    impl.take_transfers()
    model.take_transfers()
    assert impl.swap_in("a") == model.swap_in("a")
    assert impl.to_spec() == model.state
    for pool in (impl, model):
        pool.allocate("d", 7)
        pool.append("d", 1)  # group 1 skips two blocks, pending until taken
    assert model.state.pending_skipped_block_ids
    assert impl.to_spec() == model.state
    for pool in (impl, model):
        pool.allocate("x", pool.usage().free_blocks)  # evicts c's cached blocks from the device
        pool.release("x")
        assert pool.allocate("e", [7, 8, 0]).cached_tokens == 2  # a host hit
    assert impl.to_spec() == model.state


def test_a_window_sliding_past_blocks_a_copy_out_reads_cannot_count_them_as_free(
    make: Factory,
) -> None:
    pool = make(3, 2, group_windows=(3,), host_blocks=3)
    pool.allocate("a", 6)  # blocks 0, 1, 2
    pool.fork("a", "b")
    pool.swap_out("b")  # copies 0, 1 and 2 out; they stay with a
    # Token 7 slides a's window past 0 and 1, which go in flight, not free: nothing free.
    with pytest.raises(BlockAllocationError, match=r"needed=1 free=0 \(request 'a'\)"):
        pool.append("a", 1)
    assert table(pool, "a") == RequestBlockTable("a", (0, 1, 2), 6)
    pool.take_transfers()
    assert pool.append("a", 1).table() == RequestBlockTable("a", (2, 0), 7, skipped_blocks=2)


def test_a_swap_of_three_groups_brings_each_group_its_own_host_copies_back(
    make: Factory,
) -> None:
    pool = make(12, 4, group_windows=(None, None, None), host_blocks=6)
    pool.allocate("a", 5)  # groups 0, 1, 2: blocks [0, 1], [2, 3], [4, 5]
    pool.swap_out("a")
    assert pool.take_transfers().device_to_host == tuple((b, b) for b in range(6))
    assert pool.swap_in("a") == tuple(
        RequestBlockTable("a", ids, 5) for ids in ((6, 7), (8, 9), (10, 11))
    )
    assert pool.take_transfers().host_to_device == (
        (0, 6),
        (1, 7),
        (2, 8),
        (3, 9),
        (4, 10),
        (5, 11),
    )


def test_a_host_hit_makes_its_host_blocks_the_most_recently_used_while_the_request_runs(
    make: Factory,
) -> None:
    pool = make(3, 2, host_blocks=2, host_prefix_cache=True)
    for request_id, prompt in (("a", [1, 2]), ("b", [5, 6])):
        pool.allocate(request_id, prompt)  # one full block, cached
        pool.release(request_id)  # demoted: host blocks 0 (1, 2), then 1 (5, 6)
        pool.take_transfers()
    pool.allocate("x", 6)  # every device block: the host alone caches both
    pool.release("x")
    pool.allocate("c", [1, 2, 9])  # a host hit on (1, 2): its host block is now the newest
    pool.take_transfers()
    pool.allocate("s", 1)
    pool.swap_out("s")  # while c runs: the least recently used host block goes, (5, 6)'s
    assert pool.take_transfers().device_to_host == ((2, 1),)
    assert pool.cached_prefix_tokens([5, 6, 9]) == 0
    assert pool.cached_prefix_tokens([1, 2, 9]) == 2
