"""``CheckSettings``: what ``check_model`` and the main command run, checked when built.

One frozen dataclass holds every setting of a check run (pool, scheduling, sharing,
preemption); building one checks each field's type and range, in field order, and refuses
the first bad one with ``CheckSettingsError`` naming its keyword. ``check_model`` builds it
from its keywords, the main command from its options (naming the flag instead: the message
starts with the keyword, which the command swaps for its flag), so a setting is refused
the same way by both, before a model loads or a tensor is allocated. What depends on the
model or the machine (its context, its vocabulary, memory) is checked later, with the
model in hand, by ``harness.limits``, raising the same error.

Not here: the model, the tokenizer and the prompts (``check_model`` checks them), and the
collaborators a run reports to (an observer, an event log, a progress callback).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TypedDict

from harness.runtime.attention_backends import ATTENTION_BACKENDS
from harness.runtime.preemption import PREEMPT_MODES, PreemptMode
from harness.runtime.user_kernel import UserKernel
from spec import MAX_BLOCK_SIZE, MAX_TOTAL_BLOCKS


class CheckSettingsError(ValueError):
    """A setting, model, tokenizer or prompt no check run can take. ``setting`` is its
    keyword (``"prompts"`` for a prompt); a message about a setting starts with it
    (``"block_size must be in [1, 65,536], got 70,000"``)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting

    def naming_the_option(self) -> str:
        """The message as a command line says it: ``--block-size ...`` for ``block_size ...``."""
        message = str(self)
        if not message.startswith(f"{self.setting} "):
            return message
        return f"--{self.setting.replace('_', '-')}{message.removeprefix(self.setting)}"


def _within(least: int, most: int | None = None) -> Mapping[str, int | None]:
    return {"least": least, "most": most}


def _one_of(choices: Mapping[str, object] | tuple[str, ...]) -> Mapping[str, tuple[str, ...]]:
    return {"choices": tuple(choices)}


@dataclass(frozen=True, slots=True)
class CheckSettings:
    """The settings of a check run, defaulted as the main command defaults its options
    (``python -m harness --help`` says what each means).

    ``total_blocks=None``: about a quarter of what all requests need at once, at least one
    whole request. ``n``: continuations per prompt (forked). ``salts=K``: K cache salts
    (``tenant0`` .. ``tenant{K-1}``) round-robin over the prompts; ``None``: no salt.
    ``preempt``: ``"recompute"`` or ``"swap"`` (to a host tier, recompute when it is
    full). ``host_blocks``: the host tier's blocks, which also keep freed cached prefixes;
    ``None``: as many as the pool with ``"swap"``, none otherwise. ``checkpoint_interval``:
    a hybrid's state checkpoints every that many tokens (a multiple of ``block_size``);
    ``None``: ``harness.state_models.default_interval``. Counts are ``int``
    (not ``bool``, not ``float``), switches ``bool``; ``None`` only where the default is.
    """

    max_new_tokens: int = field(default=64, metadata=_within(1))
    block_size: int = field(default=16, metadata=_within(1, MAX_BLOCK_SIZE))
    total_blocks: int | None = field(default=None, metadata=_within(1, MAX_TOTAL_BLOCKS))
    attention: str | UserKernel = field(
        default="gather", metadata={**_one_of(ATTENTION_BACKENDS), "or_kernel": True}
    )
    prefix_cache: bool = True
    poison_freed: bool = False
    n: int = field(default=1, metadata=_within(1))
    arrival_gap: int = field(default=2, metadata=_within(0))
    batch_invariant: bool = False
    speculate: int | None = field(default=None, metadata=_within(1))
    max_batch_tokens: int | None = field(default=None, metadata=_within(1))
    salts: int | None = field(default=None, metadata=_within(1))
    preempt: PreemptMode = field(default="recompute", metadata=_one_of(PREEMPT_MODES))
    host_blocks: int | None = field(default=None, metadata=_within(1, MAX_TOTAL_BLOCKS))
    checkpoint_interval: int | None = field(default=None, metadata=_within(1))

    def __post_init__(self) -> None:
        for setting in fields(self):
            _check_field(
                setting.name, getattr(self, setting.name), setting.default, setting.metadata
            )
        if self.host_blocks is not None and not self.prefix_cache and self.preempt != "swap":
            raise CheckSettingsError(
                "host_blocks",
                f"host_blocks {self.host_blocks} would hold nothing: a host tier keeps swapped "
                "requests (preempt swap) and cached prefixes (prefix caching on), and this run "
                "has neither",
            )


