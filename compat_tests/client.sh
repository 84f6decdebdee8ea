# Sourced from the repository root by the compat suites' scripts and `bench frameworks`' environments:
# `install_client VENV [ADAPTER_DIR...]` installs Arctic RL's thin client (the base package, no extras) and the given
# adapters' own distributions into VENV, as a user installs them: regular installs from wheels (Hydra finds an
# adapter's search-path plugin). The first install replaces what an earlier run of this checkout left (same version,
# other code) without touching the framework's packages; the second brings whatever the client needs that VENV lacks.
# Each wheel is built once: pip builds a source tree again at each install (about 5 CPU s each), and the suites
# installed each twice.
install_client() {
  local venv=$1 wheels status=0
  shift
  wheels=$(mktemp -d)
  "$venv/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$wheels" . "$@" &&
    "$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheels"/*.whl &&
    "$venv/bin/python" -m pip install --quiet "$wheels"/*.whl || status=$?
  rm -rf "$wheels"
  return "$status"
}
