"""What the conformance kit refuses to run: a factory or an adapter that breaks the adapter
contract (docs/conformance.md, "Your own allocator"), and arguments out of range.

``validated_adapter(factory)`` checks the factory and the adapter it makes before the first
step; ``observed(adapter, when)`` checks the adapter's view of the target at every step of
the run. A fault is an ``AdapterError``, one line that names the adapter and what is wrong
(the command line's exit 2), never a discrepancy (exit 1): only the target's operations can
disagree with the spec, and the spec judges what they raise (``raises_only_refusals``).
What ``observe()`` and ``take_events()`` raise, and what a factory raises, is the
adapter's: no operation of the target ran in them (an engine adapter's ``step`` raising
outside a ``ServerError`` too: ``harness.conformance.machine``).

The adapter's shape is checked with the spec's own checks (``spec.errors``): the block size
and the pool's size as a spec pool's (so a pool larger than ``spec.MAX_TOTAL_BLOCKS``, which
the spec refuses, is refused at once, before a block id is read), the KV cache groups as
the spec's ``group_windows``.

Not here: what the target does (``harness.conformance.judge``).
"""

import contextlib
import inspect
import math
from collections.abc import Callable, Collection, Iterator, Mapping

from harness.conformance.adapter import (
    CACHE_SALT,
    KV_EVENTS,
    OPERATION_NAMES,
    Adapter,
    EngineAdapter,
    Observation,
    is_engine,
)
from harness.conformance.events import EVENT_RULES
from harness.conformance.properties import (
    ABSOLUTE_PROPERTIES,
    OBSERVATION_PROPERTIES,
    STATE_PROPERTIES,
    STEP_PROPERTIES,
)
from harness.named_callables import one_line
from spec.errors import check_pool_shape
from spec.kinds import group_kinds

Target = Adapter | EngineAdapter

# What ``supports`` may name beside the operations an operation adapter has.
MARKERS = (CACHE_SALT, KV_EVENTS)
# An operation adapter's run starts with a request admitted by one of these.
ADMITTING = ("allocate_prompt", "allocate")
ENGINE_METHODS = ("submit", "step", "abort")
PROPERTY_NAMES = frozenset().union(
    STATE_PROPERTIES, OBSERVATION_PROPERTIES, STEP_PROPERTIES, ABSOLUTE_PROPERTIES, EVENT_RULES
)


class AdapterError(ValueError):
    """The adapter, or the factory that makes it, breaks the adapter contract: no step of the
    target is judged. A ``ValueError`` whatever the fault (a wrong type too), so that one
    ``except`` catches every refusal of the kit's input."""


def check_run_arguments(
    *, steps: object, seed: object, shrink_seconds: object, progress_every_s: object
) -> None:
    """Refuse a run's arguments: ``steps`` an ``int`` of at least 1, ``seed`` an ``int``,
    ``shrink_seconds`` and ``progress_every_s`` finite numbers of at least 0 (TypeError for
    the type, ValueError for the value; ``bool`` is no number here)."""
    for name, value in (("steps", steps), ("seed", seed)):
        if type(value) is not int:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    assert isinstance(steps, int)
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    for name, value in (("shrink_seconds", shrink_seconds), ("progress_every_s", progress_every_s)):
        if type(value) not in (int, float):
            raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
        assert isinstance(value, int | float)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number of at least 0, got {value}")


def validated_adapter(factory: Callable[[], Target]) -> Target:
    """The first adapter ``factory`` makes, once the factory and the adapter are found to keep
    the contract: a fresh adapter per call (it is called twice), every declared attribute
    well formed, ``observe()`` an ``Observation`` of the declared groups on a fresh one.
    ``AdapterError`` names the first fault."""
    if not callable(factory):
        raise AdapterError(
            f"the factory must be callable, got {type(factory).__name__} {factory!r}"
        )
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise AdapterError(
            f"factory {_factory_name(factory)} must take no arguments (the kit calls it "
            f"with none, once per test case), its signature is {inspect.signature(factory)}"
        ) from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    first = made(factory)
    if made(factory) is first:
        raise AdapterError(
            f"factory {_factory_name(factory)} returned the same adapter twice: it must "
            "return a fresh allocator at every call (one per test case)"
        )
    _check_shape(first)
    observed(first, "on a fresh adapter")
    return first


