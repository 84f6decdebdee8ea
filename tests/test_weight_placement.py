"""Placing checkpoint tensors into vLLM's fused and padded parameters (the direct sync path)."""

import pytest
import torch

from arctic_rl_core.samplers.weight_placement import PlacementError, Slice, checkpoint_shapes, destinations, place

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
CHECKPOINT = {
    "model.embed_tokens.weight": (100, 8),
    "model.layers.0.self_attn.q_proj.weight": (8, 8),
    "model.layers.0.self_attn.k_proj.weight": (4, 8),
    "model.layers.0.self_attn.v_proj.weight": (4, 8),
    "model.layers.0.mlp.gate_proj.weight": (16, 8),
    "model.layers.0.mlp.up_proj.weight": (16, 8),
    "model.norm.weight": (8,),
}
PARAMS = {
    "model.embed_tokens.weight": (128, 8),  # vocabulary padded to a multiple of 64
    "model.layers.0.self_attn.qkv_proj.weight": (16, 8),
    "model.layers.0.mlp.gate_up_proj.weight": (32, 8),
    "model.norm.weight": (8,),
}


def test_shards_land_in_order_and_padding_rows_are_left_alone():
    placement = place(CHECKPOINT, PARAMS, PACKED)
    assert placement["model.layers.0.self_attn.k_proj.weight"] == Slice("model.layers.0.self_attn.qkv_proj.weight", 8, 4)
    assert placement["model.layers.0.self_attn.v_proj.weight"] == Slice("model.layers.0.self_attn.qkv_proj.weight", 12, 4)
    assert placement["model.layers.0.mlp.up_proj.weight"] == Slice("model.layers.0.mlp.gate_up_proj.weight", 16, 16)
    assert placement["model.embed_tokens.weight"] == Slice("model.embed_tokens.weight", 0, 100)

    tensors = {name: torch.zeros(shape) for name, shape in PARAMS.items()}
    for name, view in destinations(placement, tensors).items():
        view.copy_(torch.full(CHECKPOINT[name], float(list(CHECKPOINT).index(name) + 1)))
    qkv = tensors["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv[:8].eq(2).all() and qkv[8:12].eq(3).all() and qkv[12:].eq(4).all()  # views share vLLM's storage
    assert tensors["model.embed_tokens.weight"][100:].eq(0).all()


@pytest.mark.parametrize("change, message", [
    (lambda c, p: c.pop("model.layers.0.self_attn.v_proj.weight"), "which the checkpoint lacks"),
    (lambda c, p: c.update({"model.layers.0.extra.weight": (8, 8)}), "no parameter model.layers.0.extra.weight"),
    (lambda c, p: p.update({"model.layers.0.self_attn.qkv_proj.weight": (20, 8)}), "is not covered"),
    (lambda c, p: p.update({"lm_head.weight": (128, 8)}), "lm_head.weight [128, 8] is not covered"),
    (lambda c, p: c.update({"model.norm.weight": (8, 2)}), "does not fit"),
    (lambda c, p: c.update({"model.embed_tokens.weight": (129, 8)}), "does not fit"),
])
def test_what_cannot_be_placed_is_refused_with_the_reason(change, message):
    checkpoint, params = dict(CHECKPOINT), dict(PARAMS)
    change(checkpoint, params)
    with pytest.raises(PlacementError, match=message.replace("[", r"\[").replace("]", r"\]")):
        place(checkpoint, params, PACKED)


def test_checkpoint_shapes_come_from_the_safetensors_headers(tiny_model):
    from transformers import AutoModelForCausalLM

    shapes = checkpoint_shapes(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert shapes == {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_a_directory_without_safetensors_is_refused(tmp_path):
    with pytest.raises(PlacementError, match="no safetensors"):
        checkpoint_shapes(str(tmp_path))
