"""The split-attention fast path against its plain PyTorch reference: outputs and gradients."""

import random

import pytest
import torch

from arctic_rl_kernels import split_attention as sa
from arctic_rl_kernels.layout import ForestLayout
from arctic_rl_kernels.split_attention import split_attention
from arctic_rl_kernels.split_attention_reference import split_attention_reference


def random_forest(rng: random.Random, trees: int, max_children: int, max_len: int, depth: int) -> ForestLayout:
    starts, ends, subtree_ends = [], [], []
    pos = 0

    def grow(level: int):
        nonlocal pos
        seg = len(starts)
        starts.append(pos)
        pos += rng.randint(1, max_len)
        ends.append(pos)
        subtree_ends.append(None)
        if level < depth:
            for _ in range(rng.randint(0, max_children)):
                grow(level + 1)
        subtree_ends[seg] = pos

    for _ in range(trees):
        grow(0)
    return ForestLayout(tuple(starts), tuple(ends), tuple(subtree_ends), pos)


def test_layout_mask_rule():
    # prefix [0,3) with suffixes [3,5) and [5,6); then an unrelated sequence [6,8)
    layout = ForestLayout((0, 3, 5, 6), (3, 5, 6, 8), (6, 5, 6, 8), 8)
    mask = layout.dense_mask()
    assert mask[4].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]  # suffix 1 sees prefix and itself
    assert mask[5].tolist() == [1, 1, 1, 0, 0, 1, 0, 0]  # suffix 2 sees the prefix, not suffix 1
    assert mask[7].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert layout.cross_parts() == [(0, 3, 3, 6)]
    with pytest.raises(ValueError, match="depth-first"):
        ForestLayout((0, 2), (2, 4), (3, 4), 4)


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("seed", range(6))
def test_fast_path_matches_reference_fp32(backend, seed):
    rng = random.Random(seed)
    layout = random_forest(rng, trees=rng.randint(1, 3), max_children=4, max_len=rng.choice([1, 5, 40]), depth=rng.randint(0, 3))
    H, D = 3, 16
    torch.manual_seed(seed)
    q, k, v = (torch.randn(H, layout.num_tokens, D, dtype=torch.float64).float().requires_grad_() for _ in range(3))
    dout = torch.randn(H, layout.num_tokens, D)
    scale = D**-0.5
    fast = split_attention(q, k, v, layout, scale, backend=backend)
    grads_fast = torch.autograd.grad(fast, (q, k, v), dout)
    ref = split_attention_reference(q, k, v, layout, scale)
    grads_ref = torch.autograd.grad(ref, (q, k, v), dout)
    assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max()
    for gf, gr in zip(grads_fast, grads_ref):
        assert (gf - gr).norm() <= 1e-5 * gr.norm() + 1e-6, backend


def test_bf16_fast_path_within_bf16_tolerance():
    layout = random_forest(random.Random(1), trees=2, max_children=3, max_len=30, depth=2)
    q, k, v = (torch.randn(2, layout.num_tokens, 32).bfloat16().requires_grad_() for _ in range(3))
    fast = split_attention(q, k, v, layout, 32**-0.5)
    ref = split_attention_reference(q.float(), k.float(), v.float(), layout, 32**-0.5)
    assert (fast.float() - ref).norm() <= 1e-2 * ref.norm()