def made(factory: Callable[[], Target]) -> Target:
    """What ``factory()`` returns, refused (``AdapterError``) if it raises or returns no
    adapter: ``None``, or a class rather than an instance of it."""
    try:
        adapter: object = factory()
    except Exception as error:
        raise AdapterError(f"factory {_factory_name(factory)} raised {one_line(error)}") from error
    if adapter is None or isinstance(adapter, type):
        what = "None" if adapter is None else f"the class {adapter.__name__}"
        raise AdapterError(
            f"factory {_factory_name(factory)} returned {what}, not an adapter "
            "(an instance with observe(): docs/conformance.md, 'Your own allocator')"
        )
    return adapter  # type: ignore[return-value]


def observed(adapter: Target, when: str) -> Observation:
    """``adapter.observe()``, refused (``AdapterError``, naming ``when``) if it raises or is
    not an ``Observation`` with one table mapping per declared KV cache group."""
    with blamed_on_adapter(adapter, "observe()", when):
        observation = adapter.observe()
    if not isinstance(observation, Observation):
        raise AdapterError(
            f"adapter {_name(adapter)}: observe() must return an Observation, got "
            f"{type(observation).__name__} {when}"
        )
    groups = len(adapter.group_windows)
    if len(observation.tables) != groups:
        raise AdapterError(
            f"adapter {_name(adapter)}: observe() showed tables for "
            f"{len(observation.tables)} KV cache group(s), group_windows declares {groups}, {when}"
        )
    return observation


@contextlib.contextmanager
def blamed_on_adapter(adapter: Target, call: str, when: str) -> Iterator[None]:
    """Run one of the adapter's own calls (not an operation of its target): what it raises is
    the adapter's fault, an ``AdapterError`` naming ``call`` and ``when``."""
    try:
        yield
    except AdapterError:
        raise
    except Exception as error:
        raise AdapterError(
            f"adapter {_name(adapter)}: {call} raised {one_line(error)} {when}"
        ) from error


def _check_shape(adapter: Target) -> None:
    """Refuse the first attribute of the contract ``adapter`` declares wrong."""
    name = getattr(adapter, "name", None)
    if not isinstance(name, str) or not name:
        raise AdapterError(
            f"adapter {type(adapter).__name__}: name must be a non-empty str, "
            f"got {type(name).__name__} {name!r}"
        )
    for attribute in ("observe", *(ENGINE_METHODS if is_engine(adapter) else ())):
        if not callable(getattr(adapter, attribute, None)):
            raise AdapterError(f"adapter {_name(adapter)}: it has no method {attribute}()")
    with _refused(adapter):
        _check_pool(adapter)
        group_kinds(_attribute(adapter, "group_windows"), adapter.block_size, 0)
        _check_supports(adapter)
        _check_declarations(adapter)


def _check_pool(adapter: Target) -> None:
    """``block_size`` and the pool's size as the spec's (``check_pool_shape``; the size is
    checked before a block is looked at, so a huge pool is refused at once), then every
    block id an ``int``, each once."""
    block_size = _attribute(adapter, "block_size")
    check_pool_shape(1, block_size)
    pool = _attribute(adapter, "pool_block_ids")
    if isinstance(pool, str) or not isinstance(pool, Collection):
        raise TypeError(
            f"pool_block_ids must be a sequence of block ids, got {type(pool).__name__} {pool!r}"
        )
    try:
        check_pool_shape(len(pool), 1)
    except ValueError as error:
        raise ValueError(f"pool_block_ids: {error} (the spec's largest pool)") from None
    if isinstance(pool, range):
        return  # distinct ints by construction: a range of 2**24 blocks is not walked
    seen: set[int] = set()
    for block_id in pool:
        if type(block_id) is not int:
            raise TypeError(
                f"pool_block_ids must hold ints, got {type(block_id).__name__} {block_id!r}"
            )
        if block_id in seen:
            raise ValueError(f"pool_block_ids holds block {block_id} twice")
        seen.add(block_id)


