"""The GPU check's smoke run: every stage of ``scripts/gpu_check.py`` on CPU, small.

It is here so that a typo in the driver shows in CI, not on a GPU machine whose time is
counted. It takes about a minute on an idle 2-core machine.
"""

import importlib.util
import json
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_smoke_run_passes_every_stage_and_writes_one_json_and_one_log(tmp_path: Path) -> None:
    driver = _driver()
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
        "float32/BatchInvariantEngine",
        "float32/Engine",
    ]
    bench_methods = {row["method"] for row in results["stages"]["decode_bench"]["rows"]}
    assert bench_methods == {"dense", "paged", "hf-cb"}
