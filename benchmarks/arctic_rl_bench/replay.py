"""`arctic-rl bench replay`: what router replay (R3) removes, and what it costs, on a tiny Qwen3-MoE.

The sampler runs in bf16 and the trainer in fp32, as in the field, so they compute the routers' scores apart. The
routers are built with near-ties (every expert's router row is the first's plus `--tie` times noise), so close
choices flip between the two as they do at scale. Measured at the start, on the same sampled batch:
- the fraction of (token, MoE layer) routes where the trainer's own top-k set differs from the sampler's;
- the sampler-vs-trainer log-prob gap of the sampled tokens, replay off and on, beside a dense Qwen3 of the same
  size (the same layers and widths, its MLP as wide as the experts a token runs) sampled and trained alike.
Then a short GRPO run (toy reward: the share of even token ids in a response) with R3 and with replay off, from the
same weights and seeds: per step, before the update, the spread (std) of the importance ratio pi_trainer /
pi_sampler over the sampled tokens and the k3 estimate of KL(sampler || trainer) (in the R3 run also through the
trainer's own routers on the same batch, with the share of flipped routes: what replay removed that step); the
reward; and the seconds of sampling (recording routes or not) and of the update (replaying or not).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

SIZES = dict(layers=4, hidden=128, heads=4, kv_heads=2, max_positions=256)
COST_REPEATS = 10


def near_tie_moe(directory: str, tie: float, seed: int = 0) -> str:
    """A tiny Qwen3-MoE (8 experts, 2 per token) whose routers nearly tie: every expert's router row is expert 0's
    plus `tie` times noise, so each token's top-2 is decided by small score differences."""
    import torch
    from transformers import AutoModelForCausalLM

    from arctic_rl_core.models.tiny import make_tiny_model

    make_tiny_model("qwen3_moe", directory, seed=seed, shape=dict(experts=8, experts_per_token=2), **SIZES)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.mlp.gate.weight  # [experts, hidden]
            weight[1:] = weight[:1] + tie * torch.randn(weight[1:].shape, generator=generator)
    model.save_pretrained(directory)
    return directory


def _backend(model_dir: str, replay: str, learning_rate: float, sampler: str):
    """`sampler`: transformers, or vllm, whose engine then runs in a process of its own (the bench builds several
    jobs in one process; an in-process engine's shutdown would end the process's torch.distributed)."""
    from arctic_rl_core.backend import InProcessBackend

    placement = {"placement": "subprocess"} if sampler == "vllm" else {}
    return InProcessBackend({"model_path": model_dir, "router_replay": replay,
                             "engine": {"learning_rate": learning_rate, "zero_stage": 0},
                             "sampler": {"name": sampler, "dtype": "bfloat16", **placement}})


def _prompts(count: int, length: int, seed: int, vocab: int = 500) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def _sequences(prompts, completions, group: int, rewards=None):
    from arctic_rl_core.types import Sequence, behaviour

    seqs = []
    for i, c in enumerate(completions):
        advantage = 0.0 if rewards is None else rewards[i]
        seqs.append(Sequence(prompt_ids=prompts[c.prompt_index], response_ids=c.token_ids, group_id=c.prompt_index,
                             advantages=[advantage] * len(c.token_ids), **behaviour(c)))
    return seqs


def _without_routes(seqs):
    return [s.model_copy(update={"routed_experts": None}) for s in seqs]


def _gap(trainer: list[list[float]], sampler: list[list[float]]) -> dict:
    import numpy as np

    diff = np.abs(np.concatenate([np.asarray(t) - np.asarray(s) for t, s in zip(trainer, sampler)]))
    return {"mean": float(diff.mean()), "max": float(diff.max())}


def _ratio_stats(trainer: list[list[float]], sampler: list[list[float]]) -> dict:
    import numpy as np

    log_ratio = np.concatenate([np.asarray(t) - np.asarray(s) for t, s in zip(trainer, sampler)])
    ratio = np.exp(log_ratio)
    return {"ratio_std": float(ratio.std()), "kl_k3": float(np.mean(ratio - 1 - log_ratio)),
            "ratio_max": float(ratio.max()), "ratio_min": float(ratio.min())}