def test_prefix_gradient_accumulates_over_suffixes():
    """dK of a shared prefix equals the sum over its suffixes computed one at a time."""
    torch.manual_seed(0)
    P, R, G, H, D = 6, 3, 4, 2, 8
    layout = ForestLayout((0,) + tuple(P + i * R for i in range(G)), (P,) + tuple(P + (i + 1) * R for i in range(G)),
                          (P + G * R,) + tuple(P + (i + 1) * R for i in range(G)), P + G * R)
    q, k, v = (torch.randn(H, P + G * R, D, requires_grad=True) for _ in range(3))
    shared = split_attention(q, k, v, layout, D**-0.5)
    shared[:, P:].sum().backward()
    dk_prefix = k.grad[:, :P].clone()
    total = torch.zeros_like(dk_prefix)
    for i in range(G):
        kp = k.detach()[:, :P].clone().requires_grad_()
        sl = slice(P + i * R, P + (i + 1) * R)
        kk = torch.cat([kp, k.detach()[:, sl]], dim=1)
        vv = torch.cat([v.detach()[:, :P], v.detach()[:, sl]], dim=1)
        one = split_attention(q.detach()[:, list(range(P)) + list(range(sl.start, sl.stop))].contiguous(), kk, vv,
                              ForestLayout((0, P), (P, P + R), (P + R, P + R), P + R), D**-0.5)
        one[:, P:].sum().backward()
        total += kp.grad
    assert torch.allclose(dk_prefix, total, rtol=1e-5, atol=1e-6)


def test_a_prefix_is_read_once_for_all_its_suffixes_without_copies():
    """The cross part hands the primitives views of the packed K/V (no copy per suffix), in one call for
    the prefix's whole subtree, forward and backward."""

    P, R, G, H, D = 6, 3, 4, 2, 8
    layout = ForestLayout((0,) + tuple(P + i * R for i in range(G)), (P,) + tuple(P + (i + 1) * R for i in range(G)),
                          (P + G * R,) + tuple(P + (i + 1) * R for i in range(G)), P + G * R)
    q, k, v = (torch.randn(H, P + G * R, D, requires_grad=True) for _ in range(3))
    seen = []

    def recording(fn, kind):
        def call(*args):
            q_, k_, v_ = args[1:4] if kind == "backward" else args[:3]
            causal = args[6] if kind == "backward" else args[3]
            if not causal:
                seen.append((kind, k_.shape[-2], q_.shape[-2], k_.untyped_storage().data_ptr(), v_.untyped_storage().data_ptr()))
            return fn(*args)
        return call

    ops = sa.AttentionOps("recording", recording(sa.MATH.forward, "forward"), recording(sa.MATH.backward, "backward"), True)
    out = sa._SplitAttention.apply(q, k, v, None, layout, D**-0.5, ops, sa.NO_MODS)
    out.sum().backward()
    storages = (k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())
    assert [s[:3] for s in seen] == [("forward", P, G * R), ("backward", P, G * R)]  # one call for all G suffixes
    assert all(s[3:] == storages for s in seen)  # the prefix's K/V are views of the packed tensors


