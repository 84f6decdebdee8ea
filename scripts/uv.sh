# Sourced by `make install` (scripts/venv.sh) and the compat environments' dependency scripts: `uv_pip VENV ARGS...`
# installs into VENV with uv, pinned, from uv's own cache (UV_CACHE_DIR, or uv's default, ~/.cache/uv). uv hard-links
# what it installs from that cache, so what several environments take lies on the disk once and is unpacked once:
# the CUDA build of torch 2.13.0 with its nvidia-* libraries and triton (about 4.5 GB; the index's only torch for
# Python 3.12), which SkyRL's and prime-rl's take, and the local CPU build, which the development environment's,
# verl's and Tinker's take; a later build takes them from the cache again (a cache on another file system than the
# environments: uv copies). pip would unpack each into each environment at each build (CI's disk ran out that way;
# the development environment took 51 CPU s with pip, 5 with uv from its cache; verl's 29 with pip, 9 with uv).
# Bytecode is compiled at install, as pip does: these machines set PYTHONDONTWRITEBYTECODE, so without it every
# process compiles torch's sources again (SkyRL's tests took twice as long); CI, which lets processes write bytecode,
# sets UV_COMPILE_BYTECODE=0. uv reads none of pip's configuration: the folders where pip finds local wheels (the
# machine's CPU torch, environment.md) are passed on (`pip_find_links`). Run from the repository root.
UV_VERSION=0.13.9
export UV_LINK_MODE=hardlink UV_PYTHON_DOWNLOADS=never UV_NO_CONFIG=1 UV_NO_PROGRESS=1 \
  UV_COMPILE_BYTECODE=${UV_COMPILE_BYTECODE:-1}
# uv itself, beside its cache (one for the user's checkouts), installed by the first caller (CI's install and its
# environment builds start at once: the second waits for the first).
uv_binary() {
  local tool=${XDG_CACHE_HOME:-$HOME/.cache}/arctic-rl/uv-$UV_VERSION lock
  mkdir -p "$(dirname "$tool")"
  exec {lock}> "$tool.lock"
  flock "$lock"
  if [ ! -x "$tool/bin/uv" ]; then
    rm -rf "$tool"
    "${PYTHON311:-$(command -v python3.11 || command -v python3)}" -m venv "$tool"
    "$tool/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
  fi
  exec {lock}>&-
  echo "$tool/bin/uv"
}
# `uv_venv VENV PYTHON PIP`: a new environment at VENV on Python PYTHON, with pip at version PIP (the compat runs
# install Arctic RL's client from this checkout with it; a developer's environment has it as `python -m venv` would).
uv_venv() {
  "$(uv_binary)" venv --quiet --python "$2" "$1"
  uv_pip "$1" "pip==$3"
}
uv_pip() {
  local venv=$1
  shift
  "$(uv_binary)" pip install --quiet --python "$venv/bin/python" "$@"
}
# `pip_find_links`: `--find-links DIR` for each folder of local wheels that pip's configuration names (PIP_FIND_LINKS,
# or its configuration files), for uv_pip.
pip_find_links() {
  local folders folder
  folders=${PIP_FIND_LINKS:-$("${PYTHON311:-$(command -v python3.11 || command -v python3)}" -m pip config get \
    global.find-links 2> /dev/null || true)}
  for folder in $folders; do
    printf -- '--find-links\n%s\n' "$folder"
  done
}
# `uv_warm VENV MODULE...`: where installs leave bytecode to the first import (UV_COMPILE_BYTECODE=0, as CI sets: most
# of the libraries' files are never imported), one process imports the modules the suites' processes import, and
# writes their bytecode once. Processes that start together otherwise each compile the same modules (a framework's
# Ray actors, the Tinker tenants' loops): `make compat` took 863 CPU s on fresh environments, 739 on used ones.
uv_warm() {
  local venv=$1
  shift
  [ "${UV_COMPILE_BYTECODE:-1}" = 0 ] && [ -z "${PYTHONDONTWRITEBYTECODE:-}" ] || return 0
  # Only a head start: a module that fails to import here fails where a suite imports it.
  timeout 600 "$venv/bin/python" -c '
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as error:
        print(f"uv_warm: {name}: {error!r}", file=sys.stderr)
' "$@" > /dev/null || true
}
