#!/usr/bin/env bash
# One-command GPU check (docs/gpu.md): on a bare GPU machine, from the repository root, install the wheels of
# `make gpu-wheels`, then run the CUDA kernel tests and the benchmarks, each step in its own time limit, and write
# one JSON report, $OUT/gpu_check.json, beside one log of every step, $OUT/gpu_check.log, and the timings files the
# run saved ($OUT stays within 8 files). Without CUDA (no nvidia-smi) it only prints the plan, as --dry-run does;
# --force runs the steps anyway.
#
#   WHEELS=.gpu-wheels  OUT=${OUT:-./gpu-check-out}  BUDGET=1500 (seconds for everything; steps that no longer
#   fit are skipped and say so)  GPU_CHECK_STEPS="kernel_tests cascade" (a subset, in plan order)
#   GPU_CHECK_STEPS_FILE=file (lines `name|timeout|command` instead of the plan below)  GPU_CHECK_SITE=/tmp/site
#
# Imports: the repository's own folders come first on PYTHONPATH, then the wheels' folder. So the code run is the
# working tree that travelled (also kernels/ and benchmarks/, and timings are saved into the tree), and the
# project's wheel contributes only its dist-info: the `arctic_rl` entry points that register the bench commands.
set -u

# The plan, in order: name|timeout in seconds|command (run by bash in the repository root). A step's result is the
# JSON file it writes to $STEP_JSON, else the JUnit XML it writes to $STEP_XML, else the last JSON in its stdout.
# One random model for every ZoRRo step (built by the first, reused by the rest: `--model-cache`).
ZORRO="python3 -m arctic_rl_core.cli bench zorro --preset qwen3-0.6b --dtype bfloat16 --model-cache /tmp/bench-models --json"
ATTENTION="python3 -m arctic_rl_bench.attention --json --save"
# Issue 73's rows, the cheapest first, so that a budget cut leaves the fewest rows unmeasured.
PLAN=(
  "attention_bf16|60|$ATTENTION --dtype bfloat16 --backends triton cuda_flash --sweep 2048 8192 16384 32768"
  'cascade|60|python3 -m arctic_rl_bench.cascade --group 8 16 32 64 --repeats 20 --json'
  "zorro_4k_fp32_ref|150|$ZORRO --prompt-len 4096 --response-len 512 --repeats 3 --fp32-reference --profile 12"
  "zorro_8k|100|$ZORRO --prompt-len 8192 --response-len 1024 --repeats 2"
  "zorro_16k|120|$ZORRO --prompt-len 16384 --response-len 2048 --repeats 2"
  "zorro_4k_g16|100|$ZORRO --prompt-len 4096 --response-len 512 --group 16 --repeats 3"
  "zorro_32k|150|$ZORRO --prompt-len 32768 --response-len 4096 --repeats 1"
  "zorro_fit|120|$ZORRO --largest-without-checkpointing 2048 4096 8192 16384 32768"
  'kernel_tests|150|python3 -m pytest -q -n 8 -p no:cacheprovider --junitxml="$STEP_XML" tests/test_split_attention.py tests/test_forest_flash_attention.py tests/test_cascade_decode.py tests/test_attention_backend_choice.py'
  "attention_tune|120|$ATTENTION --tune --prompt 8192 --response 1024"
  "attention_fp32|60|$ATTENTION --dtype float32 --backends cuda_flash math --sweep 2048 8192"
  'doctor|30|python3 -m arctic_rl_core.cli doctor --json'
)

DRY=0 FORCE=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (--dry-run, --force)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
WHEELS=${WHEELS:-.gpu-wheels}
OUT=${OUT:-$ROOT/gpu-check-out}
BUDGET=${BUDGET:-1500}
SITE=${GPU_CHECK_SITE:-/tmp/site}
RESERVE=15   # seconds kept for the report at the end
START=$(date +%s)

