# Sourced by run.sh and `bench frameworks` from the repository root: SkyRL's own virtual environment
# (dependencies.sh), Arctic RL's thin client and the adapter installed into it; $VENV names it. The Arctic RL server
# runs in the main environment (.venv).
VENV=.cache/compat-skyrl-venv
compat_tests/skyrl/dependencies.sh
# As a user installs them into SkyRL's environment: Arctic RL's thin client (the base package, no extras), then
# the adapter's own distribution.
source compat_tests/client.sh
install_client "$VENV" ./adapters/skyrl
export ARCTIC_RL_MAIN_PYTHON="$PWD/.venv/bin/python"
