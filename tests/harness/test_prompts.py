"""The built-in prompts and the JSON-lines prompts file."""

import re
from pathlib import Path

import pytest

from harness.prompts import BUILTIN_PROMPTS, PromptsFileError, load_prompts_file


def test_there_are_at_least_twelve_built_in_prompts_with_a_long_one() -> None:
    assert len(BUILTIN_PROMPTS) >= 12
    longest = max(sum(len(content) for _, content in messages) for messages in BUILTIN_PROMPTS)
    assert longest > 1000  # characters; > 200 tokens once templated (370 with SmolLM2)


def test_a_prompts_file_reads_both_line_forms_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "hi"}\n\n'
        '{"messages": [{"role": "system", "content": "be brief"}, '
        '{"role": "user", "content": "why?"}]}\n'
    )
    assert load_prompts_file(path) == [
        (("user", "hi"),),
        (("system", "be brief"), ("user", "why?")),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "has no prompts"),
        ("not json\n", ":1: not JSON"),
        (
            '{"messages": [{"role": "user"}]}\n',
            ":1: each message needs string 'role' and 'content'",
        ),
        ('["hi"]\n', ':1: expected {"prompt": ...} or {"messages": [...]}'),
    ],
)
def test_a_bad_prompts_file_names_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(PromptsFileError, match=re.escape(message)):
        load_prompts_file(path)