if [ -n "${GPU_CHECK_STEPS_FILE:-}" ]; then
  mapfile -t PLAN < <(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$GPU_CHECK_STEPS_FILE")
fi
NAMES=()
for entry in "${PLAN[@]}"; do NAMES+=("${entry%%|*}"); done
SELECTED=()
for entry in "${PLAN[@]}"; do
  name=${entry%%|*}
  if [ -z "${GPU_CHECK_STEPS:-}" ] || [[ " $GPU_CHECK_STEPS " == *" $name "* ]]; then SELECTED+=("$entry"); fi
done
for name in ${GPU_CHECK_STEPS:-}; do
  [[ " ${NAMES[*]} " == *" $name "* ]] || { echo "unknown step '$name'; steps: ${NAMES[*]}" >&2; exit 2; }
done

PYPATH="$ROOT:$ROOT/kernels:$ROOT/plugins:$ROOT/recipes:$ROOT/benchmarks:$SITE"
wheels=("$WHEELS"/*.whl)
[ -e "${wheels[0]}" ] || wheels=()

if [ $DRY = 0 ] && [ $FORCE = 0 ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no CUDA device here (nvidia-smi): dry run; --force runs the steps anyway"
  DRY=1
fi
if [ $DRY = 1 ]; then
  echo "plan (budget ${BUDGET}s, report in $OUT/gpu_check.json):"
  printf '  %-16s %4ss  %s\n' install - "${#wheels[@]} wheels from $WHEELS into $SITE (pip --no-index --no-deps --target)"
  for entry in "${SELECTED[@]}"; do
    IFS='|' read -r name limit cmd <<<"$entry"
    printf '  %-16s %4ss  %s\n' "$name" "$limit" "$cmd"
  done
  echo "PYTHONPATH=$PYPATH"
  exit 0
fi

mkdir -p "$OUT" || exit 2
rm -f "$OUT/gpu_check.json" "$OUT/gpu_check.log" "$OUT"/timings_*.json
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
touch "$WORK/start-stamp"
: >"$WORK/steps.tsv"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PYPATH"
cp "$WHEELS/BUILD_INFO.json" "$WORK/build.json" 2>/dev/null
[ -e "$ROOT/.git" ] && git -C "$ROOT" rev-parse HEAD >"$WORK/commit" 2>/dev/null

# The timings and tile configurations this run saved, flat in $OUT (report and log make 2 of its 8 files).
copy_timings() {
  local f n=0
  for f in "$ROOT"/kernels/arctic_rl_kernels/timings/*.json "$SITE"/arctic_rl_kernels/timings/*.json; do
    [ -f "$f" ] && [ "$f" -nt "$WORK/start-stamp" ] || continue
    n=$((n + 1))
    [ $n -le 6 ] && cp "$f" "$OUT/$(basename "$(dirname "$f")")_$(basename "$f")"
  done
}

# The report, rewritten after every step: a run stopped from outside still leaves the steps it finished.
report() {
  python3 - "$WORK" "$OUT" "$BUDGET" "$START" "$1" <<'EOF'
import datetime, json, os, pathlib, sys, time, xml.etree.ElementTree as ET

work, out, budget, start, complete = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"

def read(path):
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""

def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

def last_json(text):
    try:
        return json.loads(text)
    except ValueError:
        pass
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip()[:1] in ("{", "["):
            for candidate in ("\n".join(lines[i:]), lines[i]):
                try:
                    return json.loads(candidate)
                except ValueError:
                    pass
    return None

def junit(path):
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            message = (bad.get("message") or "").strip().splitlines()
            failed.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:200] if message else bad.tag}")
    return {"tests": count["tests"], "passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
            "failed": count["failures"], "errors": count["errors"], "skipped": count["skipped"], "failures": failed[:50]}

def tail(text, lines=30):
    rows = [line.rsplit("\r", 1)[-1][:300] for line in text.splitlines()]
    return "\n".join(row for row in rows if row.strip())[-6000:].splitlines()[-lines:]

steps = []
for row in read(work / "steps.tsv").splitlines():
    name, rc, seconds, limit, note = row.split("\t")
    step = {"name": name, "rc": None if rc == "" else int(rc), "seconds": None if seconds == "" else float(seconds),
            "timeout_s": None if limit == "" else int(limit), "timed_out": rc in ("124", "137")}
    if note:
        step["skipped"] = note
    stdout, stderr = read(work / f"{name}.out"), read(work / f"{name}.err")
    result = load(work / f"{name}.json") if (work / f"{name}.json").exists() else None
    if result is None and (work / f"{name}.xml").exists():
        result = junit(work / f"{name}.xml")
    if result is None:
        result = last_json(stdout)
    step["result"] = result
    step["log_tail"] = "\n".join(tail(stdout + ("\n--- stderr ---\n" + stderr if stderr.strip() else "")))
    steps.append(step)

env = load(work / "env.json") or {}
build = load(work / "build.json")
commit = read(work / "commit").strip() or None
report = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "commit": commit or (build or {}).get("commit"),
    "commit_source": "git" if commit else ("wheels' BUILD_INFO.json" if build else None),
    "wheels_build": build,
    "device": load(work / "device.json"),
    "torch": env.get("torch"), "triton": env.get("triton"), "cuda_available": env.get("cuda_available"),
    "environment": env,
    "budget_s": budget, "elapsed_s": round(time.time() - start, 1), "complete": complete,
    "steps": steps,
    "files": sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and p.name != "gpu_check.json"),
}
tmp = out / ".gpu_check.json.tmp"
tmp.write_text(json.dumps(report, indent=1) + "\n")
os.replace(tmp, out / "gpu_check.json")
EOF
}

# Runs one step: NAME LIMIT COMMAND; records rc, seconds, the budget it had, and appends its output to the log.
run_step() {
  local name=$1 limit=$2 cmd=$3 left t0 rc secs
  left=$((BUDGET - ($(date +%s) - START) - RESERVE))
  if [ "$left" -lt 10 ]; then
    printf '%s\t\t\t%s\t%s\n' "$name" "$limit" "budget: ${BUDGET}s spent" >>"$WORK/steps.tsv"
    echo "-- $name skipped: budget spent"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "-- $name (limit ${limit}s)"
  t0=$(date +%s.%N)
  ( cd "$ROOT" && STEP_NAME=$name STEP_JSON="$WORK/$name.json" STEP_XML="$WORK/$name.xml" \
      timeout -k 10 "$limit" bash -c "$cmd" >"$WORK/$name.out" 2>"$WORK/$name.err" </dev/null )
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\t\n' "$name" "$rc" "$secs" "$limit" >>"$WORK/steps.tsv"
  { echo "===== $name: rc $rc, ${secs}s (limit ${limit}s)"; echo "\$ $cmd"; cat "$WORK/$name.out"
    if [ -s "$WORK/$name.err" ]; then echo "--- stderr"; cat "$WORK/$name.err"; fi; echo; } >>"$OUT/gpu_check.log"
  if [ $rc != 0 ]; then
    [ $rc = 124 ] && echo "   timed out after ${limit}s"
    { tail -n 4 "$WORK/$name.out"; tail -n 12 "$WORK/$name.err"; } 2>/dev/null | cut -c1-240 | sed 's/^/   /'
  fi
  copy_timings
  report 0
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 |
  awk -F', ' 'NF >= 3 { printf "{\"name\": \"%s\", \"driver\": \"%s\", \"memory_mib\": %d}\n", $1, $2, $3 }' >"$WORK/device.json"

if [ ${#wheels[@]} -gt 0 ]; then
  run_step install 120 "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target '$SITE' $(printf "'%s' " "${wheels[@]}")"
else
  printf 'install\t\t\t\tno wheels in %s (make gpu-wheels)\n' "$WHEELS" >>"$WORK/steps.tsv"
  echo "-- install skipped: no wheels in $WHEELS"
fi

# What this interpreter imports and from where, and which entry points it finds (the report's `environment`).
timeout 90 python3 - >"$WORK/env.json" 2>>"$OUT/gpu_check.log" <<'EOF'
import importlib.metadata as md, importlib.util, json, platform
env = {"python": platform.python_version()}
try:
    import torch
    env.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
except Exception as err:
    env.update(torch=None, torch_error=repr(err))
try:
    import triton
    env["triton"] = triton.__version__
except Exception:
    env["triton"] = None
modules = ("arctic_rl_core", "arctic_rl_kernels", "arctic_rl_bench", "arctic_rl_plugins", "arctic_rl_recipes", "deepspeed", "pydantic")
env["imports"] = {m: getattr(importlib.util.find_spec(m), "origin", None) for m in modules}
env["entry_points"] = sorted(f"{e.name} = {e.value}" for e in md.entry_points(group="arctic_rl"))
try:  # where the project's metadata (its entry points) comes from: the wheel's dist-info in the site folder
    env["arctic_rl_metadata"] = str(md.distribution("arctic-rl").locate_file(""))
except md.PackageNotFoundError:
    env["arctic_rl_metadata"] = None
env["carried"] = {}
for name in ("arctic-rl", "deepspeed", "pydantic", "pydantic-core", "hjson", "pebble"):
    try:
        env["carried"][name] = md.version(name)
    except md.PackageNotFoundError:
        env["carried"][name] = None
print(json.dumps(env))
EOF

for entry in "${SELECTED[@]}"; do
  IFS='|' read -r name limit cmd <<<"$entry"
  run_step "$name" "$limit" "$cmd"
done
report 1

echo
printf '%-16s %5s %8s  %s\n' step rc seconds note
python3 - "$OUT/gpu_check.json" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
for s in report["steps"]:
    note = s.get("skipped") or ("timed out" if s["timed_out"] else "")
    if s["name"] == "kernel_tests" and isinstance(s["result"], dict):
        note = "{passed} passed, {failed} failed, {errors} errors, {skipped} skipped".format(**s["result"])
    print(f"{s['name']:<16} {'-' if s['rc'] is None else s['rc']:>5} {'-' if s['seconds'] is None else s['seconds']:>8}  {note}")
print(f"report: {sys.argv[1]} ({report['elapsed_s']}s; device {(report['device'] or {}).get('name')}, torch {report['torch']})")
EOF
# Exit 0 only if every step ran and passed (an install skipped for want of wheels aside).
awk -F'\t' '$2 != "0" && !($1 == "install" && $2 == "") { bad = 1 } END { exit bad }' "$WORK/steps.tsv"
