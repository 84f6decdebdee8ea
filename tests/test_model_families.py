"""The family sweep (tests/model_sweep.py): every decoder-only causal-LM family of the installed
transformers is exact through the engine's path or refused at load, never silently wrong."""

import os

import pytest

from model_sweep import render, sweep
from replay_sweep import render_replay, replay_sweep

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "models.md")


@pytest.fixture(scope="module")
def rows():
    return {(r.model_type, r.variant): r for r in sweep()}


def test_no_family_is_accepted_and_wrong(rows):
    bad = [r for r in rows.values() if r.outcome in ("wrong", "error")]
    assert not bad, "\n".join(f"{r.model_type} {r.variant}: {r.outcome} {r.detail}" for r in bad)


@pytest.mark.parametrize("family, variant", [
    ("llama", "default"), ("qwen3", "default"), ("qwen2", "window 3"), ("mistral", "window 3"), ("phi3", "window 3"),
    ("gemma2", "default"), ("gemma2", "attention softcap"), ("gemma2", "final softcap"), ("gemma3_text", "window 3"),
    ("gpt_oss", "default"), ("cohere", "logit scale"), ("granite", "logit scale"), ("deepseek_v3", "default"),
    ("olmo2", "default"), ("smollm3", "default"), ("minicpm3", "default"),
])
def test_families_with_windows_softcaps_sinks_and_scaled_heads_are_exact(rows, family, variant):
    row = rows[(family, variant)]
    assert row.outcome == "exact", row.detail


@pytest.mark.parametrize("family, variant, reason", [
    ("stablelm", "default", "was not given the ZoRRo layout"),  # its decoder layers drop **kwargs
    ("nemotron", "default", "was not given the ZoRRo layout"),
    ("llama4_text", "default", "chunked attention"),
    ("phimoe", "window 3", "differ from the model's own eager forward"),  # its window lives in transformers' mask only
    ("falcon_h1", "default", "packing sequences changes its log-probs"),  # Mamba mixers next to attention
    ("bert-generation", "default", "is not causal"),
    ("doge", "default", "builds its own attention mask"),
    ("modernbert-decoder", "default", "output head"),  # a prediction head (dense, activation, norm) before lm_head
])
def test_families_split_attention_cannot_serve_are_refused_by_name(rows, family, variant, reason):
    row = rows[(family, variant)]
    assert row.outcome == "refused" and reason in row.detail, row.detail


@pytest.fixture(scope="module")
def replay_rows():
    return {r.model_type: r for r in replay_sweep()}


def test_no_moe_family_is_replayed_wrong(replay_rows):
    bad = [r for r in replay_rows.values() if r.outcome in ("wrong", "error")]
    assert not bad, "\n".join(f"{r.model_type}: {r.outcome} {r.detail}" for r in bad)


@pytest.mark.parametrize("family, paths", [
    ("qwen3_moe", "packed, padded"), ("qwen2_moe", "packed, padded"), ("mixtral", "packed, padded"),
    ("olmoe", "packed, padded"), ("deepseek_v3", "packed, padded"), ("gpt_oss", "packed, padded"),
    ("glm4_moe", "packed, padded"), ("llama4_text", "padded"), ("jamba", "padded"),  # jamba: top-k in its block
])
def test_the_moe_families_of_the_field_are_replayed_exactly(replay_rows, family, paths):
    row = replay_rows[family]
    assert row.outcome == "replayed", row.detail
    assert ", ".join(n for n, ok in (("packed", row.packed), ("padded", row.padded)) if ok) == paths


@pytest.mark.parametrize("family, reason", [
    ("phimoe", "{0: 0, 1: 0}"),  # sparsemixer: no top-k
    ("jetmoe", "{0: 2, 1: 2}"),  # its attention routes too (mixture of attention heads)
    ("doge", "no decoder layer has an `experts` module"),
])
def test_moe_families_whose_routing_cannot_be_replayed_are_refused_by_name(replay_rows, family, reason):
    row = replay_rows[family]
    assert row.outcome == "refused" and reason in row.detail, row.detail


def test_docs_table_is_current(rows, replay_rows):
    with open(DOCS) as f:
        documented = [line for line in f.read().splitlines() if line.startswith("|")]
    current = [line for line in (render(list(rows.values())) + render_replay(list(replay_rows.values()))).splitlines()
               if line.startswith("|")]
    assert documented == current, "docs/models.md is stale: python -m tests.model_sweep > docs/models.md"


@pytest.mark.parametrize("family, refusal", [
    ("qwen3", None), ("gemma2", None), ("gpt_oss", None), ("mixtral", None),
    # Its Mamba mixers move a packed sequence by ~0.04 nats: inside bf16's tolerance for packed-vs-unpacked,
    # caught by the tokens-before-it check, which holds in any precision.
    ("falcon_h1", "with the tokens packed before it"),
])
def test_the_load_probe_in_bf16_accepts_exact_families_and_catches_mixing(family, refusal):
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from model_sweep import VOCAB, tiny_config
    from arctic_rl_core.engines.response_logits import ResponseLogits
    from arctic_rl_core.errors import InvalidRequest
    from arctic_rl_core.models.determinism import inference_behaviour
    from arctic_rl_core.models.exactness import check_exactness
    from arctic_rl_core.models.head import output_head
    from arctic_rl_core.zorro.attention import ZORRO_ATTENTION

    config = tiny_config(family, "default")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=ZORRO_ATTENTION,
                                             dtype=torch.bfloat16)
    inference_behaviour(model)
    wrapper = ResponseLogits(model, model, output_head(config))
    probe = lambda: check_exactness(wrapper, wrapper, model, zorro=True, pad_id=0, vocab_size=VOCAB,  # noqa: E731
                                    device=torch.device("cpu"), dtype=torch.bfloat16)
    if refusal is None:
        probe()
    else:
        with pytest.raises(InvalidRequest, match=refusal):
            probe()
