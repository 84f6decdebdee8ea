"""verl's phases through Arctic RL beside the backend's own calls on the same work, measured in one run.

Runs in verl's environment (`make bench-verl`, which builds it as `make compat` does). For each shape, the
documented `main_ppo` command of docs/verl.md runs K steps against one server; then the same server answers
the backend's direct calls on the same prompts and sampling: `generate` (one request per sample, as verl's
agent loop sends them), `log_probs`, `fwd_bwd` + `step`, `sync_weights`. The adapter's trace
(`ARCTIC_RL_VERL_TRACE`) gives its share of each phase: for generation, from the first request reaching
the rollout server to the last answer handed back; for log-probs and the update, the engine's time
(its client call inside). The rest of each `timing_s/*` is verl's own (agent loop, replay buffer, workers).

verl 0.9.1's replay buffer polls for finished rollouts every 2 s, which would round every `gen` phase up to
the next poll: the runs use a subclass that polls every `--poll-s` (`trainer.v1.sampler.custom_sampler`).

With `--adapter DIR` (repeatable) each round installs the adapter from each tree in turn into this
environment (for instance a worktree of an older commit), so adapter versions compare side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from compat_tests.main_server import serving  # noqa: E402
from conftest import JOBS, make_model  # noqa: E402
from test_main_ppo import REWARD, documented_command, write_data  # noqa: E402

SHAPES = {  # name: (prompts per step, samples per prompt, response tokens)
    "compat": (4, 4, 16),
    "generation-heavy": (4, 8, 256),
}
FAST_POLL = '''
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer


class FastPollReplayBuffer(ReplayBuffer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs, poll_interval={poll_s})
'''
PHASES = ("gen", "old_log_prob", "update_actor", "update_weights", "step")


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def verl_run(server: str, model: str, folder: Path, shape: tuple[int, int, int], steps: int, poll_s: float) -> dict:
    """The documented command at `shape` for `steps` steps: verl's per-step timings and the rollout trace."""
    prompts, n, response = shape
    folder.mkdir(parents=True)
    write_data(folder)
    (folder / "reward.py").write_text(REWARD)
    (folder / "fast_poll.py").write_text(FAST_POLL.format(poll_s=poll_s))
    trace = folder / "adapter-trace.jsonl"
    overrides = [f"data.train_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
                 f"actor_rollout_ref.rollout.n={n}", f"data.max_response_length={response}",
                 f"trainer.v1.sampler.custom_sampler.path={folder / 'fast_poll.py'}",
                 "trainer.v1.sampler.custom_sampler.name=FastPollReplayBuffer"]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "ARCTIC_RL_URL": server,
           "MODEL": model, "DATA": str(folder), "REWARD": str(folder / "reward.py"), "STEPS": str(steps),
           "OUT": str(folder / "out"), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_DEDUP_LOGS": "0", "ARCTIC_RL_VERL_TRACE": str(trace)}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    command = " ".join([documented_command("main_ppo").rstrip(), *overrides])
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=1800, env=env, cwd=folder)
    log = proc.stdout + proc.stderr
    (folder / "verl.log").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"verl failed; see {folder / 'verl.log'}:\n{log[-3000:]}")
    timings = {phase: [float(v) for v in re.findall(rf"timing_s/{phase}:(-?[0-9.eE+-]+)", log)] for phase in PHASES}
    calls = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    return {"timings": timings, "calls": calls}


def adapter_share(calls: list[dict]) -> dict[int, dict]:
    """Per verl step (the weights' step the rollout server held): first arrival to last answer, the backend's
    generate calls, how many calls and requests."""
    steps: dict[int, dict] = {}
    for call in calls:
        if call["kind"] != "generate":
            continue
        s = steps.setdefault(call["global_steps"], {"first": call["first_arrival"], "last": call["answered"],
                                                    "generate_s": 0.0, "calls": 0, "requests": 0})
        s["first"], s["last"] = min(s["first"], call["first_arrival"]), max(s["last"], call["answered"])
        s["generate_s"] += call["call_end"] - call["call_start"]
        s["calls"] += 1
        s["requests"] += call["requests"]
    return {k: {"span_s": v["last"] - v["first"], **v} for k, v in steps.items()}


