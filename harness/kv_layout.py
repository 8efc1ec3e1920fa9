"""The K/V shape of a model and its KV cache groups: what a pool for it must hold.

Model knowledge, not runtime: ``harness.models`` builds a ``KVLayout`` from a loaded model,
and the pools (``harness.runtime``) and the manager's ``group_windows`` read it. Nothing
here holds a tensor.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The K/V shape of a model: layers, KV heads, head dim, dtype and device.

    ``layer_windows[l]`` is layer ``l``'s sliding window in tokens (its query at position
    ``q`` reads keys ``q - W + 1 .. q``), or ``None`` for full attention; empty when no
    layer has a window.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )

    def window(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s sliding window, or ``None`` for full attention."""
        return self.layer_windows[layer_idx] if self.layer_windows else None

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers, in bytes."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """The window of each KV cache group (``impl.KVCacheManager``'s ``group_windows``)."""
        return tuple(window for window, _ in kv_cache_groups(self.layer_windows, self.num_layers))

    @property
    def group_layers(self) -> tuple[tuple[int, ...], ...]:
        """The layers of each KV cache group, in group order."""
        return tuple(layers for _, layers in kv_cache_groups(self.layer_windows, self.num_layers))

    @property
    def layers_per_block(self) -> int:
        """How many layers' K/V one block holds: the largest group's."""
        return max(len(layers) for layers in self.group_layers)

    @property
    def bytes_per_block_token(self) -> int:
        """K and V of one token in one block (the layers of one group), in bytes; with one
        group of every layer, ``bytes_per_token``."""
        return self.bytes_per_token // self.num_layers * self.layers_per_block


def kv_cache_groups(
    layer_windows: tuple[int | None, ...], num_layers: int
) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
    """The KV cache groups of a model: ``(window, layers)`` each, full attention first, then
    windows from narrowest; every group as large as the fewest layers of one window (the
    last group of a window may be smaller). No windows (``()``): one group of every layer.

    Equal groups let one block hold one layer of each slot for any group (vLLM's hybrid
    allocator groups the same way): Gemma 2's 1:1 layers give ``(None, W)`` of one layer
    each, Gemma 3's 5:1 give one full group and five windowed ones.
    """
    windows = layer_windows or (None,) * num_layers
    order = sorted(set(windows), key=lambda window: -1 if window is None else window)
    by_window = {window: [i for i, w in enumerate(windows) if w == window] for window in order}
    size = min(len(layers) for layers in by_window.values())
    return tuple(
        (window, tuple(layers[start : start + size]))
        for window, layers in by_window.items()
        for start in range(0, len(layers), size)
    )
