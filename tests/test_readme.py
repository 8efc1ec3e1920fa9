"""The README's "Test your model" example, run exactly as written, on the tiny seeded Llama
saved as a model directory (a word-level tokenizer, a chat template)."""

import re
from pathlib import Path

import pytest

from tests.support.harness_cases import save_model_directory, tiny_model
from tests.support.modules import load_module

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    """The first Python block of the README's "Test your model" section."""
    section = README.read_text(encoding="utf-8").split("\n## Test your model", 1)[1]
    section = section.split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None, "no python block in the README's Test your model section"
    return found.group(1)


def test_the_readme_example_passes_on_the_tiny_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODEL_DIR", str(save_model_directory(tiny_model().model, tmp_path)))
    example = tmp_path / "test_paged_kv.py"
    example.write_text(readme_example(), encoding="utf-8")
    module = load_module("readme_example", example)
    tests = [getattr(module, name) for name in dir(module) if name.startswith("test_")]
    assert len(tests) == 1
    tests[0]()