def engine_share(calls: list[dict], kind: str) -> dict[str, float | None]:
    """The engine's calls of `kind` (one per step at these shapes), the first step's left out."""
    kept = [c for c in calls if c["kind"] == kind][1:]
    return {"adapter_s": median([c["adapter_s"] for c in kept]), "call_s": median([c["call_s"] for c in kept])}


def chat_prompts(model: str, count: int) -> list[list[int]]:
    """The training prompts as verl renders them (the model's chat template, with the generation prompt)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": f"what is {i} plus {i + 3}?"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))
            for i in range(count)]


def direct_calls(client, model: str, shape: tuple[int, int, int], repeats: int) -> dict[str, float]:
    """The backend's own calls on one step's work, medians of `repeats`."""
    from arctic_rl_core.types import SamplingParams, Sequence

    prompts, n, response = shape
    rows = [p for p in chat_prompts(model, prompts) for _ in range(n)]  # one request per sample, as verl sends
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=response)
    times: dict[str, list[float]] = {"generate": [], "log_probs": [], "fwd_bwd+step": [], "sync_weights": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        completions = client.generate(rows, sampling)
        times["generate"].append(time.perf_counter() - t0)
        seqs = [Sequence(prompt_ids=rows[c.prompt_index], response_ids=c.token_ids, group_id=c.prompt_index // n,
                         behaviour_logprobs=c.logprobs, advantages=[(-1.0) ** c.prompt_index] * len(c.token_ids))
                for c in completions]
        t0 = time.perf_counter()
        client.log_probs(seqs, with_entropy=True)
        times["log_probs"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        client.fwd_bwd(seqs, "grpo", return_logprobs=True, with_entropy=True)
        client.step()
        times["fwd_bwd+step"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        client.sync_weights()
        times["sync_weights"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def rollout_server_alone(url: str, model: str, shape: tuple[int, int, int], trees: list[str | None],
                         repeats: int) -> dict[str, dict[str, float]]:
    """The rollout server of each tree's adapter, without verl: one step's requests sent to it at once, as verl's
    agent loop sends them (one per sample), from the first request to the last answer; beside the backend's own
    `generate` of the same requests. Trees alternate within each repeat; medians."""
    import asyncio
    import importlib.util
    from types import SimpleNamespace

    from arctic_rl_core.client import ArcticRLClient
    from arctic_rl_core.types import SamplingParams

    import arctic_rl_verl

    prompts, n, response = shape
    rows = [p for p in chat_prompts(model, prompts) for _ in range(n)]
    config = SimpleNamespace(custom={"arctic": {"url": url}}, response_length=response, n=n)
    servers = {}
    for tree in trees:
        path = (os.path.join(tree, "adapters", "verl", "arctic_rl_verl", "rollout.py") if tree
                else os.path.join(os.path.dirname(arctic_rl_verl.__file__), "rollout.py"))
        spec = importlib.util.spec_from_file_location(f"rollout_{len(servers)}", path)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        servers[tree or "installed"] = module.ArcticServer(config, replica_rank=0)
    client = ArcticRLClient(url)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": response}
    times: dict[str, list[float]] = {name: [] for name in [*servers, "direct generate"]}

    async def step(server):
        return await asyncio.gather(*(server.generate(p, sampling, f"{i}") for i, p in enumerate(rows)))

    loop = asyncio.new_event_loop()
    for _ in range(repeats):
        for name, server in servers.items():
            t0 = time.perf_counter()
            loop.run_until_complete(step(server))
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        client.generate(rows, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=response))
        times["direct generate"].append(time.perf_counter() - t0)
    loop.close()
    return {name: {"median_s": statistics.median(v), "min_s": min(v)} for name, v in times.items()}


def install_adapter(tree: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps",
                    os.path.join(tree, "adapters", "verl")], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="verl steps per run; the first is left out (0: no verl run)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each direct call")
    parser.add_argument("--rounds", type=int, default=1, help="runs per adapter tree and shape, alternating")
    parser.add_argument("--poll-s", type=float, default=0.1, help="verl's replay buffer's poll interval (its own: 2 s)")
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: every shape")
    parser.add_argument("--adapter", action="append", help="an Arctic RL tree whose adapters/verl to install")
    parser.add_argument("--rollout-repeats", type=int, default=0,
                        help="also time each tree's rollout server alone (no verl) this many times per shape")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from arctic_rl_core.client import ArcticRLClient

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = make_model(str(work / "tiny-llama"))
        (work / "server").mkdir()
        # the server in a fresh interpreter, as a user starts it
        with serving({"model_path": model, **JOBS["single"]}, work / "server", fresh=True) as url:
            client = ArcticRLClient(url)
            for shape_name in args.shape or list(SHAPES):
                shape = SHAPES[shape_name]
                for round_ in range(args.rounds if args.steps else 0):
                    for tree in args.adapter or [None]:
                        if tree:
                            install_adapter(tree)
                        run = verl_run(url, model, work / f"{shape_name}-{round_}-{len(results)}", shape, args.steps,
                                       args.poll_s)
                        direct = direct_calls(client, model, shape, args.repeats)
                        shares = adapter_share(run["calls"])
                        kept = sorted(shares)[1:]  # the first step's generation warms the sampler up
                        result = {
                            "shape": shape_name, "prompts_x_n_x_response": shape, "round": round_, "adapter": tree,
                            "poll_s": args.poll_s,
                            "verl": {p: median(v[1:]) for p, v in run["timings"].items()},
                            "adapter_span": median([shares[k]["span_s"] for k in kept]),
                            "adapter_generate_calls": median([shares[k]["generate_s"] for k in kept]),
                            "calls_per_step": median([shares[k]["calls"] for k in kept]),
                            "engine": {kind: engine_share(run["calls"], kind) for kind in ("log_probs", "fwd_bwd")},
                            "direct": direct,
                        }
                        results.append(result)
                        report(result)
                if args.rollout_repeats:
                    alone = rollout_server_alone(url, model, shape, args.adapter or [None], args.rollout_repeats)
                    results.append({"shape": shape_name, "rollout_server_alone": alone})
                    print(f"\n{shape_name}: the rollout server alone, {args.rollout_repeats} repeats (s): {alone}",
                          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def report(r: dict) -> None:
    verl, direct = r["verl"], r["direct"]

    def row(name: str, through: float | None, own: float | None) -> str:
        if through is None or own is None:
            return f"| {name} | {through} | {own} | | |"
        over = through - own
        return f"| {name} | {through:.3f} | {own:.3f} | {over:+.3f} | {100 * over / own:+.0f}% |"

    print(f"\n{r['shape']} {r['prompts_x_n_x_response']} round {r['round']} adapter {r['adapter'] or 'installed'}: "
          f"{r['calls_per_step']} generate calls per step")
    print("| phase | through verl + Arctic RL (s) | the backend's own call (s) | overhead s | % |\n|---|---|---|---|---|")
    print(row("adapter's share of generation (first request to last answer)", r["adapter_span"], direct["generate"]))
    print(row("verl `timing_s/gen` (agent loop + adapter)", verl["gen"], direct["generate"]))
    agent_loop = None if verl["gen"] is None or r["adapter_span"] is None else verl["gen"] - r["adapter_span"]
    print(f"| verl's own agent loop and replay buffer (gen - adapter's share) | {agent_loop:.3f} | | | |")
    print(row("`timing_s/old_log_prob`", verl["old_log_prob"], direct["log_probs"]))
    print(row("adapter's share of it (engine; its client call)", r["engine"]["log_probs"]["adapter_s"],
              r["engine"]["log_probs"]["call_s"]))
    print(row("`timing_s/update_actor`", verl["update_actor"], direct["fwd_bwd+step"]))
    print(row("adapter's share of it: fwd_bwd (engine; its client call)", r["engine"]["fwd_bwd"]["adapter_s"],
              r["engine"]["fwd_bwd"]["call_s"]))
    print(row("`timing_s/update_weights`", verl["update_weights"], direct["sync_weights"]))
    print(f"| `timing_s/step` | {verl['step']:.3f} | | | |", flush=True)


if __name__ == "__main__":
    main()
