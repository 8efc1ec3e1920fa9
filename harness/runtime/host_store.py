"""The host tier's K/V: CPU tensors shaped like the paged pool's blocks, and the batched
copies between the two.

``HostKVStore`` holds per pool tensor (per layer with one KV cache group) one K and one V
tensor ``[host_blocks, block_size, num_kv_heads, head_dim]`` on the CPU, in pinned memory
when the pool is on CUDA. Host block ``h`` is the manager's host block id ``h``; which
blocks move where is the manager's (``take_transfers``), never this module's.

A batch of pairs is one gather and one scatter per tensor and direction (``index_select``
then ``index_copy_`` over every pair at once), not a Python loop per block. The caller
makes every device -> host copy of a batch before any host -> device one
(``PagedKVPool.swap``). It is *not* a ``KVStore``: attention never reads it.
"""

from collections.abc import Sequence

import torch

from harness.kv_layout import KVLayout


class HostKVStore:
    """``host_blocks`` blocks of ``block_size`` tokens in host memory for every pool tensor."""

    __slots__ = ("block_size", "host_blocks", "keys", "layout", "pinned", "values")

    def __init__(self, layout: KVLayout, host_blocks: int, block_size: int) -> None:
        if host_blocks < 0 or block_size < 1:
            raise ValueError(
                f"host_blocks must be >= 0 and block_size >= 1, got {host_blocks}, {block_size}"
            )
        self.layout = layout
        self.host_blocks = host_blocks
        self.block_size = block_size
        # NOTE: pinned (page-locked) host memory lets a CUDA copy run by DMA without a
        # staging copy, and is what makes non_blocking copies asynchronous; on a CPU pool
        # pinning buys nothing (and needs a CUDA build), so plain memory.
        self.pinned = layout.device.type == "cuda"
        shape = (host_blocks, block_size, layout.num_kv_heads, layout.head_dim)
        # keys[i], values[i]: [host_blocks, block_size, num_kv_heads, head_dim] on the CPU,
        # the twin of the pool's tensor i
        self.keys = [
            torch.zeros(shape, dtype=layout.dtype, pin_memory=self.pinned)
            for _ in range(layout.layers_per_block)
        ]
        self.values = [torch.zeros_like(k, pin_memory=self.pinned) for k in self.keys]

    @property
    def nbytes(self) -> int:
        """Bytes the host tier holds for K and V over all layers."""
        return self.host_blocks * self.block_size * self.layout.bytes_per_block_token

    def copy_out(self, device: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device block ``d`` of every tensor in ``device`` (the pool's keys then values,
        ``[total_blocks, block_size, num_kv_heads, head_dim]``) to host block ``h``, for
        every ``(d, h)`` of ``pairs``."""
        if not pairs:
            return
        self._check_host_ids([pair[1] for pair in pairs])
        device_index = _index([pair[0] for pair in pairs], self.layout.device)
        host_index = _index([pair[1] for pair in pairs], torch.device("cpu"))
        # gathered[i]: [len(pairs), block_size, num_kv_heads, head_dim] on the host
        gathered = [self._to_host(tensor.index_select(0, device_index)) for tensor in device]
        if self.pinned:
            # The non_blocking copies above must land before the host reads them.
            torch.cuda.synchronize(self.layout.device)
        for host, rows in zip(self.keys + self.values, gathered, strict=True):
            host.index_copy_(0, host_index, rows)

    def copy_in(self, device: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host block ``h`` to device block ``d`` of every tensor in ``device`` (the
        pool's keys then values), for every ``(h, d)`` of ``pairs``."""
        if not pairs:
            return
        self._check_host_ids([pair[0] for pair in pairs])
        host_index = _index([pair[0] for pair in pairs], torch.device("cpu"))
        device_index = _index([pair[1] for pair in pairs], self.layout.device)
        for tensor, host in zip(device, self.keys + self.values, strict=True):
            # host.index_select(...): [len(pairs), block_size, num_kv_heads, head_dim]
            tensor.index_copy_(0, device_index, self._to_device(host.index_select(0, host_index)))

    def _check_host_ids(self, host_ids: list[int]) -> None:
        """Refuse a host block this tier does not have (a manager with a larger host tier)."""
        largest = max(host_ids)
        if largest >= self.host_blocks:
            raise ValueError(
                f"host block {largest} is outside this host tier of {self.host_blocks} blocks: "
                "the pool's host_blocks must be the manager's"
            )

    def _to_host(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` on the device as a host tensor (pinned, copied without blocking, on CUDA)."""
        if not self.pinned:
            return rows.to("cpu")
        staged = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        return staged.copy_(rows, non_blocking=True)

    def _to_device(self, rows: torch.Tensor) -> torch.Tensor:
        """Host ``rows`` on the pool's device; on CUDA from pinned memory without blocking
        (the copy is queued on the stream before the forward that reads it)."""
        if not self.pinned:
            return rows.to(self.layout.device)
        return rows.pin_memory().to(self.layout.device, non_blocking=True)


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)
