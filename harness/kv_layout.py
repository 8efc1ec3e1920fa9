"""The K/V shape of a model and its KV cache groups: what a pool for it must hold.

Model knowledge, not runtime: ``harness.models`` builds a ``KVLayout`` from a loaded model,
and the pools (``harness.runtime``) and the manager's ``group_windows`` read it. Nothing
here holds a tensor.
"""

import math
from dataclasses import dataclass

import torch

from spec import GroupKind, RecurrentState
from spec.kinds import group_kind


@dataclass(frozen=True, slots=True)
class StateShape:
    """One state layer's per-request state: its conv state's shape and dtype, and its
    recurrent state's (``None`` for a pure short convolution), batch dimension left out."""

    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    recurrent_shape: tuple[int, ...] | None = None
    recurrent_dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        """One request's state, conv and recurrent, in bytes."""
        total = math.prod(self.conv_shape) * self.conv_dtype.itemsize
        if self.recurrent_shape is not None and self.recurrent_dtype is not None:
            total += math.prod(self.recurrent_shape) * self.recurrent_dtype.itemsize
        return total


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
    # A hybrid's recurrent state layers (short convolution, gated DeltaNet): one state
    # group of all of them, checkpointed every ``checkpoint_interval`` tokens; their
    # state tensors' shapes are ``state_shapes`` (``harness.runtime.state_store``).
    state_layers: tuple[int, ...] = ()
    checkpoint_interval: int = 0
    state_shapes: tuple[StateShape, ...] = ()
    # The state layers that attend too (Falcon-H1: attention and Mamba side by side in one
    # layer): the pool holds their K/V as well as their state.
    attending_state_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )
        if len(self.state_shapes) != len(self.state_layers):
            raise ValueError(
                f"state_shapes has {len(self.state_shapes)} entries for "
                f"{len(self.state_layers)} state layers"
            )

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers whose K/V the pool holds: every layer but the state layers that do
        not attend."""
        return tuple(
            i
            for i in range(self.num_layers)
            if i not in self.state_layers or i in self.attending_state_layers
        )

    def window(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s sliding window, or ``None`` for full attention."""
        return self.layer_windows[layer_idx] if self.layer_windows else None

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers, in bytes."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim * element_size

    @property
    def state_bytes_per_block(self) -> int:
        """The state rows of one block id over all state layers, in bytes (0 without)."""
        return sum(shape.nbytes for shape in self.state_shapes)

    @property
    def group_windows(self) -> tuple[GroupKind, ...]:
        """The kind of each KV cache group (``impl.KVCacheManager``'s ``group_windows``):
        the attention groups' windows, then ``RecurrentState(checkpoint_interval)`` for a
        hybrid's state group."""
        groups = enumerate(self._attention_groups())
        windows = tuple(group_kind(group, window) for group, (window, _) in groups)
        if self.state_layers:
            windows += (RecurrentState(self.checkpoint_interval),)
        return windows

    @property
    def group_layers(self) -> tuple[tuple[int, ...], ...]:
        """The layers of each KV cache group, in group order (a state group last)."""
        layers = tuple(layers for _, layers in self._attention_groups())
        return layers + ((self.state_layers,) if self.state_layers else ())

    @property
    def state_group(self) -> int | None:
        """The index of the state group (the last), or ``None`` without state layers."""
        return len(self.group_layers) - 1 if self.state_layers else None

    @property
    def layers_per_block(self) -> int:
        """How many layers' K/V one block holds: the largest attention group's."""
        return max(len(layers) for _, layers in self._attention_groups())

    @property
    def bytes_per_block_token(self) -> int:
        """K and V of one token in one block (the layers of one group), in bytes; with one
        group of every layer, ``bytes_per_token``."""
        return self.bytes_per_token // len(self.attention_layers) * self.layers_per_block

    def _attention_groups(self) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
        layers = self.attention_layers
        windows = tuple(self.window(i) for i in layers) if self.layer_windows else ()
        groups = kv_cache_groups(windows, len(layers))
        return tuple((window, tuple(layers[i] for i in group)) for window, group in groups)


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
