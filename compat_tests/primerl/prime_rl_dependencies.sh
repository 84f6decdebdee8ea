#!/usr/bin/env bash
# prime-rl 0.8.0 (559b447) itself in a Python 3.12 environment of its own, for the trainer-side tests: its packer,
# senders, loss functions and orchestrator. prime-rl is not on the package index: its source and the verifiers
# commit it pins come from the vendored archives ($ARCTIC_RL_VENDOR, else ../shared/vendor beside the repository).
# Its dependencies come from the index at prime-rl's uv.lock versions (torch excepted: SkyRL's, see below), less
# what the index cannot serve (git-only or CUDA-only; stubs/README.md names each and the two import-only stubs
# that stand in). vLLM is installed
# without its dependency closure: the orchestrator imports it, nothing here runs it. Built once (a stamp marks
# it); exits 3 when the archives are not on this machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.cache/compat-prime-rl-venv
STAMP=$VENV/.installed-prime-rl-559b447-torch-2.13.0
[ -f "$STAMP" ] && exit 0
VENDOR=${ARCTIC_RL_VENDOR:-$(cd .. && pwd)/shared/vendor}
PRIME_RL=$VENDOR/prime-rl-559b447.tar.gz
VERIFIERS=$VENDOR/verifiers-a60a606.tar.gz
if [ ! -f "$PRIME_RL" ] || [ ! -f "$VERIFIERS" ]; then
  echo "compat_tests/primerl: prime-rl's archives are not in $VENDOR (set ARCTIC_RL_VENDOR): prime-rl is not on the package index" >&2
  exit 3
fi
source compat_tests/python312.sh
source scripts/uv.sh
PYTHON=${PRIMERL_PYTHON:-$(python312)}
[ -n "$PYTHON" ] || { echo "compat_tests/primerl: prime-rl needs Python 3.12 and none runs here (set PRIMERL_PYTHON)" >&2; exit 1; }

rm -rf "$VENV"
uv_venv "$VENV" "$PYTHON" 26.1.2
PIP=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)
SRC=$VENV/src
mkdir -p "$SRC/prime-rl" "$SRC/verifiers" "$SRC/wheels"
tar -xzf "$PRIME_RL" -C "$SRC/prime-rl" --strip-components=1
tar -xzf "$VERIFIERS" -C "$SRC/verifiers" --strip-components=1

# Every package prime-rl's uv.lock takes from the index, at its locked version, but torch and what is built for
# it: torch 2.13.0 is SkyRL's environment's, on disk once (scripts/uv.sh), where the lock has 2.11.0 (for vLLM, which
# nothing here runs); the CUDA builds' own nvidia-* and cuda-* pins are left to that torch.
"$VENV/bin/python" - "$SRC/prime-rl/uv.lock" "$SRC/constraints.txt" <<'EOF'
import re, sys, tomllib
lock = tomllib.load(open(sys.argv[1], "rb"))
pins = {f"{p['name']}=={p['version'].split('+')[0]}" for p in lock["package"]
        if "registry" in p.get("source", {}) and not re.match(r"^(nvidia-|cuda-|torch$|torchvision$|torchaudio$|triton$)", p["name"])}
open(sys.argv[2], "w").write("\n".join(sorted(pins)) + "\n")
EOF
uv_pip "$VENV" -c "$SRC/constraints.txt" "setuptools==77.0.3" "wheel==0.48.0" "hatchling==1.33.0" \
  "hatch-vcs==0.5.0" "setuptools-scm==10.3.4"

# The archives have no git metadata: verifiers' version is the one prime-rl asks for, marked with the commit.
SETUPTOOLS_SCM_PRETEND_VERSION="0.3.1.dev59+ga60a606" \
  "${PIP[@]}" wheel --no-deps --no-build-isolation -w "$SRC/wheels" "$SRC/verifiers"
"${PIP[@]}" wheel --no-deps --no-build-isolation -w "$SRC/wheels" "$SRC/prime-rl/packages/prime-rl-configs" "$SRC/prime-rl"

# prime-rl's [project.dependencies] that the index serves, at uv.lock's versions, but torch (above), torchvision
# and torchaudio (the index has no torchaudio for torch 2.13; nothing prime-rl runs here imports either). torchao,
# flash-linear-attention, renderers and prime-pydantic-config are the index's releases of what the lock takes from
# git or a submodule.
# modelexpress goes in without its metadata's protobuf<6 (prime-rl overrides it so too); these are its others.
uv_pip "$VENV" -c "$SRC/constraints.txt" "verifiers[harbor] @ file://$(ls "$PWD/$SRC"/wheels/verifiers-*.whl)" \
  "$(ls "$SRC"/wheels/prime_rl_configs-*.whl)" \
  "prime-pydantic-config[toml]==0.4.3" "renderers==0.1.10.dev13" \
  "torch==2.13.0" "torchdata==0.11.0" "triton==3.7.1" \
  "transformers==5.6.2" "torchao==0.17.0" "tilelang==0.1.9" \
  "flash-linear-attention==0.5.2" "fla-core==0.5.2" "ring-flash-attn==0.1.8" \
  "mooncake-transfer-engine==0.3.11.post1" \
  "beartype==0.22.9" "datasets==4.6.1" "jaxtyping==0.3.10" "loguru==0.7.3" "pyarrow==24.0.0" \
  "numpy==2.3.5" "pandas==3.0.3" "wandb==0.27.0" "wandb-workspaces==0.4.3" "prime==0.6.19" \
  "pyzmq==27.1.0" "msgspec==0.21.1" "aiolimiter==1.2.1" "tenacity==9.1.4" "openai==2.38.0" \
  "orjson==3.11.9" "rich==15.0.0" "setproctitle==1.3.7" "uvloop==0.22.1" \
  "nvidia-ml-py==13.595.45" "pybase64==1.4.3" "safetensors==0.7.0" "huggingface-hub==1.16.1" \
  "prometheus-client==0.25.0" "psutil==7.2.2" "httpx==0.28.1" "requests==2.34.2" "harbor==0.21.0" \
  "grpcio==1.80.0" "protobuf==6.33.6" "nixl[cu12]==0.10.1" "nixl-cu12==0.10.1" "pydantic==2.13.4" \
  "pytest==9.0.3"
# prime-rl's own list names git-only torchtitan and dion; vLLM's closure is CUDA's.
uv_pip "$VENV" --no-deps "$(ls "$SRC"/wheels/prime_rl-*.whl)" "modelexpress==0.3.0" "vllm==0.26.0"
uv_pip "$VENV" -c "$SRC/constraints.txt" regex cachetools blake3 py-cpuinfo cloudpickle openai-harmony \
  partial-json-parser watchfiles python-json-logger cbor2 ijson

# Import-only stubs, after site-packages on sys.path: a real package of the same name always wins.
# Each comes with a dist-info of another name, which transformers' availability checks need (stubs/README.md).
mkdir -p "$VENV/primerl-stubs"
cp -r compat_tests/primerl/stubs/flash_attn compat_tests/primerl/stubs/torchtitan compat_tests/primerl/stubs/*.dist-info \
  "$VENV/primerl-stubs/"
"$VENV/bin/python" -c 'import sysconfig, sys; open(sysconfig.get_paths()["purelib"] + "/zz_primerl_stubs.pth", "w").write(sys.argv[1] + "\n")' \
  "$PWD/$VENV/primerl-stubs"
# what the orchestrator and the env server import, at once
uv_warm "$VENV" prime_rl.entrypoints.orchestrator prime_rl.orchestrator.orchestrator prime_rl.entrypoints.env_server \
  verifiers pytest
touch "$STAMP"
