"""Your own kernel through the checks: ``check_model(..., attention=kernel)`` and
``--attention package.module:function`` (``harness.runtime.user_kernel``).

A kernel that keeps the contract passes the three checks; one that computes the wrong
attention fails them; one that returns the wrong thing, or NaN from a row it must not
read, is refused in one line naming what it broke.
"""

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.check import check_model
from harness.cli.main import main
from harness.runtime.user_kernel import UserKernelError
from tests.support import user_kernels
from tests.support.harness_cases import save_model_directory, tiny_model

# Three prompts of token ids with a shared start; the pool is poisoned (NaN in every block
# no request holds), so a kernel that reads one shows it.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 20, 21], [30, 31, 32]]


def checked(kernel: Callable[..., object]) -> bool:
    report = check_model(
        tiny_model().model,
        None,
        PROMPTS,
        max_new_tokens=6,
        block_size=4,
        poison_freed=True,
        attention=kernel,
    )
    assert report.attention == f"tests.support.user_kernels:{kernel.__name__}"
    return report.passed


def test_a_kernel_that_keeps_the_contract_passes_the_checks() -> None:
    assert checked(user_kernels.emulated)


def test_a_kernel_without_a_causal_mask_fails_the_checks() -> None:
    assert not checked(user_kernels.no_causal_mask)


@pytest.mark.parametrize(
    ("kernel", "said"),
    [
        (user_kernels.not_a_tensor, "returned list, not a tensor"),
        (user_kernels.wrong_shape, "returned shape [9, 3, 16], not [9, 4, 16] ("),
        (user_kernels.wrong_dtype, "returned float64, not the query's float32"),
        (
            user_kernels.nan_in_the_last_request,
            "returned NaN in 1 query rows, first row ",
        ),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_a_kernel_that_breaks_the_contract_is_refused_in_one_line(
    kernel: Callable[..., object], said: str
) -> None:
    with pytest.raises(UserKernelError) as refused:
        checked(kernel)
    message = str(refused.value)
    assert message.startswith(f"attention kernel tests.support.user_kernels:{kernel.__name__} ")
    assert said in message and "\n" not in message, message


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_directory(tiny_model().model, tmp_path_factory.mktemp("tiny"))


def _command(tiny_dir: Path, tmp_path: Path, attention: str) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a b c d e f g"}\n{"prompt": "a b c d x"}\n')
    return [
        "--device", "cpu", "--model", str(tiny_dir), "--prompts-file", str(prompts),
        "--max-new-tokens", "4", "--poison-freed", "--json", "--attention", attention,
    ]  # fmt: skip


def test_the_command_runs_a_kernel_named_module_colon_function(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kernel = "tests.support.user_kernels:emulated"
    assert main(_command(tiny_dir, tmp_path, kernel)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["attention"] == kernel


def test_a_kernel_breaking_the_contract_at_the_command_line_is_one_line_and_exit_2(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_command(tiny_dir, tmp_path, "tests.support.user_kernels:wrong_shape")) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(
        "python -m harness: error: attention kernel tests.support.user_kernels:wrong_shape "
        "returned shape ["
    ), err


@pytest.mark.parametrize(
    ("attention", "said"),
    [
        ("nowhere.at_all:kernel", "cannot import 'nowhere.at_all': No module named 'nowhere'"),
        ("tests.support.user_kernels:missing", "has no callable 'missing'"),
        ("fastest", "'fastest' is neither a backend (flex, gather, triton, varlen, "),
    ],
)
def test_a_kernel_that_cannot_be_loaded_is_one_line_and_exit_2(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], attention: str, said: str
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(_command(tiny_dir, tmp_path, attention))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --attention: " in err and said in err, err
