# Sourced by the dependency scripts of the Python 3.12 environments (SkyRL's, prime-rl's): `uv_pip VENV ARGS...`
# installs into VENV with uv, pinned, from one cache beside the environments. uv hard-links what it installs from
# that cache, so the CUDA build of torch 2.13.0 with its nvidia-* libraries and triton (about 4.5 GB; the index's
# only torch for Python 3.12), which both environments take, lies on the disk once; pip would unpack it into each
# and keep its wheels in its own cache too (CI's disk ran out that way). Bytecode is compiled at install, as pip
# does: these machines set PYTHONDONTWRITEBYTECODE, so without it every process compiles torch's sources again
# (SkyRL's tests took twice as long); CI, which lets processes write bytecode, sets UV_COMPILE_BYTECODE=0. Run
# from the repository root.
UV_VERSION=0.13.9
export UV_CACHE_DIR=$PWD/.cache/uv-cache UV_LINK_MODE=hardlink UV_PYTHON_DOWNLOADS=never UV_NO_CONFIG=1 \
  UV_NO_PROGRESS=1 UV_COMPILE_BYTECODE=${UV_COMPILE_BYTECODE:-1}
uv_binary() {
  local tool=.cache/uv-$UV_VERSION
  if [ ! -x "$tool/bin/uv" ]; then
    rm -rf "$tool"
    "${PYTHON311:-$(command -v python3.11 || command -v python3)}" -m venv "$tool"
    "$tool/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
  fi
  echo "$PWD/$tool/bin/uv"
}
# `uv_venv VENV PYTHON PIP`: a new environment at VENV on Python PYTHON, with pip at version PIP, which the
# compat runs use to install Arctic RL's client from this checkout.
uv_venv() {
  "$(uv_binary)" venv --quiet --python "$2" "$1"
  uv_pip "$1" "pip==$3"
}
uv_pip() {
  local venv=$1
  shift
  "$(uv_binary)" pip install --quiet --python "$venv/bin/python" "$@"
}