class CheckSettingsKeywords(TypedDict, total=False):
    """``CheckSettings``'s fields as ``check_model``'s keywords (a test keeps the two equal)."""

    max_new_tokens: int
    block_size: int
    total_blocks: int | None
    attention: str | UserKernel
    prefix_cache: bool
    poison_freed: bool
    n: int
    arrival_gap: int
    batch_invariant: bool
    speculate: int | None
    max_batch_tokens: int | None
    salts: int | None
    preempt: PreemptMode
    host_blocks: int | None
    checkpoint_interval: int | None


def _check_field(name: str, value: object, default: object, rule: Mapping[str, object]) -> None:
    """Refuse ``value`` for the field ``name``: the type of its default (``None`` only where
    that is the default), then its range or its choices."""
    if value is None and default is None:
        return
    choices, least, most = rule.get("choices"), rule.get("least"), rule.get("most")
    if isinstance(choices, tuple):
        kernel = rule.get("or_kernel") is True
        if kernel and callable(value):
            return  # your own kernel (harness.runtime.user_kernel)
        if type(value) is not str or value not in choices:
            mine = " or your kernel (a callable)" if kernel else ""
            raise CheckSettingsError(
                name, f"{name} must be one of {list(choices)}{mine}, got {value!r}"
            )
        return
    wanted = bool if least is None else int
    if type(value) is not wanted:
        optional = " or None" if default is None else ""
        raise CheckSettingsError(
            name,
            f"{name} must be {'a bool' if wanted is bool else 'an int'}{optional}, got "
            f"{type(value).__name__} {value!r}",
        )
    if not isinstance(least, int) or not isinstance(value, int):
        return  # a bool setting: any bool
    if most is None and value < least:
        raise CheckSettingsError(name, f"{name} must be >= {least}, got {value}")
    if isinstance(most, int) and not least <= value <= most:
        raise CheckSettingsError(name, f"{name} must be in [{least}, {most:,}], got {value:,}")


def check_attention_only_settings(settings: CheckSettings) -> None:
    """Refuse, for a model with no recurrent state group, a checkpoint interval given (not
    defaulted): there is no state to checkpoint, so it would change nothing."""
    if settings.checkpoint_interval is not None:
        raise CheckSettingsError(
            "checkpoint_interval",
            f"checkpoint_interval {settings.checkpoint_interval} is for a hybrid model's "
            "recurrent state, and this model has none (its layers are all attention): it "
            "would change nothing",
        )


def check_hybrid_settings(settings: CheckSettings, interval: int, longest_prompt: int) -> None:
    """Refuse, for a hybrid model (a recurrent state group), what its state cannot do, in
    one line each: a checkpoint interval off the block grid (``spec.kinds``) or, given (not
    defaulted), past the last checkpoint a request of at most ``longest_prompt`` tokens can
    take, speculative decoding (a rejected draft would need a state rewind, which no state
    has) and the host tier (a swapped or demoted state is not specified). A kernel
    attention backend runs the attention layers; the state layers run per request beside
    it as beside gather."""
    if interval % settings.block_size:
        raise CheckSettingsError(
            "checkpoint_interval",
            f"checkpoint_interval {interval} is not a multiple of the block size "
            f"{settings.block_size}: a checkpoint ends on a block boundary",
        )
    # A state is checkpointed at C tokens when a token after the C-th is fed (spec.kinds),
    # and the last new token is never fed: a request feeds its prompt and N - 1 new tokens.
    fed = longest_prompt + settings.max_new_tokens - 1
    if settings.checkpoint_interval is not None and settings.checkpoint_interval >= fed:
        raise CheckSettingsError(
            "checkpoint_interval",
            f"checkpoint_interval {interval} would checkpoint no state, so no prefix hit: a "
            f"state is checkpointed at {interval} tokens when a token follows, and the longest "
            f"request feeds {fed} ({longest_prompt} prompt tokens and "
            f"{settings.max_new_tokens - 1} of its {settings.max_new_tokens} new: the last is "
            "not fed)",
        )
    refusals = (
        (
            "speculate",
            settings.speculate is not None,
            "a rejected draft would need the recurrent state rewound, which it cannot be",
        ),
        (
            "preempt",
            settings.preempt == "swap",
            "a recurrent state is not swapped to the "
            "host tier (preemption recomputes from the last checkpoint)",
        ),
        (
            "host_blocks",
            settings.host_blocks is not None,
            "checkpoints are never demoted to a host tier",
        ),
    )
    for setting, refused, why in refusals:
        if refused:
            raise CheckSettingsError(
                setting,
                f"{setting} {getattr(settings, setting)} is refused for a hybrid model: {why}",
            )
