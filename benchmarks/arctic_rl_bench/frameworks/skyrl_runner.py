"""One column of `bench frameworks` for SkyRL 0.4: its documented GRPO (`python -m skyrl.train.entrypoints.main_base`,
docs/skyrl.md) for S steps through Arctic RL, in SkyRL's compat environment; prints one JSON line per run.

SkyRL alone is not run (bench.py says why). The reward is SkyRL-Gym's gsm8k environment (`#### n` holding the
answer), which a random model rarely earns: the columns compare the engines' time on the same work, and the
losses are near zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workload import prompts, report, runner_parser, shape_from_json  # noqa: E402

# SkyRL's Timer names, as this bench's phases (the trainer's step, trainer.py). The fully async trainer
# (fully_async_trainer.py) has no `generate`: its `gen` is the wait for the generation buffer, the generation the
# step did not hide.
ASYNC_GEN = "timing/wait_for_generation_buffer"
PHASES = {"gen": "timing/generate", "old_log_prob": "timing/fwd_logprobs_values_reward",
          "update_actor": "timing/train_critic_and_policy", "update_weights": "timing/sync_weights",
          "step": "timing/step"}
METRICS = {"pg_loss": "policy/final_loss", "grad_norm": "policy/grad_norm", "reward": "reward/avg_raw_reward",
           "response_length": "generate/avg_num_tokens", "staleness": "async/staleness_mean"}


def command(url: str, model: str, folder: str, shape, steps: int) -> list[str]:
    return [
        sys.executable, "-m", "skyrl.train.entrypoints.main_base",
        "trainer.override_entrypoint=arctic_rl_skyrl.entrypoint", f"trainer.arctic_rl.url={url}",
        "generator.inference_engine.run_engines_locally=false",
        f"generator.inference_engine.external_proxy_url={url}",
        "generator.inference_engine.enable_ray_prometheus_stats=false", "trainer.placement.colocate_all=false",
        f"trainer.policy.model.path={model}", f"data.train_data=['{folder}/train.parquet']",
        f"data.val_data=['{folder}/train.parquet']", "environment.env_class=gsm8k",
        "trainer.algorithm.advantage_estimator=grpo", "trainer.algorithm.use_kl_loss=false",
        f"generator.n_samples_per_prompt={shape.samples_per_prompt}",
        f"trainer.train_batch_size={shape.prompts_per_step}",
        f"trainer.policy_mini_batch_size={shape.prompts_per_step}",  # one update per step, as in verl's columns
        f"trainer.micro_train_batch_size_per_gpu={shape.prompts_per_step * shape.samples_per_prompt}",
        f"trainer.micro_forward_batch_size_per_gpu={shape.prompts_per_step * shape.samples_per_prompt}",
        f"generator.sampling_params.max_generate_length={shape.response_tokens}",
        f"trainer.max_prompt_length={shape.prompt_tokens + 16}", "trainer.policy.optimizer_config.lr=1e-5",
        "trainer.epochs=1", f"trainer.max_training_steps={steps}", "trainer.eval_before_train=false",
        "trainer.eval_interval=-1", "trainer.ckpt_interval=-1", "trainer.logger=tensorboard",
        f"trainer.export_path={folder}/export", f"trainer.ckpt_path={folder}/ckpt", f"trainer.log_path={folder}/logs",
    ]


def write_dataset(folder: str, model: str, shape) -> dict:
    import pandas as pd

    pairs, lengths = prompts(model, shape)
    pd.DataFrame([{"data_source": "arctic_sql", "prompt": [{"role": "user", "content": content}], "env_class": "gsm8k",
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


def main() -> int:
    args = runner_parser(__doc__.split("\n")[0]).parse_args()

    shape = shape_from_json(args.shape)
    os.makedirs(args.work, exist_ok=True)
    lengths = write_dataset(args.work, args.model, shape)
    argv = command(args.url, args.model, args.work, shape, args.steps) + args.override
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "TENSORBOARD_DIR": os.path.join(args.work, "tb")}
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=args.work)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    with open(os.path.join(args.work, "skyrl.log"), "w") as f:
        f.write(log)
    steps = steps_from(os.path.join(args.work, "tb")) if proc.returncode == 0 else []
    result = {"framework": "skyrl", "column": args.column, "returncode": proc.returncode, "wall_s": wall,
              "steps": steps, "command": argv[1:], **lengths}
    return report(result, log, args.steps)


if __name__ == "__main__":
    sys.exit(main())