# ATen's flash kernels take no score rule: with one, split attention runs the math primitives.
@pytest.mark.parametrize(("backend", "feature"), [("cpu_flash", "none"), ("math", "none"), ("math", "window"), ("math", "all")])
def test_segments_on_both_sides_of_the_own_call_length_match_reference(backend, feature):
    """Long segments attend in calls of their own, short ones in gathered buckets: in one forest, both at once,
    with score rules (the math primitives) and without, the result is the reference's."""
    min_tokens = sa._OWN_CALL_MIN_TOKENS
    lengths = [min_tokens - 1, min_tokens, 3, min_tokens + 37, 1]
    layout = ForestLayout.groups([lengths[3], 5, min_tokens], [[lengths[0], lengths[2]], [lengths[1], 1], [2, 90, 7]])
    own, buckets = sa._self_parts(layout, torch.device("cpu"))
    assert own and buckets
    assert all(e - s >= min_tokens for s, e in own)
    assert sum(e - s for s, e in own) + sum(b.valid.sum().item() for b in buckets) == layout.num_tokens
    kwargs = {"none": {}, "window": dict(window=40), "all": dict(window=50, softcap=3.0)}[feature]
    H, D = 3, 8
    torch.manual_seed(7)
    q, k, v = (torch.randn(H, layout.num_tokens, D, requires_grad=True) for _ in range(3))
    dout = torch.randn(H, layout.num_tokens, D)
    fast = split_attention(q, k, v, layout, D**-0.5, backend=backend, **kwargs)
    ref = split_attention_reference(q, k, v, layout, D**-0.5, **kwargs)
    assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max()
    for gf, gr in zip(torch.autograd.grad(fast, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert (gf - gr).norm() <= 1e-5 * gr.norm()


def test_a_long_segment_attends_to_itself_on_views_of_the_packed_tensors():
    """A segment of at least `_OWN_CALL_MIN_TOKENS` is handed to the primitives as a view (no gather), forward and
    backward; a short one is gathered into a batch of its own."""
    long, short = sa._OWN_CALL_MIN_TOKENS + 5, 4
    layout = ForestLayout.unshared([long, short])
    q, k, v = (torch.randn(2, long + short, 8, requires_grad=True) for _ in range(3))
    seen = []

    def recording(fn, kind):
        def call(*args):
            q_ = args[1] if kind == "backward" else args[0]
            seen.append((kind, q_.shape[0], q_.shape[-2], q_.untyped_storage().data_ptr()))
            return fn(*args)
        return call

    ops = sa.AttentionOps("recording", recording(sa.MATH.forward, "forward"), recording(sa.MATH.backward, "backward"), True)
    sa._SplitAttention.apply(q, k, v, None, layout, 8**-0.5, ops, sa.NO_MODS).sum().backward()
    packed = q.untyped_storage().data_ptr()
    assert [s[:3] for s in seen] == [("forward", 1, long), ("forward", 1, short), ("backward", 1, long), ("backward", 1, short)]
    assert seen[0][3] == seen[2][3] == packed
    assert seen[1][3] != packed and seen[3][3] != packed


def test_off_the_cpu_every_segment_is_batched():
    """On a GPU a call of one segment would leave most of it idle: there long segments are batched too."""
    layout = ForestLayout.groups([sa._OWN_CALL_MIN_TOKENS * 3], [[sa._OWN_CALL_MIN_TOKENS, 5, sa._OWN_CALL_MIN_TOKENS + 9]])
    own, buckets = sa._self_parts(layout, torch.device("meta"))
    assert own == []
    assert sum(b.n for b in buckets) == len(layout.starts)
    assert len(sa._self_parts(layout, torch.device("cpu"))[0]) == 3


FEATURES = {
    "window": dict(window=5),
    "window_of_one": dict(window=1),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "all": dict(window=7, softcap=3.0, sinks=True),
}


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("seed", range(4))
def test_score_mods_and_sinks_match_reference_fp32(backend, feature, seed):
    """Windows (inside a segment and across the prefix boundary), softcaps and sinks: outputs and every
    gradient, the sinks' included, against the dense reference."""
    rng = random.Random(100 + seed)
    layout = random_forest(rng, trees=rng.randint(1, 3), max_children=3, max_len=rng.choice([2, 6, 20]), depth=rng.randint(1, 3))
    H, D = 3, 8
    torch.manual_seed(seed)
    q, k, v = (torch.randn(H, layout.num_tokens, D) * 2 for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kwargs = dict(FEATURES[feature])
    inputs = [q, k, v]
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = torch.randn(H, requires_grad=True)
        inputs.append(kwargs["sinks"])
    dout = torch.randn(H, layout.num_tokens, D)
    fast = split_attention(q, k, v, layout, D**-0.5, backend=backend, **kwargs)
    ref = split_attention_reference(q, k, v, layout, D**-0.5, **kwargs)
    assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max()
    grads_fast, grads_ref = torch.autograd.grad(fast, inputs, dout), torch.autograd.grad(ref, inputs, dout)
    # A window of one makes dq exactly zero in the reference: it is judged at the whole gradient's scale (1e-6 of it,
    # fp32 rounding there), not at a fixed floor that a CPU's rounding can cross (1.0007e-5 under =default).
    floor = 1e-6 * torch.cat([g.flatten() for g in grads_ref]).norm()
    for gf, gr in zip(grads_fast, grads_ref):
        assert (gf - gr).norm() <= 1e-5 * gr.norm() + floor, feature


def test_window_spans_the_prefix_boundary_by_position():
    """A suffix token sees exactly the prefix tokens within the window of its position in the sequence."""
    layout = ForestLayout((0, 4, 7), (4, 7, 9), (9, 7, 9), 9)  # prefix of 4, suffixes of 3 and 2
    assert layout.positions().tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5]
    mask = layout.dense_mask(window=3)
    assert mask[7].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 0]  # position 4 sees positions 2..4 of its own sequence
    assert mask[6].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0]  # position 6: the prefix is out of reach


