"""One column of `bench frameworks` for prime-rl 0.8: its own `env-server` and `orchestrator` (stock, from their
TOMLs, docs/primerl.md) with `arctic-rl-primerl-trainer` for S steps through Arctic RL, in prime-rl's environment;
prints one JSON line per run.

prime-rl alone is not run (bench.py says why). The workload is the other columns' (`primerl_sql`: the same prompts
and reward). prime-rl's trainer has no separate log-prob pass: its loss takes the sampler's log-probs as the old
policy's, so ZoRRo shortens the update alone. Its orchestrator's staleness bound is an `--override`
(`max_off_policy_steps=N`, the one setting taken): 0 trains each step on rollouts of the weights before it, 1 lets
the orchestrator run ahead by a step; the trainer's `wait` is the generation it did not hide. With `--rollout-cpus`
and `--trainer-cpus` (bench's `--placement disaggregated`) the env server and the orchestrator run on generation's
cores, the trainer process on the trainer's, as prime-rl deploys its inference and its trainer apart.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workload import prompts, report, runner_parser, shape_from_json  # noqa: E402

ROOT = HERE.parents[2]
BIN = Path(sys.executable).parent
TIMEOUT_S = 1800


def free_port(span: int = 1) -> int:
    """A port free with the `span - 1` after it (prime-rl's ZMQ transport binds its port and the next)."""
    while True:
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                for k in range(1, span):
                    with socket.socket() as other:
                        other.bind(("127.0.0.1", port + k))
            except OSError:
                continue
            return port


def off_policy_steps(overrides: list[str]) -> int:
    """The orchestrator's `max_off_policy_steps` from the bench's overrides (1, prime-rl's asynchronous step, if none)."""
    steps = 1
    for override in overrides:
        key, _, value = override.partition("=")
        if key != "max_off_policy_steps" or not value.isdigit():
            raise SystemExit(f"--override={override}: this runner takes max_off_policy_steps=N only")
        steps = int(value)
    return steps


def configs(work: Path, model: str, url: str, shape, steps: int, off_policy: int) -> dict[str, Path]:
    """The env server's, the orchestrator's (no [trainer], no [inference]) and the trainer's TOMLs."""
    out, env_address = work / "run", f"tcp://127.0.0.1:{free_port()}"
    shared = (f'output_dir = "{out}"\nmax_steps = {steps}\n[model]\nname = "{model}"\n'
              f'[rollout_transport]\ntype = "zmq"\nport = {free_port(span=2)}\n')
    taskset = '[env.taskset]\nid = "primerl_sql"\n[env.agent.runtime]\ntype = "subprocess"\n'
    batch = shape.prompts_per_step * shape.samples_per_prompt
    texts = {
        "env": f'output_dir = "{out}"\n{taskset}[serve]\naddress = "{env_address}"\n[serve.pool]\ntype = "static"\n'
               "num_workers = 1\n",
        "orchestrator": (f"seq_len = {shape.prompt_tokens + shape.response_tokens + 64}\nbatch_size = {batch}\n"
                         f"group_size = {shape.samples_per_prompt}\nnum_train_workers = 1\nmax_off_policy_steps = {off_policy}\n"
                         f"collect_inference_metrics = false\n{shared}[model.client]\nbase_url = \"{url}/v1\"\n"
                         '[renderer]\nname = "default"\n'
                         f"[train.sampling]\nmax_completion_tokens = {shape.response_tokens}\n"
                         '[[train.source]]\nname = "sql"\n' + taskset.replace("[env.", "[train.source.env.")
                         + f'[train.source.serve]\naddress = "{env_address}"\n[weight_broadcast]\ntype = "filesystem"\n'
                         f"[concurrency]\nmax_inflight = {batch}\n"),
        # The other columns' optimizer (1e-5; SkyRL's and verl's weight decay and clipping are the job's).
        "trainer": f"{shared}[optim]\nlr = 1e-5\n",
    }
    paths = {}
    for name, text in texts.items():
        paths[name] = work / f"{name}.toml"
        paths[name].write_text(text)
    return paths


ROLES = {"env": "rollout", "orchestrator": "rollout", "trainer": "trainer"}
"""Which cores each process runs on where the bench places them apart (the trainer process is the client of the
server's trainer)."""


def cores(text: str | None) -> set[int] | None:
    return None if text is None else {int(c) for c in text.split(",")}


@contextmanager
def _starting_thread_on(cores: set[int] | None):
    """While a process starts, the thread that starts it runs on `cores`: the process starts on them (Linux keeps
    an affinity per thread, and a new process takes its starting thread's), before it runs a line. Not a
    `preexec_fn`: that makes Python fork a copy of the caller, refused (ENOMEM) once one of the caller's mappings
    is larger than the machine's memory, where a plain start copies nothing (vfork)."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run(work: Path, model: str, url: str, shape, steps: int, off_policy: int,
        placed: dict[str, set[int]] | None = None) -> tuple[dict[str, int | None], float, dict[str, list[int]]]:
    """The three processes until the orchestrator and the trainer end; their exit codes, the wall time, and where
    `placed` (role -> cores) held them, each process's cores as read back."""
    paths = configs(work, model, url, shape, steps, off_policy)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1",
           "ARCTIC_RL_BENCH_PROMPTS": str(work / "prompts.json"),
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "compat_tests" / "primerl"), str(ROOT)])}
    commands = {"env": [BIN / "env-server", "@", paths["env"]],
                "orchestrator": [BIN / "orchestrator", "@", paths["orchestrator"]],
                "trainer": [BIN / "arctic-rl-primerl-trainer", "--arctic-rl-url", url, "@", paths["trainer"]]}

    started = time.perf_counter()
    procs = {}
    for name, command in commands.items():
        with _starting_thread_on(placed[ROLES[name]] if placed else None):
            procs[name] = subprocess.Popen(command, env=env, cwd=work, stdout=open(work / f"{name}.log", "w"),
                                           stderr=subprocess.STDOUT)
    on_cores = {name: sorted(os.sched_getaffinity(proc.pid)) for name, proc in procs.items()} if placed else {}
    deadline = time.time() + TIMEOUT_S
    try:
        while time.time() < deadline and any(procs[n].poll() is None for n in ("orchestrator", "trainer")):
            if any(procs[n].poll() not in (None, 0) for n in procs):
                break
            time.sleep(1)
        codes = {name: proc.poll() for name, proc in procs.items() if name != "env"}
        return codes, time.perf_counter() - started, on_cores
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def steps_from(out: Path) -> list[dict]:
    """Per step: the trainer's phases (arctic_rl_trainer.jsonl) and the orchestrator's reward (metrics.jsonl)."""
    rewards = {}
    if (out / "metrics.jsonl").exists():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            m = json.loads(line)
            if "train/agg/all/agent/reward/mean" in m:
                rewards[m["step"]] = m["train/agg/all/agent/reward/mean"]
    rows = []
    for line in (out / "arctic_rl_trainer.jsonl").read_text().splitlines():
        r = json.loads(line)
        seconds = {"wait": r["wait_s"], "update_actor": r["fwd_bwd_s"], "update_weights": r["step_sync_s"]}
        rows.append({"step": r["step"], "seconds": {**seconds, "step": sum(seconds.values())}, "pg_loss": r["loss"],
                     "grad_norm": r["grad_norm"], "reward": rewards.get(r["step"]),
                     "computed_tokens": r["computed_tokens"], "unshared_tokens": r["unshared_tokens"]})
    return rows


