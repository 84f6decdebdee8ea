# Sourced by run.sh and bench.sh from the repository root: verl's own virtual environment with
# verl[verl-core]==0.9.1 (verl's transformers pin conflicts with vLLM's), Arctic RL's thin client and the
# adapter installed into it; $VENV names it. The Arctic RL server runs in the main environment (.venv).
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.cache/compat-verl-venv
STAMP=$VENV/.installed-verl-0.9.1
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade "pip==24.3.1"
  # torch exactly pinned first: the local CPU wheel (verl's `cpu` extra would pin torch 2.11.0).
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet "verl[verl-core]==0.9.1" "pytest==9.2.0" "pandas>=2" "pyarrow>=15"
  touch "$STAMP"
fi
# As a user installs them into verl's environment: Arctic RL's thin client (the base package, no extras),
# then the adapter's own distribution, both regular installs (Hydra finds the adapter's search-path plugin).
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps . ./adapters/verl
"$VENV/bin/python" -m pip install --quiet . ./adapters/verl
export ARCTIC_RL_MAIN_PYTHON="$PWD/.venv/bin/python"
