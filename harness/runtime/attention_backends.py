"""Which attention computes a step: ``gather`` (the reference) or a paged kernel behind one seam.

``--attention`` picks one of ``ATTENTION_BACKENDS``:
- ``gather``: today's path in ``harness.runtime.paged_attention``, each request's K/V
  gathered from the store and one SDPA per request; the default and the bitwise reference;
- ``varlen-emulated``: ``harness.runtime.varlen_emulator``, the varlen kernel's contract
  in plain PyTorch (CPU or CUDA);
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention with a block
  table), CUDA, fp16/bf16 and a block size that is a multiple of 256 only;
- ``flex``: compiled FlexAttention with a block mask (``harness.runtime.flex_paged``);
- ``triton``: the project's own Triton kernel (``harness.runtime.triton_paged``), compiled
  on CUDA, run by Triton's interpreter on CPU (``TRITON_INTERPRET=1``, float32).
Every kernel backend reads the store's per-layer tensors in place as pages through one
``StepTensors`` built per step (``prepare``), and writes through the store as gather does.
A backend refuses, in one line (``AttentionBackendError``), what it cannot compute: the
models with sliding windows or attention-logit softcapping (gather's alone), and each
kernel's own limits. This module is the seam; it holds no kernel.
"""

import importlib.util
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from harness.kv_layout import KVLayout
from harness.runtime.flex_paged import flex_attention_paged, flex_block_mask, flex_limits
from harness.runtime.kv_pool import FinitePoisonedKVPool, PoisonedKVPool
from harness.runtime.kv_store import KVPlan, KVStore
from harness.runtime.step_tensors import StepTensors, build_step_tensors
from harness.runtime.varlen_emulator import varlen_attention_emulated
from harness.runtime.varlen_kernel import varlen_attention, varlen_limits
from spec import RequestBlockTable


class AttentionBackendError(ValueError):
    """A backend cannot run this model, dtype, device or block size (one line, with numbers)."""


@runtime_checkable
class PagedStore(KVStore, Protocol):
    """A store a kernel reads in place: per layer ``[blocks, block_size, kv_heads, head_dim]``
    pages and, per request, the pages that hold its tokens in order."""

    layout: KVLayout
    block_size: int

    def pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def block_ids_of(self, table: RequestBlockTable) -> list[int]: ...


@dataclass(slots=True)
class LayerAgreement:
    """Per layer, the largest |kernel - gather| over every output element of a run."""

    max_abs_diff: dict[int, float] = field(default_factory=dict)

    def record(self, layer_idx: int, kernel: torch.Tensor, gather: torch.Tensor) -> None:
        """Fold one step's outputs of layer ``layer_idx`` in."""
        difference = float((kernel.float() - gather.float()).abs().max())
        self.max_abs_diff[layer_idx] = max(self.max_abs_diff.get(layer_idx, 0.0), difference)


# One step's call: (layer_idx, query [T, num_heads, head_dim], scale) -> [T, num_heads, head_dim]
Attend = Callable[[int, torch.Tensor, float], torch.Tensor]


@dataclass(frozen=True, slots=True)
class KernelStep:
    """One step through a kernel backend: its call, and where to fold the agreement in."""

    attend: Attend
    agreement: LayerAgreement | None


class AttentionBackend(Protocol):
    """A way to compute the step's attention; ``prepare`` is called once per step."""

    @property
    def name(self) -> str: ...

    @property
    def poisoned_pool_type(self) -> type[PoisonedKVPool]:
        """The ``--poison-freed`` pool whose poison this backend tolerates in masked rows."""
        ...

    def check(self, model: Any, layout: KVLayout, block_size: int) -> None:  # Any: HF model
        """Raise ``AttentionBackendError`` for what this backend cannot run."""
        ...

    def prepare(
        self, store: KVStore, tables: Sequence[RequestBlockTable], plan: KVPlan
    ) -> KernelStep | None:
        """The step's kernel call, or ``None`` for the gather path."""
        ...


@dataclass(frozen=True, slots=True)
class Gather:
    """Today's path: ``paged_attention`` gathers and runs SDPA per request."""

    name: str = "gather"
    poisoned_pool_type: type[PoisonedKVPool] = PoisonedKVPool

    def check(self, model: Any, layout: KVLayout, block_size: int) -> None:  # Any: HF model
        """Gather runs whatever the hook runs (``harness.models.check_supported`` decides)."""

    def prepare(
        self, store: KVStore, tables: Sequence[RequestBlockTable], plan: KVPlan
    ) -> KernelStep | None:
        """No kernel: the hook's own loop."""
        return None


# The kernel itself: (query [T, H, D], (key pages, value pages), step tensors, scale,
# prepared) -> [T, H, D]; ``prepared`` is what the backend's ``precompute`` made of the
# step, once.
Kernel = Callable[
    [torch.Tensor, tuple[torch.Tensor, torch.Tensor], StepTensors, float, Any], torch.Tensor
]