def _flipped(native, sampled, moe_layers: list[int]) -> float:
    """Share of (token, MoE layer) whose top-k expert sets differ between two routing records."""
    import numpy as np

    flips = total = 0
    for own, theirs in zip(native, sampled):
        b = np.sort(theirs.array()[:, moe_layers], axis=-1)
        a = np.sort(own.array()[: len(b), moe_layers], axis=-1)
        flips += int((a != b).any(-1).sum())
        total += a.shape[0] * a.shape[1]
    return flips / total


def mismatch(moe_dir: str, dense_dir: str, prompts, sampling: dict, sampler: str) -> dict:
    out = {}
    for name, path in (("moe", moe_dir), ("dense", dense_dir)):
        backend = _backend(path, "R3", 1e-3, sampler)  # no step is taken
        try:
            completions = backend.generate(prompts, sampling)
            seqs = _sequences(prompts, completions, sampling["n"])
            sampler_lp = [c.logprobs for c in completions]
            native = backend.log_probs(_without_routes(seqs))
            row = {"tokens": sum(len(c.token_ids) for c in completions), "gap_off": _gap(native.logprobs, sampler_lp)}
            if name == "moe":
                layers = list(backend.engine.replay_shape.moe_layers)
                replayed = backend.log_probs(seqs)
                row.update(gap_on=_gap(replayed.logprobs, sampler_lp),
                           flipped_off=_flipped(native.routed_experts, [s.routed_experts for s in seqs], layers),
                           flipped_on=_flipped(replayed.routed_experts, [s.routed_experts for s in seqs], layers))
            out[name] = row
        finally:
            backend.close()
    return out


def grpo(model_dir: str, replay: str, prompts, sampling: dict, steps: int, learning_rate: float,
         sampler: str) -> list[dict]:
    import numpy as np

    backend = _backend(model_dir, replay, learning_rate, sampler)
    history = []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            # vLLM seeds a request's n samples seed, seed + 1, ...: each step's seeds start past the last step's.
            completions = backend.generate(prompts, {**sampling, "seed": 1000 + step * sampling["n"]})
            sample_s = time.perf_counter() - t0
            rewards = np.array([np.mean([t % 2 == 0 for t in c.token_ids]) if c.token_ids else 0.0 for c in completions])
            groups = np.array([c.prompt_index for c in completions])
            advantages = np.zeros_like(rewards)
            for g in set(groups.tolist()):
                members = groups == g
                advantages[members] = (rewards[members] - rewards[members].mean()) / (rewards[members].std() + 1e-6)
            seqs = _sequences(prompts, completions, sampling["n"], advantages.tolist())
            sampler_lp = [c.logprobs for c in completions]
            before = backend.log_probs(seqs)  # the trainer's view of the batch it will update on
            stats = _ratio_stats(before.logprobs, sampler_lp)
            if replay != "off":  # the same batch through the trainer's own routers: what replay removed this step
                native = backend.log_probs(_without_routes(seqs))
                layers = list(backend.engine.replay_shape.moe_layers)
                stats.update({f"{k}_native": v for k, v in _ratio_stats(native.logprobs, sampler_lp).items()},
                             flipped_native=_flipped(native.routed_experts, [s.routed_experts for s in seqs], layers))
            t0 = time.perf_counter()
            backend.fwd_bwd(seqs, "grpo")
            backend.step()
            train_s = time.perf_counter() - t0
            backend.sync_weights()
            history.append({"step": step, "reward": float(rewards.mean()), **stats,
                            "sample_s": sample_s, "train_s": train_s})
    finally:
        backend.close()
    return history


