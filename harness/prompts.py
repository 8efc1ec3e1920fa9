"""The prompts the main command runs: a built-in varied set, or a JSON-lines file.

A prompt is a list of chat messages; every prompt is rendered with the model's chat
template (with the generation prompt), so SmolLM2's EOS/pad token appears inside prompts
just as it does in real use.
"""

import json
from pathlib import Path
from typing import Any

Messages = tuple[tuple[str, str], ...]  # (role, content) pairs

_LONG_CONTEXT = (
    "The paged KV cache splits each request's keys and values into fixed-size blocks. "
    "A block table maps the request's logical token positions to physical blocks in a "
    "shared pool, so memory is reserved one block at a time instead of for the maximum "
    "sequence length up front. When a request finishes, its blocks go back to a free "
    "queue and the next request can use them at once. The price is an indirection on "
    "every read: attention must gather the request's keys and values through its table. "
    "Internal fragmentation is limited to the unused tail of each request's last block, "
    "and there is no external fragmentation at all, because any free block can serve any "
    "request. Continuous batching adds requests to the running batch as soon as blocks "
    "are free, and removes each request the moment it emits its end token. "
)

BUILTIN_PROMPTS: tuple[Messages, ...] = (
    (("user", "What is the capital of France?"),),
    (("user", "Write a haiku about autumn leaves."),),
    (("user", "Explain what a hash table is in two sentences."),),
    (("user", "List three prime numbers greater than 50."),),
    (("user", "Translate 'good morning, how are you?' into Spanish."),),
    (
        ("system", "You are a terse assistant. Answer in one line."),
        ("user", "Why is the sky blue?"),
    ),
    (("user", "Write a Python function that reverses a string."),),
    (
        ("user", "Give me a recipe idea with eggs."),
        ("assistant", "How about a Spanish omelette with potatoes and onions?"),
        ("user", "Great, list the steps."),
    ),
    (("user", "Summarize the following text in three bullet points.\n\n" + _LONG_CONTEXT * 2),),
    (("user", "What are the main differences between TCP and UDP?"),),
    (("user", "Tell me a short story about a robot who learns to paint."),),
    (("user", "Read this and answer: what does a block table map?\n\n" + _LONG_CONTEXT),),
    (("user", "hi"),),
    (("user", "Count from one to twenty in words."),),
)


class PromptsFileError(Exception):
    """The prompts file cannot be read or a line is not a prompt; the message says where."""


class PromptTextError(ValueError):
    """A prompt's text is not valid Unicode (a lone surrogate), which no tokenizer takes."""


def check_prompt_text(text: str, where: str) -> None:
    """Raise ``PromptTextError`` if ``text`` cannot be encoded as UTF-8, saying where.

    JSON's ``"\\ud800"`` escape and undecodable command-line bytes (Python's
    ``surrogateescape``) both make strings with lone surrogates; the tokenizer would fail
    on them deep inside, with a traceback.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PromptTextError(
            f"{where}: a lone surrogate {text[error.start]!r} at character {error.start} "
            "is not valid Unicode text"
        ) from None


def load_prompts_file(path: Path) -> list[Messages]:
    """Read JSON lines, each ``{"prompt": str}`` or ``{"messages": [{"role", "content"}]}``."""
    try:
        # Split at newlines only: str.splitlines() also splits at U+2028, U+2029 and U+0085,
        # which a JSON string may hold unescaped. (read_text has made "\r\n" a "\n".)
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as error:
        raise PromptsFileError(f"cannot read prompts file {str(path)!r}: {error}") from error
    # A line of whitespace is skipped as an empty one is: neither holds a prompt.
    prompts = [
        _parse_line(path, number, line) for number, line in enumerate(lines, 1) if line.strip()
    ]
    if not prompts:
        raise PromptsFileError(f"prompts file {str(path)!r} has no prompts")
    return prompts


def render_prompt(
    tokenizer: Any,  # Any: a transformers tokenizer with a chat template
    messages: Messages,
) -> tuple[int, ...]:
    """The token ids of ``messages`` under the chat template, ready for the assistant turn."""
    chat = [{"role": role, "content": content} for role, content in messages]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    # The template already starts with any special tokens it wants.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tuple(int(i) for i in ids)


def _parse_line(path: Path, number: int, line: str) -> Messages:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    # Valid JSON that Python's parser still refuses raises other errors than JSONDecodeError.
    except (ValueError, RecursionError) as error:
        raise PromptsFileError(f"{where}: not JSON: {_json_reason(error)}") from error
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        check_prompt_text(record["prompt"], where)
        return (("user", record["prompt"]),)
    if isinstance(record, dict) and isinstance(record.get("messages"), list) and record["messages"]:
        messages = []
        for message in record["messages"]:
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise PromptsFileError(f"{where}: each message needs string 'role' and 'content'")
            check_prompt_text(message["role"], where)
            check_prompt_text(message["content"], where)
            messages.append((message["role"], message["content"]))
        return tuple(messages)
    raise PromptsFileError(f'{where}: expected {{"prompt": ...}} or {{"messages": [...]}}')


def _json_reason(error: ValueError | RecursionError) -> str:
    """Why ``json.loads`` refused a line: a syntax error, nesting deeper than the parser
    recurses (``RecursionError``), or an integer of more digits than ``int`` converts
    (``ValueError``, ``sys.get_int_max_str_digits()``: 4,300)."""
    if isinstance(error, json.JSONDecodeError):
        return error.msg
    if isinstance(error, RecursionError):
        return f"nested deeper than the JSON parser can read ({error})"
    return str(error)
