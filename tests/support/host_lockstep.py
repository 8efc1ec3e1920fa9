"""The lockstep state machine with a host tier: every rule of ``tests.support.lockstep``
(the swap operations among them) on pools of 0 to 6 host blocks, with and without the host
prefix cache (cached blocks demoted when freed, copied back by later prompts' hits), and
the engine's sequences of swaps.

``HostTierMachine`` drives spec and impl as ``AllocatorMachine`` does (the same ``_step``,
the same whole-state comparison after every step, refused ones included); its rules
swap running and unknown requests out and in at any time, so swaps meet forks, prefix
hits, copy-on-write, rollbacks and releases of swapped requests with copies still
pending. ``WindowedHostTierMachine`` is the same on pools with sliding windows.
"""

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

import spec
from tests.support.lockstep import (
    GROUP_WINDOWS,
    PROMPTS,
    REQUEST_IDS,
    SALTS,
    AllocatorMachine,
    WindowedAllocatorMachine,
)


class HostTierMachine(AllocatorMachine):
    """``AllocatorMachine`` with a host tier of 0 to 6 blocks and the swap operations."""

    @initialize(
        total_blocks=st.integers(1, 12),
        block_size=st.integers(1, 5),
        host_blocks=st.integers(0, 6),
        host_prefix_cache=st.booleans(),
    )
    def init_pool(
        self, total_blocks: int, block_size: int, host_blocks: int, host_prefix_cache: bool
    ) -> None:
        host_prefix_cache = host_prefix_cache and host_blocks > 0  # refused with none
        self.model = spec.init(
            total_blocks, block_size, host_blocks=host_blocks, host_prefix_cache=host_prefix_cache
        )
        self.target = self.target_class(
            total_blocks,
            block_size,
            event_sink=self.record,
            host_event_sink=self.record_host,
            host_blocks=host_blocks,
            host_prefix_cache=host_prefix_cache,
        )

    @precondition(lambda self: len(self.model.tables) > 0)
    @rule(data=st.data())
    def preempt_by_swap_and_resume(self, data: st.DataObject) -> None:
        """The engine's preemption by swap: take the step's copies, swap the request out,
        let the others run a token, take the copies, swap it back in when it fits."""
        request_id = data.draw(st.sampled_from(sorted(self.model.tables)))
        self._step("take_transfers")
        if self._step("swap_out", request_id) is None:
            return
        for other in sorted(self.model.tables):
            self._add_tokens(other, 1, data)
        self._step("take_transfers")
        self._step("swap_in", request_id)

    @precondition(lambda self: len(self.model.host.swapped) > 0)
    @rule(data=st.data(), then_take=st.booleans())
    def release_a_swapped_request(self, data: st.DataObject, then_take: bool) -> None:
        """A swapped request finished or cancelled, its copies out taken or still pending."""
        request_id = data.draw(st.sampled_from(sorted(self.model.host.swapped)))
        self._step(data.draw(st.sampled_from(["release", "preempt"])), request_id)
        if then_take:
            self._step("take_transfers")

    @rule(request_id=REQUEST_IDS)
    def swap_out_and_straight_back_in(self, request_id: str) -> None:
        """Swap-in before the copies out are taken: the copies in read what they write."""
        if self._step("swap_out", request_id) is not None:
            self._step("swap_in", request_id)

    @precondition(lambda self: self.model.host.host_prefix_cache)
    @rule(request_id=REQUEST_IDS, token_ids=PROMPTS, cache_salt=SALTS)
    def demote_evict_and_revive_a_prefix(
        self, request_id: str, token_ids: tuple[int, ...], cache_salt: str | None
    ) -> None:
        """The host prefix cache's round trip: a prompt's blocks cached, freed (demoted),
        evicted from the device by a count allocation of every free block, then the same
        prompt again under the same salt: its hit comes back from the host."""
        if self._step("allocate", request_id, token_ids, cache_salt) is None:
            return
        self._step("release", request_id)
        self._step("take_transfers")
        filler = (
            self.model.block_size * spec.free_blocks(self.model) // len(self.model.group_windows)
        )
        if self._step("allocate", request_id, filler) is not None:
            self._step("release", request_id)
        self._step("take_transfers")
        self._step("allocate", request_id, token_ids, cache_salt)


class WindowedHostTierMachine(HostTierMachine, WindowedAllocatorMachine):
    """``HostTierMachine`` on pools shared by KV cache groups with sliding windows."""

    @initialize(
        total_blocks=st.integers(1, 12),
        block_size=st.integers(1, 5),
        group_windows=GROUP_WINDOWS,
        host_blocks=st.integers(0, 6),
        host_prefix_cache=st.booleans(),
    )
    def init_pool(
        self,
        total_blocks: int,
        block_size: int,
        group_windows: tuple[int | None, ...],
        host_blocks: int,
        host_prefix_cache: bool,
    ) -> None:
        host_prefix_cache = host_prefix_cache and host_blocks > 0  # refused with none
        self.model = spec.init(
            total_blocks, block_size, group_windows, host_blocks, host_prefix_cache
        )
        self.target = self.target_class(
            total_blocks,
            block_size,
            group_windows=group_windows,
            event_sink=self.record,
            host_event_sink=self.record_host,
            host_blocks=host_blocks,
            host_prefix_cache=host_prefix_cache,
        )