def main() -> int:
    parser = runner_parser(__doc__.split("\n")[0])
    parser.add_argument("--rollout-cpus", help="the env server's and the orchestrator's cores (comma-separated)")
    parser.add_argument("--trainer-cpus", help="the trainer process's cores")
    args = parser.parse_args()
    if (args.rollout_cpus is None) != (args.trainer_cpus is None):
        parser.error("--rollout-cpus and --trainer-cpus go together")
    placed = None if args.rollout_cpus is None else {"rollout": cores(args.rollout_cpus),
                                                     "trainer": cores(args.trainer_cpus)}

    shape = shape_from_json(args.shape)
    off_policy = off_policy_steps(args.override)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    pairs, lengths = prompts(args.model, shape)
    (work / "prompts.json").write_text(json.dumps(pairs))
    codes, wall, on_cores = run(work, args.model, args.url, shape, args.steps, off_policy, placed)
    log = "".join(f"--- {name}\n" + (work / f"{name}.log").read_text(errors="replace")[-4000:]
                  for name in ("orchestrator", "trainer", "env"))
    ok = codes == {"orchestrator": 0, "trainer": 0}
    result = {"framework": "primerl", "column": args.column, "returncode": 0 if ok else 1, "exit_codes": codes,
              "wall_s": wall, "steps": steps_from(work / "run") if ok else [], **lengths,
              **({"process_cpus": on_cores} if on_cores else {})}
    return report(result, log, args.steps)


if __name__ == "__main__":
    sys.exit(main())
