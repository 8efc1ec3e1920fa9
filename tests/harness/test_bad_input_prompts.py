"""Prompts-file lines that are valid JSON the parser still rejects, and lines of whitespace.

Python's ``json`` refuses nesting deeper than the interpreter's recursion limit
(``RecursionError``) and integers of more than 4,300 digits (``ValueError``); both are
``FILE:N: not JSON: <reason>`` like any other line that does not parse. A line of only
whitespace is skipped, as an empty one is.
"""

import re
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.prompts import PromptsFileError, load_prompts_file

DEEP = 100_000  # brackets: far past any recursion limit


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("[" * DEEP + "]" * DEEP, "nested deeper than the JSON parser can read"),
        ('{"prompt": ' + "9" * 5000 + "}", "Exceeds the limit (4300 digits) for integer"),
        ('{"messages": ' + "[" * DEEP + "]" * DEEP + "}", "nested deeper than the JSON parser"),
    ],
    ids=["deep-array", "5000-digit-integer", "deep-messages"],
)
def test_a_line_the_json_parser_rejects_is_not_json_with_its_line_number(
    tmp_path: Path, line: str, reason: str
) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n' + line + "\n")
    with pytest.raises(PromptsFileError, match=f"^{re.escape(f'{path}:2: not JSON: {reason}')}"):
        load_prompts_file(path)


def test_the_main_command_refuses_a_deeply_nested_line_in_one_line_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("[" * DEEP + "]" * DEEP + "\n")
    assert main(["--device", "cpu", "--prompts-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith(
        f"python -m harness: error: {path}:1: not JSON: nested deeper than the JSON parser "
        "can read ("
    )


def test_a_line_of_whitespace_is_skipped_like_an_empty_one(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n   \n\t\n\n \t \r\n{"prompt": "b"}\n  ')
    assert load_prompts_file(path) == [(("user", "a"),), (("user", "b"),)]


def test_a_file_of_only_whitespace_lines_has_no_prompts(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("  \n\t\n")
    with pytest.raises(PromptsFileError, match="has no prompts"):
        load_prompts_file(path)


def test_a_line_separator_inside_a_json_string_does_not_split_the_line(tmp_path: Path) -> None:
    # U+2028, U+2029 and U+0085 may stand unescaped in a JSON string; str.splitlines()
    # splits at each.
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a\u2028b\u2029c\x85d"}\n{"prompt": "e"}\n', encoding="utf-8")
    assert load_prompts_file(path) == [(("user", "a\u2028b\u2029c\x85d"),), (("user", "e"),)]
