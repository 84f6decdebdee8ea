"""RoPE scaling as one job setting: every engine of the job computes the same positions past the trained window,
and what cannot be applied identically everywhere is refused at start, by field."""

import random

import pytest
import torch

from arctic_rl_core.backend import InProcessBackend
from arctic_rl_core.config import RopeScaling
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.models.rope_scaling import config_overrides, context_window, model_config
from arctic_rl_core.types import Sequence
from arctic_rl_core.zorro.attention import ZORRO_ATTENTION
from tests.test_vllm_sampler import run_scenario
from tests.test_zorro_parity import assert_parity

TRAINED_WINDOW = 256  # the tiny models' max_position_embeddings
YARN = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": TRAINED_WINDOW}
LINEAR = {"rope_type": "linear", "factor": 4}


def long_prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(length)]


def plain_rope_logprobs(model_path: str, sequences: list[Sequence]) -> list[list[float]]:
    """The checkpoint as saved (RoPE unscaled), scored by transformers alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    for s in sequences:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].log_softmax(-1)
        out.append(logits.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0].tolist())
    return out


def max_err(a, b):
    return max(abs(x - y) for r, q in zip(a, b) for x, y in zip(r, q))


@pytest.mark.parametrize("scaling", [YARN, LINEAR], ids=["yarn", "linear"])
def test_trainer_sampler_and_reference_agree_past_the_trained_window(tiny_model, scaling):
    """~900-token sequences on a model trained at 256 positions, scaled 4x: the transformers sampler's log-probs
    are the trainer's, the reference model's are the policy's before training, and all of them differ from the
    unscaled model's (the setting is in effect)."""
    api = InProcessBackend({"model_path": tiny_model, "engine": {"learning_rate": 1e-2}, "rope_scaling": scaling,
                            "reference": {"enable": True}, "sampler": {"name": "transformers"}})
    assert api.engine.max_context == api.sampler.max_context == 4 * TRAINED_WINDOW
    prompt = long_prompt(880)
    completions = api.generate([prompt], {"n": 2, "max_tokens": 20, "temperature": 1.0, "seed": 1})
    sequences = [Sequence(prompt_ids=prompt, response_ids=c.token_ids) for c in completions]
    trainer = api.log_probs(sequences).logprobs
    assert max_err([c.logprobs for c in completions], trainer) <= 1e-3
    assert max_err(api.log_probs(sequences, source="reference").logprobs, trainer) <= 1e-5
    assert max_err(plain_rope_logprobs(tiny_model, sequences), trainer) > 1e-2


def test_zorro_shares_a_long_prompt_exactly_under_yarn(tiny_model):
    """Positions change, attention does not: a group sharing a 700-token prompt past the trained window gets the
    same log-probs, loss and gradients from ZoRRo's packing as from each sequence alone (the model's own
    attention), both under the job's YaRN."""
    from transformers import AutoModelForCausalLM

    config = model_config(tiny_model, RopeScaling.model_validate(YARN))
    torch.manual_seed(0)
    zorro = AutoModelForCausalLM.from_pretrained(tiny_model, config=config, attn_implementation=ZORRO_ATTENTION,
                                                 dtype=torch.float32)
    with torch.no_grad():
        for p in zorro.parameters():
            if p.dim() > 1:
                p.mul_(4.0)  # sharper attention than the random init's, so position errors would show
    own = AutoModelForCausalLM.from_pretrained(tiny_model, config=config, attn_implementation="eager",
                                               dtype=torch.float32)
    own.load_state_dict(zorro.state_dict())
    rng = random.Random(4)
    prompt = long_prompt(700, seed=2)
    group = [Sequence(prompt_ids=prompt, response_ids=long_prompt(n, seed=n), group_id=0,
                      advantages=[rng.uniform(-1, 1)] * n, behaviour_logprobs=[-rng.uniform(4, 8) for _ in range(n)])
             for n in (40, 90, 150)]
    assert_parity((zorro, own), group)


def test_the_vllm_sampler_applies_the_jobs_yarn(tiny_model):
    """vLLM's engine (its own YaRN rotary embedding, built from the job's setting) against the trainer past the
    trained window, before and after a training step and a sync."""
    result = run_scenario("rope_scaling", tiny_model)
    assert result["max_context"] == [4 * TRAINED_WINDOW] * 2
    assert result["initial_err"] <= 1e-3 and result["synced_err"] <= 1e-3
    assert result["stale_err"] > 1e-2  # the step changed the trainer; the sync brought the sampler along


@pytest.mark.parametrize("scaling, field, message", [
    ({"rope_type": "dynamic", "factor": 2}, "config.rope_scaling.rope_type", "sampler's log-probs would not be"),
    ({"rope_type": "yarn", "factor": 1}, "config.rope_scaling.factor", "greater than 1"),
    ({"rope_type": "llama3", "factor": 8}, "config.rope_scaling", "low_freq_factor, high_freq_factor"),
    ({"rope_type": "linear", "factor": 2, "beta_fast": 16}, "config.rope_scaling", "beta_fast: not a setting of linear"),
])
def test_settings_no_engine_can_match_are_refused_by_field(tiny_model, scaling, field, message):
    with pytest.raises(InvalidRequest, match=message) as err:
        InProcessBackend({"model_path": tiny_model, "rope_scaling": scaling, "sampler": {"name": "transformers"}})
    assert err.value.field == field


def test_positions_set_for_vllm_alone_are_refused(tiny_model):
    """With the scaling in the sampler's engine arguments only, vLLM would run it and the trainer not."""
    with pytest.raises(InvalidRequest, match="hf_overrides.rope_parameters would change positions in vLLM alone") as err:
        InProcessBackend({"model_path": tiny_model, "sampler": {"engine_args": {"hf_overrides": {
            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}}}})
    assert err.value.field == "config.sampler.engine_args"


def test_models_it_cannot_scale_are_refused_by_name(tmp_path):
    from transformers import GPT2Config, LlamaConfig

    learned_positions = GPT2Config(n_layer=1, n_embd=32, n_head=2)
    with pytest.raises(InvalidRequest, match="gpt2 has no rotary position embedding") as err:
        config_overrides(learned_positions, RopeScaling.model_validate(YARN))
    assert err.value.field == "rope_scaling"
    scaled = LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    scaled.save_pretrained(tmp_path)
    assert context_window(model_config(str(tmp_path), None)) == 1024  # its own scaling, as every engine reads it
    with pytest.raises(InvalidRequest, match=r"already scales RoPE \(linear\)"):
        model_config(str(tmp_path), RopeScaling.model_validate(YARN))
