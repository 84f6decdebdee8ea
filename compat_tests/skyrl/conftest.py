"""Fixtures for the SkyRL compatibility tests, which run in SkyRL's own environment (see run.sh).

The Arctic RL server runs in the main environment, as a separate process, on a tiny Qwen3 model that
both sides load from the same folder (SkyRL reads its tokenizer and config).
"""

from __future__ import annotations

import math

import pytest

from compat_tests.main_server import serving_light, tiny_qwen3

LEARNING_RATE = 1e-2
"""The job's, for the supervised warm-up below; SkyRL's steps send their own (its schedule's)."""
# SkyRL's optimizer defaults, which the adapter checks the job against.
OPTIMIZER = {"weight_decay": 0.01, "betas": [0.9, 0.999], "grad_clip": 1.0}
QUESTIONS = {"What is 2 + 3?": ("5", "7"), "What is 4 + 4?": ("8", "6"), "What is 1 + 2?": ("3", "4"),
             "What is 3 + 3?": ("6", "9")}
"""Each question with its right answer and a wrong one: the warm-up teaches both, so GRPO groups get mixed rewards."""
SFT_MAX_STEPS = 400


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """`arctic-rl serve` with a job on the tiny model: DeepSpeed, the transformers sampler, a reference model (for
    SkyRL's default KL loss) and a critic (for GAE), in the main environment."""
    engine = {"learning_rate": LEARNING_RATE, **OPTIMIZER}
    with serving_light(tiny_model, tmp_path_factory.mktemp("server"), engine, reference=True, critic=True) as url:
        yield url


@pytest.fixture(scope="session")
def client(server):
    from arctic_rl_core.client import ArcticRLClient

    return ArcticRLClient(server, retries=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The prompt as SkyRL's generator renders it (the model's chat template, with the generation prompt)."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


@pytest.fixture(scope="session")
def gsm8k_model(client, tokenizer):
    """Teach the random tiny model, through the training API, to answer each question in GSM8K's `#### n` form,
    half the time rightly: SkyRL-Gym's gsm8k environment then rewards some samples of a group and not others,
    so GRPO has advantages to train on. Returns the weight version SkyRL starts from."""
    from arctic_rl_core.types import Sequence

    end = tokenizer.eos_token_id  # where the sampler stops (the tiny model's generation config)
    seqs = []
    for question, answers in QUESTIONS.items():
        for answer in answers:
            seqs.append(Sequence(prompt_ids=prompt_ids(tokenizer, question),
                                 response_ids=tokenizer.encode(f"#### {answer}", add_special_tokens=False) + [end]))
    # The tiny model first learns the answers' marginal (every question answered alike), then, after a number of
    # steps that varies with the machine's arithmetic, to read the question: train until each question's two
    # answers carry nearly all of its probability, half each, so a group's samples are right about half the time.
    for step in range(SFT_MAX_STEPS):
        if step % 10 == 0:
            probs = [math.exp(sum(lp)) for lp in client.log_probs(seqs).logprobs]
            pairs = [(probs[i], probs[i + 1]) for i in range(0, len(probs), 2)]  # (right, wrong) per question
            if all(right + wrong > 0.9 and 0.3 < right / (right + wrong) < 0.7 for right, wrong in pairs):
                return client.sync_weights()
        client.fwd_bwd(seqs, "sft")
        client.step()
    raise AssertionError(f"SFT did not learn to answer each question (right, wrong): {pairs}")