def _check_supports(adapter: Target) -> None:
    """``supports``: a collection of known names; for an operation adapter, one of them an
    operation that admits a request, and every operation it names a method."""
    supports = _attribute(adapter, "supports")
    if isinstance(supports, str) or not isinstance(supports, Collection):
        raise TypeError(
            f"supports must be a set of names, got {type(supports).__name__} {supports!r}"
        )
    engine = is_engine(adapter)
    known = MARKERS if engine else OPERATION_NAMES + MARKERS
    unknown = [repr(n) for n in supports if n not in known]
    if unknown:
        raise ValueError(
            f"supports names {', '.join(sorted(unknown))}, which the kit does not know "
            f"(it knows {', '.join(known)})"
        )
    if engine:
        return
    if not set(supports) & set(ADMITTING):
        raise ValueError(
            f"supports must name {' or '.join(ADMITTING)} (a request is admitted before any "
            f"other operation runs), got {sorted(supports)}"
        )
    for operation in sorted(set(supports) - set(MARKERS)):
        if not callable(getattr(adapter, operation, None)):
            raise ValueError(f"supports names {operation}, but it is no method of the adapter")


def _check_declarations(adapter: Target) -> None:
    """``differences`` a mapping of known property names (or ``property/operation``) to
    reasons; ``exact`` a bool; ``take_events()`` a method where ``supports`` has KV_EVENTS."""
    differences = _attribute(adapter, "differences")
    if not isinstance(differences, Mapping):
        raise TypeError(
            "differences must be a mapping of property names to reasons, got "
            f"{type(differences).__name__} {differences!r}"
        )
    for key, reason in differences.items():
        if not isinstance(key, str) or key.partition("/")[0] not in PROPERTY_NAMES:
            raise ValueError(
                f"differences names {key!r}, which is no property (docs/conformance.md, "
                "'The properties')"
            )
        if not isinstance(reason, str):
            raise TypeError(
                f"differences[{key!r}] must be a reason (a str), got {type(reason).__name__}"
            )
    exact = getattr(adapter, "exact", False)
    if type(exact) is not bool:
        raise TypeError(f"exact must be a bool, got {type(exact).__name__} {exact!r}")
    if KV_EVENTS in adapter.supports and not callable(getattr(adapter, "take_events", None)):
        raise ValueError(f"supports names {KV_EVENTS}, but take_events() is no method of it")


def _attribute(adapter: Target, name: str) -> object:
    """An attribute the contract requires; reading it may run the adapter's own code."""
    missing = object()
    with blamed_on_adapter(adapter, f"reading {name}", "on a fresh adapter"):
        value: object = getattr(adapter, name, missing)
    if value is missing:
        raise AdapterError(f"adapter {_name(adapter)}: it has no attribute {name}")
    return value


@contextlib.contextmanager
def _refused(adapter: Target) -> Iterator[None]:
    """The spec's own checks, and the kit's, raise ``TypeError``/``ValueError``: one line
    naming the adapter."""
    try:
        yield
    except AdapterError:
        raise
    except (TypeError, ValueError) as error:
        raise AdapterError(f"adapter {_name(adapter)}: {error}") from None


def _name(adapter: object) -> str:
    name = getattr(adapter, "name", None)
    return repr(name) if isinstance(name, str) and name else type(adapter).__name__


def _factory_name(factory: object) -> str:
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(factory)
