"""A hybrid's state layers on the store's state rows: a per-request wrapper around each
state mixer (LFM2's short convolution, Qwen3-Next's gated DeltaNet).

The engine packs a step's requests into one ``[1, T]`` forward with ``use_cache=False``;
a state mixer would take those rows as one sequence and mix requests. The wrapper, swapped
in for the mixer by ``using_paged_state``, runs the model's own mixer on each request's
rows alone, with a one-layer HF cache whose ``LinearAttentionLayer`` holds views of the
request's state row (``StateRows.views``): HF's ``update_conv_state`` and
``update_recurrent_state`` copy into them in place, with HF's own padding, kernel-size
cut and dtype, and the mixer takes the same prefill or one-token decode path it takes
under ``generate``. A request with no computed token before the step (``prior == 0``)
has no previous state, so its row, fresh or poisoned, is never read: HF's cache returns
no state until ``has_previous_state``.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

from harness.runtime.paged_attention import STEP_KWARG
from harness.runtime.step_batch import StepMetadata
from harness.state_models import StateMixer, state_layers, state_mixer


class PagedStateMixer(nn.Module):
    """Runs ``mixer`` (a state layer's token mixer) per request on the step's state rows."""

    def __init__(
        self,
        mixer: nn.Module,
        layer_idx: int,
        num_layers: int,
        where: StateMixer,
    ) -> None:
        super().__init__()
        self.mixer = mixer
        self.layer_idx = layer_idx
        self.num_layers = num_layers
        self.cache_keyword = where.cache_keyword

    def forward(
        self,
        hidden_states: torch.Tensor,  # [1, T, hidden]
        attention_mask: torch.Tensor | None = None,
        # Any: the decoder layer's keywords (the step, the model's cache, position ids).
        **kwargs: Any,
    ) -> torch.Tensor:
        """Each request's rows through the mixer with its own state; ``[1, T, hidden]``."""
        step = kwargs.get(STEP_KWARG)
        if not isinstance(step, StepMetadata):
            raise TypeError(f"a paged state layer needs a {STEP_KWARG}= StepMetadata")
        if attention_mask is not None:
            raise ValueError("a paged state layer takes no attention mask: it would mix requests")
        plan, states = step.plan, step.store.states
        outputs = []
        for index, part in enumerate(step.slices):
            prior = plan.token_counts[index] - plan.new_token_counts[index]
            cache = self._cache(states.views(self.layer_idx, plan.state_rows[index]), prior)
            outputs.append(
                self.mixer(
                    hidden_states=hidden_states[:, part.query_start : part.query_end],
                    attention_mask=None,
                    **{self.cache_keyword: cache},
                )
            )
        return torch.cat(outputs, dim=1)

    def _cache(self, views: tuple[torch.Tensor, torch.Tensor | None], prior: int) -> Cache:
        """A cache whose layer ``layer_idx`` is the request's state, valid after ``prior``
        tokens (none when ``prior == 0``)."""
        conv, recurrent = views
        layer = LinearAttentionLayer()
        layer.conv_states[0] = conv
        layer.conv_kernel_size[0] = conv.shape[-1]
        layer.is_conv_states_initialized[0] = True
        if recurrent is not None:
            layer.recurrent_states[0] = recurrent
            layer.is_recurrent_states_initialized[0] = True
        layer.has_previous_state[0] = prior > 0
        layers: list[Any] = [DummyLayer() for _ in range(self.num_layers)]
        layers[self.layer_idx] = layer
        return Cache(layers=layers)


@contextmanager
def using_paged_state(model: Any) -> Iterator[None]:  # Any: a transformers PreTrainedModel
    """Swap each state layer's mixer for a ``PagedStateMixer`` while the block runs (nothing
    for a model without state layers)."""
    where = state_mixer(model)
    layers = state_layers(model.config)
    if where is None or not layers:
        yield
        return
    decoder_layers = model.model.layers
    originals = {i: getattr(decoder_layers[i], where.attribute) for i in layers}
    num_layers = model.config.num_hidden_layers
    try:
        for i, mixer in originals.items():
            setattr(
                decoder_layers[i], where.attribute, PagedStateMixer(mixer, i, num_layers, where)
            )
        yield
    finally:
        for i, mixer in originals.items():
            setattr(decoder_layers[i], where.attribute, mixer)
