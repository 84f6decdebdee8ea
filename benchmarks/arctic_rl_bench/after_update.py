"""`arctic-rl bench after_update`: is a generate slower after a ZoRRo-on update than after a ZoRRo-off one?

`bench frameworks` timed SkyRL's generation slower in its ZoRRo-on column, though ZoRRo changes nothing in the
sampler. This separates the update's effect from the run's: one process, one job with ZoRRo's attention loaded, the
bench's prompt-heavy GRPO step (generate, log-probs, fwd_bwd + step, sync), the update alternating ZoRRo on and off
from step to step (`zorro.enable` is read at every call); each generate is timed by the update before it.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

from arctic_rl_bench.frameworks.workload import MODEL, SHAPES, prompts


def add_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=14, help="steps; the first two are left out")
    p.add_argument("--json", action="store_true")


def run(steps: int) -> dict:
    from transformers import AutoTokenizer

    from arctic_rl_core.backend import InProcessBackend
    from arctic_rl_core.models.tiny import make_tiny_model
    from arctic_rl_core.types import SamplingParams, Sequence

    shape = SHAPES["prompt-heavy"]
    with tempfile.TemporaryDirectory() as model:
        make_tiny_model(MODEL["family"], model, layers=MODEL["layers"], hidden=MODEL["hidden"], heads=MODEL["heads"],
                        kv_heads=MODEL["kv_heads"], vocab_size=MODEL["vocab_size"],
                        max_positions=MODEL["max_positions"],
                        shape={"intermediate": MODEL["intermediate"]})
        tokenizer = AutoTokenizer.from_pretrained(model)
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
                    for content, _ in prompts(model, shape)[0]]
        backend = InProcessBackend({
            "model_path": model, "zorro": {"enable": True},
            "engine": {"zero_stage": 0, "learning_rate": 1e-5, "dtype": "float32"},
            "sampler": {"name": "vllm", "kv_cache_mb": 512, "max_model_len": MODEL["max_positions"]}})
        after: dict[str, list[float]] = {"zorro-on": [], "zorro-off": []}
        previous = None
        try:
            for step in range(steps):
                first = step * shape.prompts_per_step % (len(rendered) - shape.prompts_per_step)
                batch = rendered[first:first + shape.prompts_per_step]
                start = time.perf_counter()
                completions = backend.generate(batch, SamplingParams(
                    n=shape.samples_per_prompt, max_tokens=shape.response_tokens, temperature=1.0, ignore_eos=True,
                    seed=step))
                if previous is not None and step >= 2:
                    after[previous].append(time.perf_counter() - start)
                sequences = [Sequence(prompt_ids=batch[c.prompt_index], group_id=c.prompt_index,
                                      response_ids=c.token_ids, behaviour_logprobs=c.logprobs,
                                      advantages=[(-1.0) ** i] * len(c.token_ids)) for i, c in enumerate(completions)]
                backend.config.zorro.enable = step % 2 == 0
                backend.log_probs(sequences)
                backend.fwd_bwd(sequences, "grpo")
                backend.step()
                backend.sync_weights()
                previous = "zorro-on" if backend.config.zorro.enable else "zorro-off"
        finally:
            backend.close()
    medians = {k: statistics.median(v) for k, v in after.items()}
    return {"benchmark": "after_update", "shape": "prompt-heavy", "generate_seconds_after": after,
            "medians": medians, "on_over_off": medians["zorro-on"] / medians["zorro-off"]}


def main(args) -> int:
    result = run(args.steps)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"generate after a ZoRRo-on update {result['medians']['zorro-on']:.2f} s, after a ZoRRo-off one "
              f"{result['medians']['zorro-off']:.2f} s: {result['on_over_off']:.2f}x")
    return 0
