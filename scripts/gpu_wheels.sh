#!/usr/bin/env bash
# `make gpu-wheels`: the wheels a bare GPU machine (docs/gpu.md) lacks, for its Python 3.12 on x86-64, into
# $WHEELS (default .gpu-wheels, git-ignored): DeepSpeed as a py3 wheel, pydantic and its own needs, hjson,
# pebble, and the project's own wheel (its entry points). Runs again without fetching what is already there;
# the project's wheel is always rebuilt from the working tree. Fails if a wheel's needs are neither carried nor
# preinstalled there (scripts/gpu_preinstalled.txt), or if the folder exceeds 64 MiB (what one call carries).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WHEELS=${WHEELS:-.gpu-wheels}
LIMIT_MIB=${LIMIT_MIB:-64}
# The extras the GPU check imports; the server extra (fastapi, uvicorn) is not on its path.
GPU_EXTRAS=${GPU_EXTRAS:-train recipes}
mkdir -p "$WHEELS"

# A version: constraints-cpu.txt's pin, else what the project's venv runs (the versions its tests pass with).
version() {
  local pin
  pin=$(grep -i -E "^$1==" constraints-cpu.txt | head -1 | cut -d= -f3 || true)
  if [ -n "$pin" ]; then echo "$pin"; return; fi
  "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"
}

# pip, without this machine's warnings about its local index folders that have no such project.
pip() {
  { "$PY" -m pip "$@" 2>&1 1>&3 | { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }; } 3>&1
}
BINARY=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --no-deps -d "$WHEELS")
keep=()
fetch() {  # NAME VERSION: one wheel for the GPU machine, downloaded once
  local name=$1 ver=$2 glob
  glob=$(echo "$name" | tr - _)
  keep+=("$glob-$ver-")
  if ! compgen -G "$WHEELS/$glob-$ver-*.whl" >/dev/null; then
    echo "fetching $name==$ver"
    pip download -q "${BINARY[@]}" "$name==$ver"
  fi
}

fetch pydantic "$(version pydantic)"
core=$(unzip -p "$WHEELS"/pydantic-"$(version pydantic)"-*.whl '*/METADATA' |
       sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
fetch pydantic-core "$core"   # exactly the version pydantic names
for name in annotated-types typing-inspection typing-extensions hjson pebble; do
  fetch "$name" "$(version "$name")"
done

ds=$(version deepspeed)
keep+=("deepspeed-$ds-py3-none-any")
if ! [ -f "$WHEELS/deepspeed-$ds-py3-none-any.whl" ]; then
  echo "building deepspeed==$ds (no compiled ops: they build on first use there)"
  export DS_BUILD_OPS=0
  pip wheel -q --no-deps --no-binary deepspeed -w "$WHEELS" "deepspeed==$ds"
fi

# The project's own wheel, built from a copy of what travels to the machine (tracked and untracked,
# not ignored), so the build writes no build/ or egg-info into the working tree.
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && mkdir -p "$src/$(dirname "$f")" && cp -p "$f" "$src/$f"
done
rm -f "$WHEELS"/arctic_rl-*.whl
pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$src" >/dev/null
keep+=("arctic_rl-")

# One version of each: an older one left behind would stop the whole install there.
for whl in "$WHEELS"/*.whl; do
  base=$(basename "$whl")
  wanted=no
  for k in "${keep[@]}"; do case $base in "$k"*) wanted=yes ;; esac; done
  [ $wanted = yes ] || { echo "removing $base (not wanted)"; rm -f "$whl"; }
done
ls "$WHEELS"/deepspeed-*-py3-none-any.whl >/dev/null   # DeepSpeed must be pure Python

# What the machine records about this build: the report names it when the machine has no git.
git_commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
dirty=$([ -n "$(git status --porcelain 2>/dev/null)" ] && echo true || echo false)
printf '{"commit": "%s", "dirty": %s, "built": "%s"}\n' "$git_commit" "$dirty" "$(date -u +%FT%TZ)" >"$WHEELS/BUILD_INFO.json"

# Each wheel's needs (no extras but the GPU path's, markers for Python 3.12 on Linux): carried or preinstalled.
"$PY" - "$WHEELS" scripts/gpu_preinstalled.txt "$GPU_EXTRAS" <<'EOF'
import pathlib, re, sys, zipfile
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

wheels, preinstalled, extras = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3].split()
there = {canonicalize_name(l.split("#")[0].strip()) for l in preinstalled.read_text().splitlines() if l.split("#")[0].strip()}
carried, needs = {}, []
for whl in sorted(wheels.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    name = canonicalize_name(re.search(r"^Name: (.+)$", meta, re.M).group(1))
    carried[name] = whl
    own = extras if name == "arctic-rl" else []
    for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        req = Requirement(line)
        env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython"}
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in own + [""]):
            needs.append((name, req))
missing = [f"{who} needs {req}" for who, req in needs
           if canonicalize_name(req.name) not in carried and canonicalize_name(req.name) not in there]
for who, req in needs:
    dep = canonicalize_name(req.name)
    if dep in carried and (v := re.match(r"[^-]+-([^-]+)-", carried[dep].name).group(1)) not in req.specifier:
        missing.append(f"{who} needs {req}, carried {v}")
if missing:
    sys.exit("needs met neither by the wheels nor by the machine:\n  " + "\n  ".join(missing))
EOF

ls -l "$WHEELS" | awk 'NR > 1 {printf "%9.1f KiB  %s\n", $5 / 1024, $9}'
total=$(du -cb "$WHEELS"/* | tail -1 | cut -f1)
awk -v t="$total" -v d="$WHEELS" -v l="$LIMIT_MIB" 'BEGIN { printf "total %.2f MiB in %s (limit %s MiB)\n", t / 1048576, d, l }'
[ "$total" -le $((LIMIT_MIB * 1048576)) ] || { echo "over $LIMIT_MIB MiB: one device call cannot carry it" >&2; exit 1; }
