# Sourced by run.sh and bench.sh from the repository root: verl's own virtual environment (dependencies.sh),
# Arctic RL's thin client and the adapter installed into it; $VENV names it. The Arctic RL server runs in the
# main environment (.venv).
VENV=.cache/compat-verl-venv
compat_tests/verl/dependencies.sh
# As a user installs them into verl's environment: Arctic RL's thin client (the base package, no extras),
# then the adapter's own distribution, both regular installs (Hydra finds the adapter's search-path plugin).
source compat_tests/client.sh
install_client "$VENV" ./adapters/verl
export ARCTIC_RL_MAIN_PYTHON="$PWD/.venv/bin/python"