def cost(model_dir: str, prompts, sampling: dict, repeats: int, sampler: str) -> dict:
    """Seconds side by side, alternating, medians of `repeats`, on one R3 job: `generate` recording routes and not
    (the same sampler with its recording detached, hooks included: nothing else differs; two jobs side by side on
    this 2-core machine differed by more than the recording); `fwd_bwd` of the same batch replaying its routes and
    through the trainer's own routing. With vLLM, also the bytes of its workers' per-KV-slot routing store."""
    backend = _backend(model_dir, "R3", 1e-3, sampler)
    recorder = getattr(backend.sampler, "router_replay", None)

    def recording(on: bool):
        if sampler == "vllm":
            backend.sampler.record_routed_experts(on)
        else:
            backend.sampler.router_replay = recorder if on else None

    def generate(record: bool):
        recording(record)
        try:
            backend.generate(prompts, sampling)
        finally:
            recording(True)

    try:
        completions = backend.generate(prompts, sampling)
        seqs = _sequences(prompts, completions, sampling["n"], [1.0] * len(completions))
        ways = {"generate_R3": lambda: generate(True), "generate_off": lambda: generate(False),
                "fwd_bwd_replayed": lambda: backend.fwd_bwd(seqs, "grpo"),
                "fwd_bwd_own_routing": lambda: backend.fwd_bwd(_without_routes(seqs), "grpo")}
        times: dict[str, list[float]] = {name: [] for name in ways}
        pairs = [list(ways)[:2], list(ways)[2:]]
        for round_ in range(repeats + 1):  # the first round warms up
            # Each pair's order swaps every round: what runs first follows the other pair's work (the trainer's
            # OpenMP threads still spinning after a fwd_bwd slowed whichever generate came first by ~5%).
            for name in [name for pair in pairs for name in (pair[::-1] if round_ % 2 else pair)]:
                fn = ways[name]
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                backend.discard_gradients()
        medians = {name: statistics.median(ts[1:]) for name, ts in times.items()}
        # Each round's own ratio, then their median: a round's pair ran under the same machine load.
        for ratio, (on, off) in (("generate_ratio", ("generate_R3", "generate_off")),
                                 ("fwd_bwd_ratio", ("fwd_bwd_replayed", "fwd_bwd_own_routing"))):
            medians[ratio] = statistics.median(a / b for a, b in zip(times[on][1:], times[off][1:]))
        if sampler == "vllm":
            medians["store_bytes"] = backend.sampler.routed_experts["store_bytes"]
        return medians
    finally:
        backend.close()


def worker(steps: int, tie: float, prompts: int, group: int, max_tokens: int, sampler: str) -> dict:
    from arctic_rl_core.models.tiny import make_tiny_model

    root = tempfile.mkdtemp(prefix="arctic-rl-bench-replay-")
    moe_dir = near_tie_moe(f"{root}/moe", tie)
    # The dense twin: a token runs 2 experts of the MoE's expert width (its default: the hidden size).
    dense_dir = make_tiny_model("qwen3", f"{root}/dense", shape=dict(intermediate=2 * SIZES["hidden"]), **SIZES)
    batch = _prompts(prompts, 24, seed=0)
    sampling = {"n": group, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "seed": 0}
    result = {"benchmark": "replay", "sampler": sampler, "tie": tie, "prompts": prompts, "group": group,
              "max_tokens": max_tokens, "steps": steps, "mismatch": mismatch(moe_dir, dense_dir, batch, sampling, sampler),
              "runs": {}}
    for replay in ("R3", "off"):
        result["runs"][replay] = grpo(moe_dir, replay, batch, sampling, steps, 1e-3, sampler)
    result["cost_s"] = cost(moe_dir, batch, sampling, COST_REPEATS, sampler)
    return result


def summary(result: dict) -> dict:
    """Medians over the steps after the first (its seconds include warm-up)."""
    out = {}
    for replay, history in result["runs"].items():
        later = history[1:] or history
        out[replay] = {key: statistics.median(h[key] for h in later) for key in
                       ("ratio_std", "kl_k3", "sample_s", "train_s", "ratio_std_native", "kl_k3_native", "flipped_native")
                       if key in history[0]}
        out[replay]["reward_first"], out[replay]["reward_last"] = history[0]["reward"], history[-1]["reward"]
    return out


