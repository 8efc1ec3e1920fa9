"""Where a hybrid's recurrent states live: rows of per-layer state tensors, one row per
block id of the state group (the paged pool) or per request (the gate's contiguous twin).

For each state layer: conv rows ``[rows, *conv_shape]`` in the conv state's dtype and, for
a layer with one (gated DeltaNet), recurrent rows ``[rows, *recurrent_shape]`` in the
recurrent state's dtype (float32 even in a bf16 model, as HF keeps it). The state group
hands each request one block id, its running state; a checkpoint is a cached block id
whose row nobody writes again; a hit, a fork's first write and a checkpoint all copy a
row to a fresh one (``copy``, in the manager's copy-on-write order). The rows are
separate tensors beside the K/V pages, not carved out of them as vLLM's shared pages are:
``nbytes`` says what they cost.
"""

from collections.abc import Sequence

import torch

from harness.kv_layout import KVLayout


class StateRows:
    """``rows`` rows of every state layer's states (none for a model without any)."""

    __slots__ = ("_conv", "_recurrent", "layers", "rows")

    def __init__(self, layout: KVLayout, rows: int) -> None:
        self.layers = layout.state_layers
        self.rows = rows
        device = layout.device
        # _conv[i]: [rows, *conv_shape] for state layer layers[i]; _recurrent[i] likewise,
        # or None for a layer without a recurrent state.
        self._conv = [
            torch.zeros((rows, *shape.conv_shape), dtype=shape.conv_dtype, device=device)
            for shape in layout.state_shapes
        ]
        self._recurrent = [
            None
            if shape.recurrent_shape is None or shape.recurrent_dtype is None
            else torch.zeros(
                (rows, *shape.recurrent_shape), dtype=shape.recurrent_dtype, device=device
            )
            for shape in layout.state_shapes
        ]

    @property
    def nbytes(self) -> int:
        """Bytes every row of every state layer holds."""
        return sum(tensor.nbytes for tensor in self._tensors())

    def views(self, layer_idx: int, row: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``layer_idx``'s conv and recurrent state in ``row``, as ``[1, *shape]``
        views: what HF's ``LinearAttentionLayer`` writes in place (``copy_``)."""
        index = self.layers.index(layer_idx)
        recurrent = self._recurrent[index]
        return (
            self._conv[index][row : row + 1],
            None if recurrent is None else recurrent[row : row + 1],
        )

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy each ``(source, destination)`` row, in order (a destination may be a later
        pair's source)."""
        for source, destination in pairs:
            for tensor in self._tensors():
                tensor[destination] = tensor[source]

    def fill(self, rows: Sequence[int], value: float) -> None:
        """``value`` into ``rows`` of every state tensor (the poisoned pools' NaN)."""
        if not rows or not self.layers:
            return
        index = torch.tensor(list(rows), dtype=torch.int64, device=self._conv[0].device)
        for tensor in self._tensors():
            tensor.index_fill_(0, index, value)

    def grow(self, rows: int) -> None:
        """Hold ``rows`` rows (at least as many as now), the old rows kept, new ones zero."""
        self._conv = [grown_rows(tensor, rows) for tensor in self._conv]
        self._recurrent = [
            None if tensor is None else grown_rows(tensor, rows) for tensor in self._recurrent
        ]
        self.rows = rows

    def _tensors(self) -> list[torch.Tensor]:
        return [*self._conv, *(t for t in self._recurrent if t is not None)]


def grown_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` ``[old_rows, ...]`` copied into a zeroed ``[rows, ...]`` tensor."""
    grown = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    grown[: tensor.shape[0]] = tensor
    return grown
