"""The host tier's K/V: batched copies out and in, their order, poisoning after the copy."""

import pytest
import torch

from harness.kv_layout import KVLayout
from harness.runtime.host_store import HostKVStore
from harness.runtime.kv_pool import PagedKVPool, PoisonedKVPool
from impl import Transfers

LAYOUT = KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32, device=torch.device("cpu")
)


def _filled(pool: PagedKVPool) -> None:
    """Block b of layer l's K holds 100 * l + b, its V the negative."""
    for layer, (keys, values) in enumerate(zip(pool.keys, pool.values, strict=True)):
        for block in range(pool.total_blocks):
            keys[block] = 100 * layer + block
            values[block] = -(100 * layer + block)


def _block_values(tensors: list[torch.Tensor], block: int) -> list[float]:
    """What block ``block`` holds in each tensor (each filled with one value)."""
    values = []
    for tensor in tensors:
        assert (tensor[block] == tensor[block].flatten()[0]).all()
        values.append(float(tensor[block].flatten()[0]))
    return values


def test_a_block_copied_out_and_back_in_lands_whole_in_its_new_block() -> None:
    pool = PagedKVPool(LAYOUT, total_blocks=4, block_size=2, host_blocks=3)
    _filled(pool)
    pool.transfer(Transfers(device_to_host=((1, 2), (3, 0)), host_to_device=()))
    assert _block_values(pool.host.keys + pool.host.values, 2) == [1, 101, -1, -101]
    assert _block_values(pool.host.keys + pool.host.values, 0) == [3, 103, -3, -103]
    pool.transfer(Transfers(device_to_host=(), host_to_device=((0, 1), (2, 0))))
    assert _block_values(pool.keys + pool.values, 1) == [3, 103, -3, -103]
    assert _block_values(pool.keys + pool.values, 0) == [1, 101, -1, -101]


def test_every_copy_out_of_a_batch_is_made_before_any_copy_in() -> None:
    # Host block 1 is copied out to and, in the same batch, into device block 2: device 2
    # must get device 0's K/V, not whatever host block 1 held before.
    pool = PagedKVPool(LAYOUT, total_blocks=3, block_size=2, host_blocks=2)
    _filled(pool)
    pool.transfer(Transfers(device_to_host=((0, 1),), host_to_device=((1, 2),)))
    assert _block_values(pool.keys + pool.values, 2) == [0, 100, 0, -100]


def test_a_batch_is_one_gather_per_tensor_and_direction() -> None:
    pool = PagedKVPool(LAYOUT, total_blocks=8, block_size=2, host_blocks=8)
    calls: list[str] = []
    original = torch.Tensor.index_select

    def counting(tensor: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        calls.append("gather")
        return original(tensor, dim, index)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "index_select", counting)
        pairs = tuple((block, block) for block in range(8))
        pool.transfer(Transfers(device_to_host=pairs, host_to_device=pairs))
    # 2 tensors (K, V) per layer, 2 layers, 2 directions; 8 blocks each way.
    assert len(calls) == 2 * 2 * 2


def test_a_host_tier_holds_as_many_bytes_per_block_as_the_pool() -> None:
    host = HostKVStore(LAYOUT, host_blocks=5, block_size=4)
    pool = PagedKVPool(LAYOUT, total_blocks=5, block_size=4)
    assert host.nbytes == pool.nbytes
    assert not host.pinned
    assert host.keys[0].device.type == "cpu"


def test_a_poisoned_pool_poisons_the_swapped_out_blocks_and_not_their_host_copies() -> None:
    pool = PoisonedKVPool(LAYOUT, total_blocks=3, block_size=2, host_blocks=2)
    _filled(pool)
    pool.transfer(Transfers(device_to_host=((1, 0),), host_to_device=()))
    pool.swap_out("r", [1])
    assert all(tensor[1].isnan().all() for tensor in pool.keys + pool.values)
    assert _block_values(pool.host.keys + pool.host.values, 0) == [1, 101, -1, -101]


def test_a_negative_host_tier_is_refused_with_its_size() -> None:
    with pytest.raises(ValueError, match=r"host_blocks must be >= 0.*-1"):
        HostKVStore(LAYOUT, host_blocks=-1, block_size=2)


def test_a_host_block_beyond_the_tier_is_refused_with_its_numbers() -> None:
    pool = PagedKVPool(LAYOUT, total_blocks=3, block_size=2, host_blocks=2)
    with pytest.raises(ValueError, match="host block 2 is outside this host tier of 2 blocks"):
        pool.transfer(Transfers(device_to_host=((0, 2),), host_to_device=()))
    with pytest.raises(ValueError, match="host block 5 is outside this host tier of 2 blocks"):
        pool.transfer(Transfers(device_to_host=(), host_to_device=((5, 0),)))
