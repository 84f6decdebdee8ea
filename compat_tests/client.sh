# Sourced from the repository root by the compat suites' scripts and `bench frameworks`' environments:
# `install_client VENV [ADAPTER_DIR...]` installs Arctic RL's thin client (the base package, no extras) and the given
# adapters' own distributions into VENV, as a user installs them: regular installs from wheels (Hydra finds an
# adapter's search-path plugin). The first install replaces what an earlier run of this checkout left (same version,
# other code) without touching the framework's packages; the second brings whatever the client needs that VENV lacks.
# Each wheel is built once: pip builds a source tree again at each install (about 3-5 CPU s each), and the suites
# installed each twice. Where ARCTIC_RL_WHEELS names a folder (`make compat` sets one for its run), a wheel built
# there is taken by every environment after it: the client's is the same pure-Python wheel in each.
install_client() {
  local venv=$1 wheels status=0 project
  shift
  wheels=$(mktemp -d)
  for project in . "$@"; do
    _client_wheel "$venv" "$project" "$wheels" || { status=$?; break; }
  done
  [ "$status" = 0 ] &&
    "$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheels"/*.whl &&
    "$venv/bin/python" -m pip install --quiet "$wheels"/*.whl || status=$?
  rm -rf "$wheels"
  return "$status"
}
# `_client_wheel VENV PROJECT INTO`: PROJECT's wheel into the folder INTO, built with VENV's pip, or taken from
# ARCTIC_RL_WHEELS. There the lanes build one at a time: setuptools builds in the source tree's build/, and two
# builds of one project at once collide there.
_client_wheel() {
  local venv=$1 project=$2 into=$3 shared lock status=0
  if [ -z "${ARCTIC_RL_WHEELS:-}" ]; then
    "$venv/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$into" "$project"
    return
  fi
  shared=$ARCTIC_RL_WHEELS/$(printf %s "$project" | tr -c 'A-Za-z0-9' _)
  exec {lock}> "$ARCTIC_RL_WHEELS/.lock"
  flock "$lock"
  if [ ! -d "$shared" ]; then
    "$venv/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$shared.building" "$project" &&
      mv "$shared.building" "$shared" || status=$?
    rm -rf "$shared.building"
  fi
  exec {lock}>&-
  [ "$status" = 0 ] && cp "$shared"/*.whl "$into"/
}