@dataclass(frozen=True, slots=True)
class PagedKernel:
    """A kernel backend: step tensors once per step, then one kernel call per layer.

    ``limits`` refuses what the kernel cannot run; ``precompute`` turns the step tensors
    into anything else the kernel wants once per step (FlexAttention's block mask).
    """

    name: str
    kernel: Kernel
    limits: Callable[[KVLayout, int], list[str]]
    precompute: Callable[[StepTensors, PagedStore], Any]
    poisoned_pool_type: type[PoisonedKVPool] = PoisonedKVPool
    agreement: LayerAgreement | None = None

    def check(self, model: Any, layout: KVLayout, block_size: int) -> None:  # Any: HF model
        """Refuse a model with a sliding window or softcapping, and the kernel's limits."""
        refusals = [*unsupported_by_kernels(model.config), *self.limits(layout, block_size)]
        if refusals:
            raise AttentionBackendError(
                f"--attention {self.name} cannot run this: " + "; ".join(refusals)
            )

    def prepare(
        self, store: KVStore, tables: Sequence[RequestBlockTable], plan: KVPlan
    ) -> KernelStep | None:
        """Build the step's tensors from the store's pages of each request."""
        if not isinstance(store, PagedStore):
            raise TypeError(f"--attention {self.name} needs a store with pages, got {store!r}")
        tensors = build_step_tensors(
            [store.block_ids_of(table) for table in tables],
            plan.token_counts,
            plan.new_token_counts,
            store.block_size,
            store.layout.device,
        )
        prepared = self.precompute(tensors, store)
        kernel = self.kernel

        def attend(layer_idx: int, query: torch.Tensor, scale: float) -> torch.Tensor:
            return kernel(query, store.pages(layer_idx), tensors, scale, prepared)

        return KernelStep(attend, self.agreement)


def unsupported_by_kernels(config: Any) -> list[str]:  # Any: a transformers config
    """What no kernel backend here computes: a sliding window, attention-logit softcapping.

    NOTE: gather may learn these (another branch adds them to the hook); the kernels are
    given no window and no softcap, so such a model is refused rather than run wrong.
    """
    refusals = []
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) is not False:
        refusals.append(f"sliding_window={window}")
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        refusals.append("layer_types with sliding_attention")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        refusals.append(f"attn_logit_softcapping={softcap}")
    return refusals


def default_scale(head_dim: int) -> float:
    """SDPA's scale when the model gives none: ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)


def no_limits(layout: KVLayout, block_size: int) -> list[str]:
    """A kernel's ``limits`` when it refuses nothing beyond what every kernel does."""
    return []


def nothing_precomputed(tensors: StepTensors, store: PagedStore) -> None:
    """A kernel's ``precompute`` when it needs nothing but the step tensors."""
    return None


def _emulated(
    query: torch.Tensor,
    pages: tuple[torch.Tensor, torch.Tensor],
    tensors: StepTensors,
    scale: float,
    prepared: Any,  # Any: nothing is precomputed for the emulator
) -> torch.Tensor:
    return varlen_attention_emulated(query, *pages, tensors, scale)


VARLEN_EMULATED = PagedKernel("varlen-emulated", _emulated, no_limits, nothing_precomputed)


def _flex_mask(tensors: StepTensors, store: PagedStore) -> Any:  # Any: a BlockMask
    return flex_block_mask(tensors, store.pages(0)[0].shape[0])


def _triton(
    query: torch.Tensor,
    pages: tuple[torch.Tensor, torch.Tensor],
    tensors: StepTensors,
    scale: float,
    prepared: Any,  # Any: nothing is precomputed for the Triton kernel
) -> torch.Tensor:
    # Imported on first use: importing triton fixes the process's Triton mode
    # (interpreter or GPU), which a process that never runs this backend should not do.
    from harness.runtime.triton_paged import triton_paged_attention  # noqa: PLC0415

    return triton_paged_attention(query, pages, tensors, scale, prepared)


def _triton_limits(layout: KVLayout, block_size: int) -> list[str]:
    if importlib.util.find_spec("triton") is None:
        return ["triton is not installed (pip install triton; the CUDA torch wheels bring it)"]
    from harness.runtime.triton_paged import triton_limits  # noqa: PLC0415

    return triton_limits(layout, block_size)


GATHER = Gather()
VARLEN = PagedKernel("varlen", varlen_attention, varlen_limits, nothing_precomputed)
TRITON = PagedKernel("triton", _triton, _triton_limits, nothing_precomputed)
FLEX = PagedKernel(
    "flex", flex_attention_paged, flex_limits, _flex_mask, poisoned_pool_type=FinitePoisonedKVPool
)
ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    backend.name: backend for backend in (GATHER, VARLEN_EMULATED, VARLEN, FLEX, TRITON)
}
