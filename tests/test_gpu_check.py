"""scripts/gpu_check.sh, the one-command GPU check (docs/gpu.md), run here on fake steps: which steps run, what
the report records of each (rc, result, time limit, budget), and the plan it prints without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="1">
<testcase classname="tests.test_x" name="test_ok"/><testcase classname="tests.test_x" name="test_cpu"><skipped/></testcase>
<testcase classname="tests.test_x" name="test_bad"><failure message="assert 1 == 0&#10;more">trace</failure></testcase>
</testsuite></testsuites>"""

STEPS = f"""# fake steps: name|timeout|command
json_line|20|echo progress; echo '{{"speedup": 2.5}}'; echo 'tqdm 50%' >&2
pretty|20|printf 'warming up\\n{{\\n  "a": [1,\\n 2]\\n}}\\n'
own_file|20|echo '{{"x": 1}}' > "$STEP_JSON"; echo '{{"not": "this"}}'
junit|20|cp "$JUNIT_FILE" "$STEP_XML"
fails|20|echo out; echo boom >&2; exit 3
hangs|1|sleep 30
not_selected|20|echo never
"""


def _run(tmp_path: Path, steps: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The script on these steps, with no wheels, its python3 this interpreter's base one (started quickly)."""
    for folder in ("wheels", "bin"):
        (tmp_path / folder).mkdir(exist_ok=True)
    if not (tmp_path / "bin" / "python3").exists():
        (tmp_path / "bin" / "python3").symlink_to(getattr(sys, "_base_executable", sys.executable))
    (tmp_path / "steps.txt").write_text(steps)
    full = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "WHEELS": str(tmp_path / "wheels"),
            "GPU_CHECK_STEPS_FILE": str(tmp_path / "steps.txt"), "OUT": str(tmp_path / "out"),
            "GPU_CHECK_SITE": str(tmp_path / "site"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=full, capture_output=True, text=True,
                          timeout=60)


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_wheels.sh")], check=True)


def test_the_report_records_each_selected_step(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    run = _run(tmp_path, STEPS, "--force", JUNIT_FILE=str(tmp_path / "junit.xml"),
               GPU_CHECK_STEPS="json_line pretty own_file junit fails hangs")
    assert run.returncode == 1, run.stdout + run.stderr  # a step failed
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log"]
    report = json.loads((out / "gpu_check.json").read_text())
    assert {"date", "commit", "device", "torch", "triton", "steps", "complete"} <= report.keys()
    assert report["complete"] is True
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["install", "json_line", "pretty", "own_file", "junit", "fails", "hangs"]
    assert steps["install"]["rc"] is None and "no wheels" in steps["install"]["skipped"]
    assert steps["json_line"]["rc"] == 0 and steps["json_line"]["result"] == {"speedup": 2.5}
    assert "tqdm 50%" in steps["json_line"]["log_tail"]
    assert steps["pretty"]["result"] == {"a": [1, 2]}
    assert steps["own_file"]["result"] == {"x": 1}
    assert steps["junit"]["result"] == {"tests": 3, "passed": 1, "failed": 1, "errors": 0, "skipped": 1,
                                        "failures": ["tests.test_x::test_bad: assert 1 == 0"]}
    assert steps["fails"]["rc"] == 3 and steps["fails"]["result"] is None and "boom" in steps["fails"]["log_tail"]
    assert steps["hangs"]["rc"] == 124 and steps["hangs"]["timed_out"] and steps["hangs"]["seconds"] < 10
    log = (out / "gpu_check.log").read_text()
    assert "===== fails: rc 3" in log and "never" not in log
    summary = run.stdout.splitlines()
    assert any(line.split()[:2] == ["fails", "3"] for line in summary)


def test_the_budget_cuts_limits_and_skips_what_no_longer_fits(tmp_path):
    # 15 s of the budget are kept for the report: of 40 s, a step with a 100 s limit gets what is left (about 25 s).
    run = _run(tmp_path, "first|100|true\n", "--force", BUDGET="40")
    first = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["steps"][1]
    assert run.returncode == 0 and first["rc"] == 0 and 22 <= first["timeout_s"] <= 25
    # Of 20 s, less than the 10 s a step needs is left: every step is skipped, says why, and the check fails.
    run = _run(tmp_path, "first|100|true\nsecond|5|true\n", "--force", BUDGET="20")
    steps = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["steps"][1:]
    assert [(s["name"], s["rc"], s["skipped"][:6]) for s in steps] == [("first", None, "budget"), ("second", None, "budget")]
    assert run.returncode == 1


def test_without_a_gpu_it_prints_the_selected_plan_and_runs_nothing(tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "GPU_CHECK_STEPS": "doctor kernel_tests"}
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # whatever this machine has: no device
    (tmp_path / "nvidia-smi").chmod(0o755)
    run = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    plan = [line.split()[0] for line in run.stdout.splitlines() if line.startswith("  ")]
    assert plan == ["install", "kernel_tests", "doctor"]  # the plan's order, not the variable's
    assert "dry run" in run.stdout and not (tmp_path / "out").exists()
    bad = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env={**env, "GPU_CHECK_STEPS": "kernel_test"},
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown step 'kernel_test'" in bad.stderr