def test_window_longer_than_every_sequence_is_plain_causal():
    layout = random_forest(random.Random(3), trees=2, max_children=3, max_len=6, depth=2)
    q, k, v = (torch.randn(2, layout.num_tokens, 8) for _ in range(3))
    long = int(layout.positions().max()) + 1
    assert torch.equal(split_attention(q, k, v, layout, 0.3, backend="cpu_flash", window=long),
                       split_attention(q, k, v, layout, 0.3, backend="cpu_flash"))
    assert not torch.equal(split_attention(q, k, v, layout, 0.3, window=long - 1), split_attention(q, k, v, layout, 0.3))


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
def test_value_head_size_may_differ(backend):
    """Multi-latent attention (DeepSeek V2/V3) has values narrower than queries and keys."""
    layout = random_forest(random.Random(4), trees=2, max_children=3, max_len=8, depth=2)
    q, k = (torch.randn(2, layout.num_tokens, 12, requires_grad=True) for _ in range(2))
    v = torch.randn(2, layout.num_tokens, 8, requires_grad=True)
    fast = split_attention(q, k, v, layout, 0.3, backend=backend)
    ref = split_attention_reference(q, k, v, layout, 0.3)
    assert fast.shape == (2, layout.num_tokens, 8)
    assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max()
    dout = torch.randn_like(ref)
    for gf, gr in zip(torch.autograd.grad(fast, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert (gf - gr).norm() <= 1e-5 * gr.norm()


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
def test_grouped_query_attention_reads_each_kv_head_for_its_query_heads(backend):
    """K/V with fewer heads than Q (GQA): query head h reads K/V head h // groups, and dK, dV sum over the group."""
    layout = random_forest(random.Random(5), trees=2, max_children=3, max_len=8, depth=2)
    torch.manual_seed(5)
    q = torch.randn(6, layout.num_tokens, 16, requires_grad=True)
    k, v = (torch.randn(2, layout.num_tokens, 16, requires_grad=True) for _ in range(2))
    fast = split_attention(q, k, v, layout, 0.25, backend=backend)
    ref = split_attention_reference(q, k.repeat_interleave(3, 0), v.repeat_interleave(3, 0), layout, 0.25)
    assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max()
    dout = torch.randn_like(ref)
    for gf, gr in zip(torch.autograd.grad(fast, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert gf.shape == gr.shape and (gf - gr).norm() <= 1e-5 * gr.norm()
    with pytest.raises(ValueError, match="must be equal and divide the query heads"):
        split_attention(q, k[:1].expand(4, -1, -1), v[:1].expand(4, -1, -1), layout, 0.25, backend=backend)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_flash runs ATen's CUDA kernels: no CUDA device here")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_flash_matches_reference(dtype):
    """ATen's CUDA kernels as the parts' primitives (FlashAttention-2 in 16 bits, memory-efficient in fp32), GQA."""
    layout = random_forest(random.Random(3), trees=2, max_children=3, max_len=40, depth=2)
    torch.manual_seed(3)
    q = torch.randn(4, layout.num_tokens, 64, device="cuda").to(dtype).requires_grad_()
    k, v = (torch.randn(2, layout.num_tokens, 64, device="cuda").to(dtype).requires_grad_() for _ in range(2))
    fast = split_attention(q, k, v, layout, 0.125, backend="cuda_flash")
    q32, k32, v32 = (t.detach().double().float().requires_grad_() for t in (q, k, v))
    ref = split_attention_reference(q32, k32.repeat_interleave(2, 0), v32.repeat_interleave(2, 0), layout, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (fast.float() - ref).norm() <= tolerance * ref.norm()
    dout = torch.randn_like(ref)
    for gf, gr in zip(torch.autograd.grad(fast, (q, k, v), dout.to(dtype)), torch.autograd.grad(ref, (q32, k32, v32), dout)):
        assert (gf.float() - gr).norm() <= tolerance * gr.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_flash_calls_follow_atens_contracts(dtype, causal):
    """Without a GPU, the CUDA primitives' calls run on meta tensors, through the shape rules PyTorch registers
    for those kernels: arguments accepted, LSE one per query row (fp32's padded LSE trimmed), one gradient per
    input. (Their numbers are checked on CUDA above.)"""
    B, H, Lq, D = 3, 4, 100, 64
    Lk = Lq if causal else 130  # the cross parts: a prefix's keys for its subtree's queries
    q = torch.empty(B, H, Lq, D, device="meta", dtype=dtype)
    k, v = (torch.empty(B, H, Lk, D, device="meta", dtype=dtype) for _ in range(2))
    out, lse = sa.CUDA_FLASH.forward(q, k, v, causal, 0.125, sa.NO_MODS, None, None)
    assert out.shape == q.shape and lse.shape == (B, H, Lq) and lse.dtype == torch.float32
    grads = sa.CUDA_FLASH.backward(torch.empty_like(out), q, k, v, out, lse, causal, 0.125, sa.NO_MODS, None, None)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_bf16_gradients_within_bf16_tolerance_on_both_sides_of_the_fp32_backward_length():
    """Short responses (few keys) take the CPU backward in fp32, long prompts ATen's bf16 one: both within bf16's
    tolerance of the fp32 reference."""
    short, long_ = sa._CPU_FP32_BACKWARD_MAX_KEYS // 4, sa._CPU_FP32_BACKWARD_MAX_KEYS * 2
    layout = ForestLayout((0, long_, long_ + short), (long_, long_ + short, long_ + 2 * short), (long_ + 2 * short,
                          long_ + short, long_ + 2 * short), long_ + 2 * short)
    q, k, v = (torch.randn(2, layout.num_tokens, 32).bfloat16().requires_grad_() for _ in range(3))
    dout = torch.randn(2, layout.num_tokens, 32).bfloat16()
    grads = torch.autograd.grad(split_attention(q, k, v, layout, 32**-0.5, backend="cpu_flash"), (q, k, v), dout)
    ref_inputs = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = split_attention_reference(*ref_inputs, layout, 32**-0.5)
    for g, r in zip(grads, torch.autograd.grad(ref, ref_inputs, dout.float())):
        assert g.dtype == torch.bfloat16
        assert (g.float() - r).norm() <= 1e-2 * r.norm()


@pytest.mark.parametrize("keys", [sa._CPU_FP32_BACKWARD_MAX_KEYS, sa._CPU_FP32_BACKWARD_MAX_KEYS + 1])
def test_cpu_flash_backward_runs_in_fp32_only_where_the_keys_are_few(keys):
    q, k, v = (torch.randn(1, 2, keys, 16).bfloat16() for _ in range(3))
    out, lse = sa.CPU_FLASH.forward(q, k, v, True, 0.25, sa.NO_MODS, None, None)
    dout = torch.randn_like(out)
    grads = sa.CPU_FLASH.backward(dout, q, k, v, out, lse, True, 0.25, sa.NO_MODS, None, None)
    few = keys <= sa._CPU_FP32_BACKWARD_MAX_KEYS
    wanted = [x.float() if few else x for x in (dout, q, k, v, out)]
    expected = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*wanted, lse, 0.0, True, scale=0.25)
    for g, e in zip(grads, expected):
        assert g.dtype == (torch.float32 if few else torch.bfloat16)
        torch.testing.assert_close(g, e)
