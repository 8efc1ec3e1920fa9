"""``--model DIR`` whose files are there but broken: ``ModelLoadError``, one complete line.

Each case is the seeded tiny Llama saved as a HF directory, then one file of it broken the
way a failed download or a full disk breaks it. Whatever type the loaders raise for it
(safetensors' ``SafetensorError``, a ``KeyError`` from the tokenizer, a config validation
error, a ``ZeroDivisionError`` from a zero head count), the user gets ``cannot load model``
and a reason that is a whole sentence.
"""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from harness.cli.main import main
from harness.models import ModelLoadError, load_model
from tests.support.harness_cases import save_model_directory, tiny_model

CPU = torch.device("cpu")
Damage = Callable[[Path], object]  # breaks the file it is given


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama as a model directory, saved once; cases break copies of it."""
    return save_model_directory(tiny_model().model, tmp_path_factory.mktemp("tiny"))


def _broken_copy(saved: Path, tmp_path: Path, name: str, damage: Damage) -> Path:
    directory = tmp_path / "m"
    shutil.copytree(saved, directory)
    damage(directory / name)
    return directory


def _rewrite_bytes(change: Callable[[bytes], bytes]) -> Damage:
    return lambda path: path.write_bytes(change(path.read_bytes()))


def _rewrite_config(**fields: object) -> Damage:
    return lambda path: path.write_text(json.dumps(json.loads(path.read_text()) | fields))


# The first 100 bytes of the file: the header's length points past the end.
TRUNCATED = _rewrite_bytes(lambda data: data[:100])


def _load_error(directory: Path) -> str:
    with pytest.raises(ModelLoadError) as raised:
        load_model(directory, CPU, torch.float32)
    return str(raised.value)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (TRUNCATED, "SafetensorError: Error while deserializing header: invalid header length"),
        # Half the file: the header is whole, the tensors it lists are not.
        (_rewrite_bytes(lambda data: data[: len(data) // 2]), "SafetensorError: Error while"),
        (_rewrite_bytes(lambda data: b""), "SafetensorError: Error while deserializing header"),
        # A header length of 2**40 bytes.
        (_rewrite_bytes(lambda data: (2**40).to_bytes(8, "little") + data[8:]), "header too"),
    ],
    ids=["truncated-header", "truncated-tensors", "empty", "header-too-large"],
)
def test_a_corrupt_safetensors_file_cannot_be_loaded(
    saved: Path, tmp_path: Path, damage: Damage, reason: str
) -> None:
    directory = _broken_copy(saved, tmp_path, "model.safetensors", damage)
    assert _load_error(directory).startswith(f"cannot load model {str(directory)!r}: ")
    assert reason in _load_error(directory)


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        # The tokenizers library reads it with a KeyError.
        (
            "tokenizer.json",
            lambda path: path.write_text('{"version": "1.0", "model": 5}'),
            "KeyError: 'added_tokens'",
        ),
        # huggingface_hub's validation error runs to two lines: the first ends in a colon.
        (
            "config.json",
            _rewrite_config(hidden_size="x"),
            "Validation error for field 'hidden_size': TypeError: Field 'hidden_size' "
            "expected int, got str (value: 'x')",
        ),
        ("config.json", _rewrite_config(num_attention_heads=0), "ZeroDivisionError: "),
    ],
    ids=["tokenizer-key-error", "config-validation", "zero-heads"],
)
def test_any_error_a_loader_raises_for_a_bad_file_is_one_complete_line(
    saved: Path, tmp_path: Path, name: str, damage: Damage, message: str
) -> None:
    error = _load_error(_broken_copy(saved, tmp_path, name, damage))
    assert message in error
    assert "\n" not in error and not error.endswith(":")


def test_a_directory_with_only_a_config_says_which_files_are_missing(
    saved: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    shutil.copy(saved / "config.json", directory)
    assert _load_error(directory) == (
        f"cannot load model {str(directory)!r}: the directory has no weights (none of "
        "model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
        "pytorch_model.bin.index.json) and no tokenizer (none of tokenizer.json, "
        "tokenizer.model, vocab.json, vocab.txt)"
    )


def test_a_directory_without_a_tokenizer_names_only_the_tokenizer(
    saved: Path, tmp_path: Path
) -> None:
    directory = _broken_copy(saved, tmp_path, "tokenizer.json", Path.unlink)
    assert _load_error(directory).endswith(
        ": the directory has no tokenizer (none of tokenizer.json, tokenizer.model, "
        "vocab.json, vocab.txt)"
    )


def test_the_main_command_refuses_a_corrupt_safetensors_in_one_line_with_exit_2(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _broken_copy(saved, tmp_path, "model.safetensors", TRUNCATED)
    assert main(["--device", "cpu", "--model", str(directory)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith(
        f"python -m harness: error: cannot load model {str(directory)!r}: SafetensorError: "
    )
