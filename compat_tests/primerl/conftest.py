"""Fixtures for the PrimeRL compatibility tests, which run in verifiers' own environment (see run.sh).

The Arctic RL server runs in the main environment, as a separate process, on a tiny Qwen3 model that
both sides load from the same folder (verifiers' renderer reads its tokenizer). pytest puts this folder
on sys.path, so verifiers imports the harness and taskset packages here by id, as it would installed ones.
"""

from __future__ import annotations

import math

import pytest

from compat_tests.main_server import serving_light, tiny_qwen3

SERVED_MODEL = "tiny-qwen3"
LEARNING_RATE = 1e-2
"""High enough for the tool-use SFT (`tool_model`) to converge in about 90 steps (5 s)."""
SFT_MAX_STEPS = 200
SFT_TARGET_LOSS = 1e-3


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """`arctic-rl serve` with a job on the tiny model: DeepSpeed and the transformers sampler, in the main environment."""
    engine = {"learning_rate": LEARNING_RATE}
    with serving_light(tiny_model, tmp_path_factory.mktemp("server"), engine, "--served-model-name", SERVED_MODEL) as url:
        yield url


@pytest.fixture(scope="session")
def client(server):
    from arctic_rl_core.client import ArcticRLClient

    return ArcticRLClient(server, retries=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from renderers.base import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture(scope="session")
def renderer(tokenizer):
    """PrimeRL's renderer for Qwen3 (thinking off) on the tiny model's tokenizer, as the TrainClient builds it."""
    from renderers import Qwen3RendererConfig, create_renderer

    return create_renderer(tokenizer, Qwen3RendererConfig(enable_thinking=False))


@pytest.fixture(scope="session")
def tool_model(client, renderer, tokenizer):
    """Teach the random tiny model to use the calculator, through the training API: supervised fine-tuning
    on each task's ideal exchange (an `add` call, then the answer), rendered and bridged by the renderer
    exactly as the TrainClient renders and bridges a rollout, then synced to the sampler. A random model
    never writes a well-formed tool call; this one does. Returns the weight version it samples with."""
    from arctic_calc_harness import ADD_TOOL
    from arctic_calc_taskset import QUESTIONS, SYSTEM_PROMPT
    from arctic_rl_core.types import Sequence

    seqs = []
    for question, answer in QUESTIONS.items():
        a, b = (int(w) for w in question.replace("?", " ").split() if w.isdigit())
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        prompt = renderer.render(messages, tools=[ADD_TOOL], add_generation_prompt=True).token_ids
        call = tokenizer.encode(f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call><|im_end|>',
                                add_special_tokens=False)
        bridged = renderer.bridge_to_next_turn(prompt, call, [{"role": "tool", "tool_call_id": "call_0", "content": answer}],
                                               tools=[ADD_TOOL]).token_ids
        reply = tokenizer.encode(f"The answer is {answer}.<|im_end|>", add_special_tokens=False)
        seqs += [Sequence(prompt_ids=prompt, response_ids=call), Sequence(prompt_ids=bridged, response_ids=reply)]
    losses = []
    for _ in range(SFT_MAX_STEPS):
        losses.append(client.fwd_bwd(seqs, "sft").loss)
        client.step()
        if losses[-1] < SFT_TARGET_LOSS:
            break
    assert math.isfinite(losses[-1]) and losses[-1] < SFT_TARGET_LOSS, f"SFT did not converge: {losses[::20]}"
    print(f"\nthe tiny model learnt the tool in {len(losses)} SFT steps (loss {losses[0]:.3f} -> {losses[-1]:.4f})")
    return client.sync_weights()
