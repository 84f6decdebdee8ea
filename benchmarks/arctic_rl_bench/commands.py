"""The benchmarks' plugin: `arctic-rl bench …` (entry point `arctic_rl: benchmarks`).

Each benchmark module is imported only when its command runs, so listing commands stays light.
"""

from __future__ import annotations

import importlib

from arctic_rl_core.plugins import Command, hookimpl

BENCHMARKS = {
    "zorro": "fwd_bwd and log_probs with ZoRRo off vs on",
    "attention": "split attention's backends side by side on one forest (one layer); --save records them for auto",
    "server": "HTTP round-trip latency, payload throughput and fwd_bwd request overhead over loopback",
    "serve": "requests/s and tokens/s through /v1/completions vs the direct generate call, on one sampler; "
             "--vs-vllm: against vllm serve with the same engine arguments",
    "generate": "the backend's generate against vLLM's own LLM.generate, same engine arguments, one side at a time",
    "update": "an adapter's actor update: log_probs + fwd_bwd (two forwards) vs fwd_bwd returning log-probs (one)",
    "sync": "sync_weights time and GB/s per path and model size, beside memcpy",
    "scale": "generate with 1 vs 2 sampler replicas, fwd_bwd with 1 vs 2 trainer ranks, the driver's per-call overhead",
    "e2e": "seconds per GRPO step of the tiny text2sql recipe: naive+sync vs ZoRRo+async",
    "tenants": "what time-sharing the engine costs a Tinker model: a switch (park + resume) beside a training step, "
               "LoRA and full parameter",
    "after_update": "generate after a ZoRRo-on update against after a ZoRRo-off one, alternating in one process",
    "frameworks": "verl, SkyRL and prime-rl alone against the same framework through Arctic RL, ZoRRo off and on, "
                  "on the seed's GRPO shape (not run in CI)",
    "replay": "MoE router replay (R3): flipped routes and the sampler-vs-trainer log-prob gap off and on (bf16 sampler, "
              "fp32 trainer, near-tied routers), a short GRPO run with and without, and the seconds it costs",
    "cascade": "decode attention tokens/s from a shared prompt with and without forest cascade attention, beside the KV-read bound",
}


def _command(name: str, help: str) -> Command:
    module = f"arctic_rl_bench.{name}"
    return Command(("bench", name), help,
                   lambda p: importlib.import_module(module).add_arguments(p),
                   lambda args: importlib.import_module(module).main(args))


@hookimpl
def arctic_rl_commands():
    return [_command(name, help) for name, help in BENCHMARKS.items()]