def plot(result: dict, path: str) -> None:
    """Per step: the importance ratio's spread, KL(sampler || trainer) and the reward, replay on and off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"R3": "C0", "R3 native": "C1", "off": "C2"}
    for replay, history in result["runs"].items():
        steps = [h["step"] for h in history]
        for ax, key in zip(axes, ("ratio_std", "kl_k3", "reward")):
            ax.plot(steps, [h[key] for h in history], color=colors[replay], label=f"replay {replay}")
            if f"{key}_native" in history[0]:
                ax.plot(steps, [h[f"{key}_native"] for h in history], "--", color=colors[f"{replay} native"],
                        label=f"{replay} run's batches, trainer's own routing")
    for ax, title in zip(axes, ("importance ratio std (sampler -> trainer)", "KL(sampler || trainer), k3", "reward")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def run(steps: int, tie: float, prompts: int, group: int, max_tokens: int, sampler: str = "transformers") -> dict:
    from arctic_rl_bench.measure import run_worker

    return run_worker("arctic_rl_bench.replay", str(steps), str(tie), str(prompts), str(group), str(max_tokens),
                      sampler)


def add_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tie", type=float, default=3e-3, help="noise between the near-tied router rows")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--sampler", choices=["transformers", "vllm"], default="transformers",
                   help="the sampler that records the routing (bf16 either way)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", help="write the per-step curves to this PNG")


def main(args) -> int:
    result = run(args.steps, args.tie, args.prompts, args.group, args.max_tokens, args.sampler)
    result["summary"] = summary(result)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
        return 0
    m = result["mismatch"]
    print(f"bf16 {result['sampler']} sampler, fp32 trainer; {m['moe']['tokens']} sampled tokens; router near-tie noise "
          f"{result['tie']}")
    print(f"flipped routes (token, MoE layer): replay off {m['moe']['flipped_off']:.2%}   on {m['moe']['flipped_on']:.2%}")
    print(f"sampler-vs-trainer |log-prob gap| mean/max: MoE off {m['moe']['gap_off']['mean']:.2e}/{m['moe']['gap_off']['max']:.2e}"
          f"   MoE R3 {m['moe']['gap_on']['mean']:.2e}/{m['moe']['gap_on']['max']:.2e}"
          f"   dense {m['dense']['gap_off']['mean']:.2e}/{m['dense']['gap_off']['max']:.2e}")
    print(f"GRPO, {result['steps']} steps, medians of steps 2..:")
    for replay, s in result["summary"].items():
        print(f"  replay {replay:3s}: ratio std {s['ratio_std']:.2e}  KL(k3) {s['kl_k3']:.2e}  sample {s['sample_s']:.3f} s"
              f"  update {s['train_s']:.3f} s  reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}")
        if "ratio_std_native" in s:
            print(f"        same batches, trainer's own routing: ratio std {s['ratio_std_native']:.2e}  "
                  f"KL(k3) {s['kl_k3_native']:.2e}  flipped routes {s['flipped_native']:.2%}")
    c = result["cost_s"]
    print(f"cost, medians of {COST_REPEATS} alternating: generate recording routes {c['generate_R3']:.3f} s vs not {c['generate_off']:.3f} s"
          f" (x{c['generate_ratio']:.2f} paired);  fwd_bwd replaying {c['fwd_bwd_replayed']:.3f} s vs own routing "
          f"{c['fwd_bwd_own_routing']:.3f} s (x{c['fwd_bwd_ratio']:.2f} paired)")
    if "store_bytes" in c:
        print(f"vLLM's per-KV-slot routing store: {c['store_bytes'] / 2**20:.1f} MiB (fixed: the KV cache's slots)")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    from arctic_rl_bench.measure import worker_main

    worker_main(worker, int, float, int, int, int, str)
