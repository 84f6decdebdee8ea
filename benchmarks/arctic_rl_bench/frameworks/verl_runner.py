"""One column of `bench frameworks` for verl 0.9.1: its documented GRPO (`python -m verl.trainer.main_ppo`) for
S steps, alone or through Arctic RL, in the environment of that column; prints one JSON line per run.

Run by path with that environment's interpreter (the orchestrator does), never imported by the main one:
`alone` runs in an environment with verl and vLLM and nothing of Arctic RL; `arctic` in verl's compat
environment (verl + the adapter), against a server the orchestrator started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workload import SEED, report, runner_parser, shape_from_json, write_verl_dataset  # noqa: E402

PHASES = ("gen", "old_log_prob", "update_actor", "update_weights", "step")
METRICS = {"pg_loss": "actor/pg_loss", "grad_norm": "actor/grad_norm", "reward": "critic/score/mean",
           "response_length": "response_length/mean"}

FAST_POLL = '''
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer


class FastPollReplayBuffer(ReplayBuffer):
    """verl's replay buffer polls for finished rollouts every 2 s, which rounds every gen phase up to the next
    poll: both columns poll every 0.1 s."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs, poll_interval=0.1)
'''


def algorithm(shape, steps: int, folder: str, model: str) -> list[str]:
    """The settings both columns share: one GRPO algorithm, one update per step, no KL."""
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={folder}/train.parquet", f"data.val_files={folder}/val.parquet",
        f"reward.custom_reward_function.path={folder}/reward.py",
        "algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={shape.samples_per_prompt}",
        f"data.train_batch_size={shape.prompts_per_step}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={shape.prompts_per_step}",
        f"data.max_prompt_length={shape.prompt_tokens + 16}", f"data.max_response_length={shape.response_tokens}",
        "data.shuffle=False", f"data.seed={SEED}", "actor_rollout_ref.actor.use_kl_loss=False",
        "algorithm.use_kl_in_reward=False", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.optim.lr=1e-5", "actor_rollout_ref.rollout.temperature=1.0",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.logger=[console]", f"trainer.default_local_dir={folder}/checkpoints", "trainer.save_freq=-1",
        f"trainer.v1.sampler.custom_sampler.path={folder}/fast_poll.py",
        "trainer.v1.sampler.custom_sampler.name=FastPollReplayBuffer",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.device=cpu",
        "data.dataloader_num_workers=0", "actor_rollout_ref.rollout.agent.num_workers=1", "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "ray_kwargs.ray_init.num_cpus=16", "+ray_kwargs.ray_init.num_gpus=1",
    ]


ALONE_PATCHES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "alone")


# verl's FSDP engine computes in `fsdp_config.mixed_precision.param_dtype`, bf16 when that is unset; it never reads
# `fsdp_config.dtype` (only its Megatron engine does: verl/workers/engine/fsdp/transformer_impl.py). In both, the
# weights and the optimizer state stay fp32 (`model_dtype=fp32`), and so does the gradient reduction (`reduce_dtype`).
COMPUTE = {
    "float32": "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}",
    # verl's default: bf16 compute under autocast, fp32 gradient reduction.
    "bfloat16": "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: bf16, reduce_dtype: fp32, buffer_dtype: fp32}",
}


DIAGNOSTICS = ("D1", "D2")
"""The diagnostic patches (alone/verl_alone_patches.py DIAGNOSTICS): verl alone with a CPU fallback replaced."""


def alone(shape, ray_tmp: str, threads: int, dtype: str = "float32", diagnostics: tuple[str, ...] = ()) -> tuple[list[str], dict]:
    """verl's own FSDP actor and vLLM rollout on a CPU: the settings it needs to run here (each says why), then the
    tuning a competent user would choose (docs/benchmarks.md has each one's measured effect); and the environment
    that loads the runtime patches (alone/verl_alone_patches.py) in every process, Ray's workers included, with the
    `diagnostics` named (none: verl alone)."""
    env = {"PYTHONPATH": ALONE_PATCHES, "VERL_USE_EXTERNAL_MODULES": "verl_alone_patches",
           "VERL_ENGINE_DEVICE": "cuda",  # verl registers its FSDP engine for cuda and npu only (engine lookup only)
           "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "2"}
    if diagnostics:
        env["VERL_ALONE_DIAGNOSTICS"] = ",".join(diagnostics)
    batch = shape.prompts_per_step * shape.samples_per_prompt
    needed = [
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.strategy=fsdp2",  # FSDP1 refuses CPU modules
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # its default needs flash-attention,
        "actor_rollout_ref.model.use_remove_padding=False",  # and so does padding removal
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32", COMPUTE[dtype],  # the bench's `--dtype`
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.enforce_eager=True",  # vLLM-CPU: no graphs; no sleep mode
        "actor_rollout_ref.rollout.free_cache_engine=False", "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",  # on a CPU: the share of RAM for the KV cache
        f"actor_rollout_ref.rollout.max_model_len={shape.prompt_tokens + 16 + shape.response_tokens}",
        "+ray_kwargs.ray_init.include_dashboard=False", f"+ray_kwargs.ray_init._temp_dir={ray_tmp}",
        *[f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in env.items() if k != "VLLM_CPU_KVCACHE_SPACE"],
    ]
    tuned = [
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",  # memory is plenty: recomputing costs time
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False", "actor_rollout_ref.actor.use_torch_compile=False",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch}",  # one micro-batch: fewer, larger matmuls
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch}",
    ]
    return needed + tuned, env


def through_arctic(url: str) -> list[str]:
    return ["--config-name", "arctic_ppo_trainer", "trainer.backend=arctic-rl", f"actor_rollout_ref.actor.arctic.url={url}"]


def parse(log: str) -> list[dict]:
    """verl's console logger writes one `step:N - key:value - ...` line per step."""
    steps = []
    for line in log.splitlines():
        match = re.search(r"step:(\d+) - (.*)", line)
        if not match or "timing_s/step" not in line:
            continue
        values = dict(re.findall(r"([\w/@.\-]+):(-?[0-9.eE+\-]+|nan|inf)(?: - |$)", match.group(2)))
        row = {"step": int(match.group(1)),
               "seconds": {phase: float(values[f"timing_s/{phase}"]) for phase in PHASES if f"timing_s/{phase}" in values}}
        row.update({name: float(values[key]) for name, key in METRICS.items() if key in values})
        steps.append(row)
    return steps


def backend_shares(trace_path: str, steps: list[dict]) -> None:
    """Through Arctic RL, the adapter's trace (arctic_rl_verl.trace) gives each step the backend's share of its
    phases: generation from the first request reaching the rollout server to the last answer; for log-probs and
    the update, the engine's client calls (one of each per step at one mini-batch a step)."""
    if not os.path.exists(trace_path):
        return
    with open(trace_path) as f:
        calls = [json.loads(line) for line in f]
    spans: dict[int, list[float]] = {}
    for call in calls:
        if call["kind"] == "generate":
            first, last = spans.get(call["global_steps"], (call["first_arrival"], call["answered"]))
            spans[call["global_steps"]] = (min(first, call["first_arrival"]), max(last, call["answered"]))
    engine = {kind: [c["call_s"] for c in calls if c["kind"] == kind] for kind in ("log_probs", "fwd_bwd")}
    for i, row in enumerate(steps):
        share = {}
        if row["step"] in spans:
            share["gen"] = spans[row["step"]][1] - spans[row["step"]][0]
        for kind, phase in (("log_probs", "old_log_prob"), ("fwd_bwd", "update_actor")):
            if len(engine[kind]) == len(steps):
                share[phase] = engine[kind][i]
        row["backend_seconds"] = share


def main() -> int:
    parser = runner_parser(__doc__.split("\n")[0], ("alone", "arctic"), tuple(COMPUTE))
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="alone: OMP_NUM_THREADS for verl's Ray workers (Ray's default is 1)")
    parser.add_argument("--diagnostic", action="append", default=[], choices=DIAGNOSTICS,
                        help="alone: apply this diagnostic patch (not verl as shipped: verl_alone_patches.DIAGNOSTICS)")
    args = parser.parse_args()

    shape = shape_from_json(args.shape)
    os.makedirs(args.work, exist_ok=True)
    lengths = write_verl_dataset(args.work, args.model, shape)
    with open(os.path.join(args.work, "fast_poll.py"), "w") as f:
        f.write(FAST_POLL)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", RAY_DEDUP_LOGS="0")
    if args.column == "arctic":
        head, tail = through_arctic(args.url), []
    else:
        # A Ray cluster of its own, in a short folder: its socket paths must stay within AF_UNIX's 107 bytes.
        ray_tmp = tempfile.mkdtemp(prefix="ray-alone-")
        head, (tail, alone_env) = [], alone(shape, ray_tmp, args.threads, args.dtype, tuple(args.diagnostic))
        env.update(alone_env)
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *head, *algorithm(shape, args.steps, args.work, args.model),
               *tail, *args.override]
    trace = os.path.join(args.work, "adapter-trace.jsonl")
    if args.column == "arctic":
        env["ARCTIC_RL_VERL_TRACE"] = trace
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=args.work)
    finally:
        if args.column == "alone":
            shutil.rmtree(ray_tmp, ignore_errors=True)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    with open(os.path.join(args.work, "verl.log"), "w") as f:
        f.write(log)
    steps = parse(log)
    backend_shares(trace, steps)
    result = {"framework": "verl", "column": args.column, "returncode": proc.returncode, "wall_s": wall,
              "steps": steps, "command": command[1:], **lengths}
    if args.column == "alone":  # what each process applied, as the patches printed it
        result["patches_applied"] = sorted(set(re.findall(r"\[verl-alone patches\] pid=\d+ applied=(\[.*?\])", log)))
        result["diagnostics"] = args.diagnostic
    return report(result, log, args.steps)


if __name__ == "__main__":
    sys.exit(main())
