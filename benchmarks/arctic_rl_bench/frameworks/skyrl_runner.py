"""One column of `bench frameworks` for SkyRL 0.4: its documented GRPO (`main_base`, docs/skyrl.md) on a custom
SkyRL-Gym environment, as SkyRL documents one (`python -m skyrl_sql`: registers it, then runs SkyRL's experiment),
for S steps, alone (its FSDP2 worker and its own vLLM servers, in .cache/bench-skyrl-alone-venv, with the runtime
patches of alone/skyrl_alone_patches.py) or through Arctic RL (in SkyRL's compat environment); prints one JSON line
per run.

The environment rewards as every framework's columns do (a reply holding the answer's first digit): a random model
earns mixed rewards, so the weights move and each step's weight sync carries them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from skyrl_sql import ENV_ID  # noqa: E402
from workload import prompts, report, runner_parser, shape_from_json  # noqa: E402

# SkyRL's Timer names, as this bench's phases (the trainer's step, trainer.py). The fully async trainer
# (fully_async_trainer.py) has no `generate`: its `gen` is the wait for the generation buffer, the generation the
# step did not hide.
ASYNC_GEN = "timing/wait_for_generation_buffer"
PHASES = {"gen": "timing/generate", "old_log_prob": "timing/fwd_logprobs_values_reward",
          "update_actor": "timing/train_critic_and_policy", "update_weights": "timing/sync_weights",
          "step": "timing/step"}
METRICS = {"pg_loss": "policy/final_loss", "grad_norm": "policy/grad_norm", "reward": "reward/avg_raw_reward",
           "response_length": "generate/avg_num_tokens", "staleness": "async/staleness_mean",
           # the sampler's log-probs against the trainer's, token by token: a weight sync that did not land shows
           "rollout_logprob_diff_max": "policy/rollout_train_logprobs_abs_diff_max"}


def algorithm(model: str, folder: str, shape, steps: int) -> list[str]:
    """SkyRL's GRPO as every column runs it: one update a step, the bench's optimizer, no KL."""
    return [
        f"trainer.policy.model.path={model}", f"data.train_data=['{folder}/train.parquet']",
        f"data.val_data=['{folder}/train.parquet']", "data.dataloader.num_workers=0",  # as docs/skyrl.md
        f"environment.env_class={ENV_ID}", "trainer.algorithm.advantage_estimator=grpo", "trainer.algorithm.use_kl_loss=false",
        f"generator.n_samples_per_prompt={shape.samples_per_prompt}",
        f"trainer.train_batch_size={shape.prompts_per_step}",
        f"trainer.policy_mini_batch_size={shape.prompts_per_step}",  # one update per step, as in verl's columns
        f"generator.sampling_params.max_generate_length={shape.response_tokens}",
        f"trainer.max_prompt_length={shape.prompt_tokens + 16}", "trainer.policy.optimizer_config.lr=1e-5",
        "trainer.epochs=1", f"trainer.max_training_steps={steps}", "trainer.eval_before_train=false",
        "trainer.eval_interval=-1", "trainer.ckpt_interval=-1", "trainer.logger=tensorboard",
        "generator.inference_engine.enable_ray_prometheus_stats=false", "trainer.placement.colocate_all=false",
        f"trainer.export_path={folder}/export", f"trainer.ckpt_path={folder}/ckpt", f"trainer.log_path={folder}/logs",
    ]


def through_arctic(url: str) -> list[str]:
    return ["trainer.override_entrypoint=arctic_rl_skyrl.entrypoint", f"trainer.arctic_rl.url={url}",
            "generator.inference_engine.run_engines_locally=false",
            f"generator.inference_engine.external_proxy_url={url}"]


ALONE = os.path.join(HERE, "alone")


def alone(folder: str, threads: int, dtype: str = "float32") -> tuple[list[str], dict]:
    """SkyRL's own FSDP2 worker and vLLM server on a CPU: the settings it needs to run here (each says why), then the
    tuning a competent user would choose (docs/benchmarks.md has each one's measured effect); and the environment
    that loads the runtime patches in every process."""
    env = {"PYTHONPATH": os.pathsep.join([os.path.join(ALONE, "skyrl_site"), ALONE, HERE]),
           "OMP_NUM_THREADS": str(threads),  # Ray would start each worker with one thread
           "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache: more than a step's samples take
    needed = [
        "generator.inference_engine.run_engines_locally=true", "generator.inference_engine.num_engines=1",
        "generator.inference_engine.tensor_parallel_size=1",
        # NCCL and CUDA IPC need GPUs: SkyRL's own disk path (checkpoint deltas) syncs the weights instead.
        "generator.inference_engine.weight_sync_backend=delta",
        f"generator.inference_engine.delta_weight_sync.sync_dir={folder}/delta",
        # vLLM's Ray executor asks Ray for GPU bundles; one engine of one rank runs in processes of its own instead,
        # on vLLM's CPU worker (SkyRL names the GPU worker where vLLM would choose).
        "generator.inference_engine.distributed_executor_backend=mp",
        "generator.inference_engine.engine_init_kwargs.worker_cls=vllm.v1.worker.cpu_worker.CPUWorker",
        "generator.inference_engine.enforce_eager=true", "generator.inference_engine.model_dtype=float32",
        "generator.inference_engine.gpu_memory_utilization=0.05",
        "trainer.strategy=fsdp2", "trainer.flash_attn=false",  # SDPA: flash-attention has no CPU build,
        "trainer.remove_microbatch_padding=false",  # and padding removal needs it
    ]
    tuned = [
        "trainer.gradient_checkpointing=false",  # memory is plenty: recomputing costs time
        # The compute dtype is the bench's `--dtype`, as the job's engine computes through Arctic RL.
        *COMPUTE[dtype],
        # Micro-batches stay at SkyRL's default, one sample each: one micro-batch of the step's 32 samples measured
        # slower on the prompt-heavy shape (its padding mask and activations leave the caches) and faster on the
        # generation-heavy one (docs/benchmarks.md gives both).
    ]
    return needed + tuned, env


# SkyRL's settings that compute its update and log-probs in each dtype, over fp32 weights and optimizer state.
COMPUTE = {
    "float32": ("trainer.bf16=false",
                "trainer.policy.fsdp_config.mixed_precision={param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}"),
    # SkyRL's defaults: FSDP2 mixed precision, bf16 compute, fp32 gradient reduction (fast where the CPU has
    # AVX-512 BF16: docs/benchmarks.md).
    "bfloat16": ("trainer.bf16=true",
                 "trainer.policy.fsdp_config.mixed_precision={param_dtype: bf16, reduce_dtype: fp32, buffer_dtype: fp32}"),
}


def write_dataset(folder: str, model: str, shape) -> dict:
    import pandas as pd

    pairs, lengths = prompts(model, shape)
    pd.DataFrame([{"data_source": "arctic_sql", "prompt": [{"role": "user", "content": content}], "env_class": ENV_ID,
                   "reward_spec": {"method": "rule", "ground_truth": answer}, "extra_info": {"split": "train", "index": i}}
                  for i, (content, answer) in enumerate(pairs)]).to_parquet(os.path.join(folder, "train.parquet"))
    return lengths


def steps_from(tensorboard: str) -> list[dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tensorboard, size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    by_step: dict[int, dict] = {}
    for name, tag in [*PHASES.items(), ("gen", ASYNC_GEN), *METRICS.items()]:
        if tag not in tags:
            continue
        for event in events.Scalars(tag):
            row = by_step.setdefault(event.step, {"step": event.step, "seconds": {}})
            if name in PHASES:
                row["seconds"][name] = event.value
            else:
                row[name] = event.value
    return [by_step[k] for k in sorted(by_step)]


def trainer_mismatch(overrides: list[str], steps: list[dict]) -> str | None:
    """Why the run's trainer is not the one asked for (SkyRL's fully async trainer logs each step's staleness, its
    synchronous one does not), or None."""
    asked = "trainer.fully_async.enabled=true" in overrides
    ran = any("staleness" in s for s in steps)
    if steps and asked != ran:
        return (f"asked for SkyRL's {'fully async' if asked else 'synchronous'} trainer, and the steps "
                f"{'do not log' if asked else 'log'} the fully async trainer's staleness")
    return None


def patches_in_effect(folder: str, log: str) -> list[str]:
    """What the alone patches printed, from SkyRL's log and its workers' (under trainer.log_path)."""
    texts = [log]
    logs = os.path.join(folder, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name), errors="replace") as f:
            texts.append(f.read())
    return sorted({m for text in texts for m in re.findall(r"\[skyrl-alone patches\] pid=\d+ in effect: (.+)", text)})


def main() -> int:
    parser = runner_parser(__doc__.split("\n")[0], ("alone", "arctic"), tuple(COMPUTE))
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="alone: OMP_NUM_THREADS for SkyRL's Ray workers (Ray's default is 1)")
    args = parser.parse_args()

    shape = shape_from_json(args.shape)
    os.makedirs(args.work, exist_ok=True)
    lengths = write_dataset(args.work, args.model, shape)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "TENSORBOARD_DIR": os.path.join(args.work, "tb"), "PYTHONPATH": HERE}  # skyrl_sql, in every process
    if args.column == "arctic":
        backend = through_arctic(args.url)
    else:
        backend, alone_env = alone(args.work, args.threads, args.dtype)
        env.update(alone_env)
        # A Ray cluster of its own, which SkyRL joins: two logical GPUs (its policy worker's placement group and its
        # vLLM server ask Ray for one each), in a short folder (AF_UNIX's 107 bytes bound its socket paths).
        ray_tmp = tempfile.mkdtemp(prefix="ray-alone-")
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        subprocess.run([ray, "start", "--head", "--num-cpus", "16", "--num-gpus", "2", "--temp-dir", ray_tmp,
                        "--include-dashboard", "false", "--disable-usage-stats"], env=env, check=True,
                       capture_output=True)
        env["RAY_ADDRESS"] = "auto"
    argv = [sys.executable, "-m", "skyrl_sql", *backend,
            *algorithm(args.model, args.work, shape, args.steps), *args.override]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=args.work)
    finally:
        if args.column == "alone":
            subprocess.run([ray, "stop", "--force"], env=env, capture_output=True)
            shutil.rmtree(ray_tmp, ignore_errors=True)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    with open(os.path.join(args.work, "skyrl.log"), "w") as f:
        f.write(log)
    steps = steps_from(os.path.join(args.work, "tb")) if proc.returncode == 0 else []
    result = {"framework": "skyrl", "column": args.column, "returncode": proc.returncode, "wall_s": wall,
              "steps": steps, "command": argv[1:], **lengths}
    if args.column == "alone":
        result["patches_applied"] = patches_in_effect(args.work, log)
    wrong = trainer_mismatch(args.override, steps)
    if wrong:
        result["returncode"], log = 1, f"{log}\n{wrong}"
    return report(result, log, args.steps)


if __name__ == "__main__":
    sys.exit(main())
