"""The cascade decode kernel against its plain PyTorch reference, its work plan's reads, and its benchmark's
code path. Without CUDA the kernel runs under the Triton interpreter (small shapes)."""

import argparse
import itertools
import json
import math
import random
from collections import Counter
from dataclasses import fields

import pytest
import torch

from arctic_rl_kernels.cascade_decode import (
    CHUNKS,
    INTERPRETED,
    DecodeForest,
    DecodePlan,
    LaunchConfig,
    cascade_decode,
    fill_chunk,
    kv_read_bytes,
    launch_config,
    merge_partials,
)
from arctic_rl_kernels.cascade_decode_reference import cascade_decode_reference, merge_reference

# Without CUDA the kernel runs under Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_forest(rng: random.Random, trees: int, max_children: int, max_len: int, depth: int) -> DecodeForest:
    """Trees packed depth-first; a sequence per leaf, and sometimes one that ends at an inner segment
    (a sample with no tokens of its own yet); sequences in shuffled order."""
    segments, chains = [], []

    def grow(path: tuple, level: int):
        start = segments[-1][1] if segments else 0
        segments.append((start, start + rng.randint(1, max_len)))
        path += (len(segments) - 1,)
        children = rng.randint(2 if level == 0 else 1, max_children) if level < depth else 0
        if children == 0 or rng.random() < 0.2:
            chains.append(path)
        for _ in range(children):
            grow(path, level + 1)

    for _ in range(trees):
        grow((), 0)
    rng.shuffle(chains)
    return DecodeForest(tuple(segments), tuple(chains))


def inputs(forest: DecodeForest, H: int, Hkv: int, D: int, DV: int, dtype=torch.float32, seed: int = 0):
    """q, and caches with a few tokens that no sequence reads."""
    gen = torch.Generator().manual_seed(seed)
    T = forest.num_tokens + 3
    q, k, v = (torch.randn(shape, generator=gen) for shape in ((forest.num_sequences, H, D), (Hkv, T, D), (Hkv, T, DV)))
    return (t.to(DEVICE, dtype) for t in (q, k, v))


def assert_fp32_parity(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def reference_lse(q, k, forest: DecodeForest, scale: float) -> torch.Tensor:
    """[B, H]: each sequence's log-sum-exp of its scores, in fp32."""
    group = q.shape[1] // k.shape[0]
    rows = []
    for b, chain in enumerate(forest.chains):
        idx = torch.cat([torch.arange(*forest.segments[i]) for i in chain]).to(q.device)
        scores = (k[:, idx].float().repeat_interleave(group, 0) @ q[b].float()[:, :, None])[..., 0] * scale
        rows.append(torch.logsumexp(scores, dim=-1))
    return torch.stack(rows)


# (H, Hkv, D, DV): GQA, H == Hkv, one KV head, a value head size other than the query's.
SHAPES = [(4, 2, 16, 16), (2, 2, 32, 16), (4, 1, 16, 32), (3, 3, 16, 16)]


@pytest.mark.parametrize("seed", range(6))
def test_random_forests_match_reference_fp32(seed):
    """Trees of depth 1 to 3; chunks shorter than segments (split-K), reader blocks smaller than a segment's
    readers, chunks shorter and longer than the key tile; launches that merge 1 to 16 slots a step."""
    rng = random.Random(seed)
    depth = 1 + seed % 3
    forest = random_forest(rng, trees=1 + seed % 2, max_children=3, max_len=[40, 16, 8][depth - 1], depth=depth)
    chunk, block_r = rng.choice([4, 8, 16]), rng.choice([1, 2, 3])
    launch = LaunchConfig(block_n=rng.choice([16, 32]), num_warps=4, num_stages=1, merge_slots=rng.choice([1, 2, 16]))
    H, Hkv, D, DV = SHAPES[seed % len(SHAPES)]
    q, k, v = inputs(forest, H, Hkv, D, DV, seed=seed)
    out, lse = cascade_decode(q, k, v, forest, D**-0.5, chunk=chunk, block_r=block_r, launch=launch, return_lse=True)
    assert_fp32_parity(out, cascade_decode_reference(q, k, v, forest, D**-0.5))
    assert lse.dtype == torch.float32
    assert (lse - reference_lse(q, k, forest, D**-0.5)).abs().max() <= 1e-5 * lse.abs().max()


def test_every_element_the_kernels_write_is_checked(monkeypatch):
    """Every buffer cascade_decode allocates starts as NaN: a partial slot the first kernel leaves unwritten, or an
    output element the merge leaves unwritten, fails parity (a reused allocation could hold a right answer)."""
    forest = random_forest(random.Random(4), trees=2, max_children=3, max_len=20, depth=2)
    q, k, v = inputs(forest, 4, 2, 16, 24, seed=4)
    ref, ref_lse = cascade_decode_reference(q, k, v, forest, 0.25), reference_lse(q, k, forest, 0.25)
    empty, poisoned = torch.empty, []

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        poisoned.append(t.shape)
        return t.fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    out, lse = cascade_decode(q, k, v, forest, 0.25, chunk=8, block_r=2, return_lse=True)
    monkeypatch.undo()
    assert len(poisoned) == 4  # the partials and their LSEs, the output and its LSE
    assert_fp32_parity(out, ref)
    assert (lse - ref_lse).abs().max() <= 1e-5 * ref_lse.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("merge_slots", [1, 4, 16])
def test_merge_kernel_matches_reference(dtype, merge_slots):
    """Sequences of 1 to 13 slots in shuffled order (one step of slots, several, a partial last one); LSEs near
    +-200 per sequence (exp of one alone overflows fp32) that differ by a few within most, so every slot counts; a
    value head size the kernel pads. Outputs start as NaN: an element the kernel does not write fails."""
    gen = torch.Generator().manual_seed(5)
    counts, offsets, H, DV = [1, 3, 4, 5, 13], [200.0, -200.0, 0.0, 150.0, -150.0], 3, 24
    seq_slots = torch.randperm(sum(counts), generator=gen).int()
    seq_slot_start = torch.tensor([0, *itertools.accumulate(counts)]).int()
    part_out = torch.randn(sum(counts), H, DV, generator=gen)
    part_lse = 3 * torch.randn(sum(counts), H, generator=gen)
    part_lse[seq_slots.long()] += torch.tensor(offsets).repeat_interleave(torch.tensor(counts))[:, None]
    # The last sequence's first slot dwarfs the rest: a max not kept across steps of slots overflows there.
    part_lse[seq_slots[-counts[-1]]] += 100
    ref_out, ref_lse = merge_reference(part_out, part_lse, seq_slot_start, seq_slots)
    out = torch.full((len(counts), H, DV), float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full((len(counts), H), float("nan"), device=DEVICE)
    merge_partials(*(t.to(DEVICE) for t in (part_out, part_lse, seq_slot_start, seq_slots)), out, lse, merge_slots)
    out, lse = out.cpu(), lse.cpu()
    assert (out.float() - ref_out).abs().max() <= (1e-5 if dtype == torch.float32 else 1e-2) * ref_out.abs().max()
    assert (lse - ref_lse).abs().max() <= 1e-5 * ref_lse.abs().max()


def test_merge_reference_is_the_softmax_over_all_keys():
    """The merge reference against a softmax over the concatenated keys of a sequence's split parts."""
    gen = torch.Generator().manual_seed(6)
    scores, values = torch.randn(2, 30, generator=gen), torch.randn(2, 30, 5, generator=gen)  # [H, keys], [H, keys, DV]
    parts = [(0, 7), (7, 8), (8, 30)]
    part_lse = torch.stack([torch.logsumexp(scores[:, a:b], -1) for a, b in parts])
    part_out = torch.stack([(torch.softmax(scores[:, a:b], -1)[..., None] * values[:, a:b]).sum(1) for a, b in parts])
    out, lse = merge_reference(part_out, part_lse, torch.tensor([0, 3]), torch.tensor([2, 0, 1]))
    assert torch.allclose(out[0], (torch.softmax(scores, -1)[..., None] * values).sum(1), atol=1e-6)
    assert torch.allclose(lse[0], torch.logsumexp(scores, -1), atol=1e-6)


def test_plan_lists_each_sequences_slots():
    """The merge's CSR: sequence b's slots are exactly the slots its reader entries write, each slot listed once."""
    forest = random_forest(random.Random(3), trees=2, max_children=3, max_len=20, depth=2)
    plan = forest.plan(chunk=4, block_r=2)
    start, listed = plan.seq_slot_start.tolist(), plan.seq_slots.tolist()
    writer = {s: b for block, slots in zip(plan.readers.tolist(), plan.slots.tolist())
              for b, s in zip(block, slots) if b >= 0}
    assert sorted(writer) == sorted(listed) == list(range(plan.num_slots))
    assert start[0] == 0 and start[-1] == plan.num_slots and len(start) == forest.num_sequences + 1
    for b in range(forest.num_sequences):
        assert sorted(listed[start[b] : start[b + 1]]) == sorted(s for s, reader in writer.items() if reader == b)


def test_plan_goes_to_the_device_as_one_aligned_buffer():
    """One copy per plan and device; each tensor 16-byte aligned (Triton compiles per pointer alignment)."""
    tables, lengths = paged_case(random.Random(2), block_size=4)
    host = DecodeForest.from_block_tables(tables, lengths, 4).plan(chunk=4, block_r=2)
    moved = host.to(torch.device(DEVICE))
    names = [f.name for f in fields(host) if isinstance(getattr(host, f.name), torch.Tensor)]
    assert "key_rows" in names and "seq_slots" in names
    for name in names:
        t = getattr(moved, name)
        assert torch.equal(t.cpu(), getattr(host, name)) and t.dtype == torch.int32 and t.data_ptr() % 16 == 0
    assert len({getattr(moved, name).untyped_storage().data_ptr() for name in names}) == 1


def test_a_forest_is_planned_and_uploaded_once_for_all_its_calls(monkeypatch):
    """vLLM's backend finds a step's forest once and calls cascade_decode with it in every layer: only the first
    call builds and uploads the plan."""
    built, uploaded = [], []
    build, upload = DecodeForest._build_plan, DecodePlan.to
    monkeypatch.setattr(DecodeForest, "_build_plan", lambda self, *a: built.append(a) or build(self, *a))
    monkeypatch.setattr(DecodePlan, "to", lambda self, device: uploaded.append(device) or upload(self, device))
    forest = DecodeForest.groups([20], [[3, 5]])
    q, k, v = inputs(forest, 4, 2, 16, 16)
    first = cascade_decode(q, k, v, forest, 0.25, chunk=8)
    assert torch.equal(cascade_decode(q, k, v, forest, 0.25, chunk=8), first)
    assert len(built) == 1 and len(uploaded) == (DEVICE != "cpu")  # on CPU the host plan is the device's


def test_default_launch():
    """Hopper's 16-bit head size 128: 64-key tiles, 4 warps, 3 stages; fp32 halves the tile; head size 256 takes
    2 stages; the interpreter small tiles."""
    assert launch_config(torch.bfloat16, 128, interpreted=False) == LaunchConfig(64, 4, 3, merge_slots=32)
    assert launch_config(torch.float32, 128, interpreted=False).block_n == 32
    assert launch_config(torch.bfloat16, 256, interpreted=False).num_stages == 2
    assert launch_config(torch.bfloat16, 128, interpreted=True).block_n == 16


def test_groups_with_nested_prefixes_and_multi_turn_chains():
    """A system prompt shared by two groups; group A's samples carry a shared turn history (depth-3 chains
    below the system prompt); group B reads its prompt only; one sample has no tokens of its own."""
    segments = [(0, 30),                   # 0: system prompt
                (30, 70), (70, 90),        # 1: group A's prompt, 2: group A's shared turn history
                (90, 95), (95, 99), (99, 100),  # 3-5: A's samples' own tokens
                (100, 140),                # 6: group B's prompt
                (140, 146), (146, 150)]    # 7, 8: B's samples
    chains = [(0, 1, 2, 3), (0, 1, 2, 4), (0, 1, 2, 5), (0, 6, 7), (0, 6, 8), (0, 1, 2)]
    forest = DecodeForest(segments, chains)
    q, k, v = inputs(forest, 4, 2, 16, 32, seed=1)
    ref = cascade_decode_reference(q, k, v, forest, 0.3)
    assert_fp32_parity(cascade_decode(q, k, v, forest, 0.3, chunk=16, block_r=4), ref)


def test_single_token_segments():
    forest = DecodeForest([(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 1), (0, 2), (0, 1, 3)])
    q, k, v = inputs(forest, 2, 1, 16, 16, seed=2)
    assert_fp32_parity(cascade_decode(q, k, v, forest, 0.25, chunk=1, block_r=2),
                       cascade_decode_reference(q, k, v, forest, 0.25))


def test_bf16_within_bf16_tolerance():
    forest = DecodeForest.groups([50, 17], [[9, 4, 1], [6, 0]])
    q, k, v = inputs(forest, 4, 2, 32, 16, dtype=torch.bfloat16, seed=3)
    out = cascade_decode(q, k, v, forest, 32**-0.5, chunk=24, block_r=2)
    ref = cascade_decode_reference(q.float(), k.float(), v.float(), forest, 32**-0.5)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).norm() <= 1e-2 * ref.norm()


def test_unshared_gives_the_same_output():
    forest = random_forest(random.Random(7), trees=2, max_children=3, max_len=30, depth=2)
    q, k, v = inputs(forest, 4, 2, 16, 16, seed=7)
    shared = cascade_decode(q, k, v, forest, 0.25, chunk=16, block_r=3)
    unshared = cascade_decode(q, k, v, forest.unshared(), 0.25, chunk=16, block_r=3)
    assert_fp32_parity(unshared, shared)


def readers_per_key(forest: DecodeForest) -> Counter:
    return Counter(t for chain in forest.chains for i in chain for t in range(*forest.segments[i]))


@pytest.mark.parametrize("block_r", [2, 100])
def test_cascade_plan_reads_each_shared_segment_once(block_r):
    """Structural, from the plan: every (sequence, key) it needs is covered by exactly one item it reads in;
    an item's keys are loaded once per KV head, so cascade loads a key once per block of its readers (once
    when they fit one block) and unshared once per reader."""
    forest = random_forest(random.Random(11), trees=2, max_children=3, max_len=25, depth=3)
    readers = readers_per_key(forest)
    assert max(readers.values()) > 2  # shared keys with more readers than a block of 2
    for f, expected in [(forest, {t: math.ceil(n / block_r) for t, n in readers.items()}), (forest.unshared(), readers)]:
        plan = f.plan(chunk=8, block_r=block_r)
        loads, needs = Counter(), Counter()
        for k0, k1, block in zip(plan.k0.tolist(), plan.k1.tolist(), plan.readers.tolist()):
            assert 0 < k1 - k0 <= 8
            loads.update(range(k0, k1))
            needs.update((b, t) for b in block if b >= 0 for t in range(k0, k1))
        assert loads == Counter(expected)
        assert needs == Counter((b, t) for b, chain in enumerate(f.chains) for i in chain for t in range(*f.segments[i]))
        assert plan.keys_read == sum(expected.values())
    q, k, v = inputs(forest, 4, 2, 16, 32)
    per_key = 2 * (16 + 32) * 4  # two KV heads, K and V of fp32
    assert kv_read_bytes(forest, q, k, v, block_r=100) == len(readers) * per_key
    assert kv_read_bytes(forest.unshared(), q, k, v, block_r=100) == sum(readers.values()) * per_key


def test_groups_layout():
    forest = DecodeForest.groups([5, 3], [[2, 0], [1]])
    assert forest.segments == ((0, 5), (5, 7), (7, 10), (10, 11))
    assert forest.chains == ((0, 1), (0,), (2, 3))
    assert forest.unshared().segments == ((0, 5), (5, 7), (0, 5), (7, 10), (10, 11))
    assert forest.unshared().chains == ((0, 1), (2,), (3, 4))


@pytest.mark.parametrize("segments, chains, match", [
    ([(3, 3)], [(0,)], r"segments\[0\]"),
    ([(-1, 2)], [(0,)], r"segments\[0\]"),
    ([(0, 2)], [], "chains: a forest needs"),
    ([(0, 2)], [()], r"chains\[0\] is empty"),
    ([(0, 2)], [(0, 1)], r"chains\[0\] = \(0, 1\): segment ids"),
    ([(0, 2), (2, 4)], [(0,), (1, 1)], r"chains\[1\] = \(1, 1\) reads a segment twice"),
    ([(0, 4), (2, 6)], [(0, 1)], "overlap"),
])
def test_forest_validation(segments, chains, match):
    with pytest.raises(ValueError, match=match):
        DecodeForest(segments, chains)


def test_helper_and_plan_validation():
    with pytest.raises(ValueError, match="suffix_lengths has 1 groups"):
        DecodeForest.groups([4, 4], [[1]])
    with pytest.raises(ValueError, match="prefix_lengths must be >= 1"):
        DecodeForest.groups([0], [[1]])
    with pytest.raises(ValueError, match="chunk"):
        DecodeForest.groups([4], [[1]]).plan(chunk=0, block_r=1)


def test_input_validation():
    forest = DecodeForest.groups([6], [[2, 2]])
    q, k, v = inputs(forest, 4, 2, 16, 16)
    cases = [
        ((q[:1], k, v), "q holds 1 sequences but the forest has 2"),
        ((q, k[..., :8], v), "k_cache head size 8 differs from q's 16"),
        ((q, k, v[:1]), "v_cache .* must match k_cache"),
        ((q[:, :3], k, v), r"query heads \(3\) must be a multiple of KV heads \(2\)"),
        ((q, k[:, :8], v[:, :8]), "the forest reads cache rows up to 9 but the cache holds 8"),
        ((q.double(), k, v), "must share one of float32"),
        ((q[0], k, v), "must be 3-d"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            cascade_decode(*args, forest, 0.25)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    from arctic_rl_kernels import triton_device

    monkeypatch.setattr(triton_device, "interpreted", lambda kernel: False)
    forest = DecodeForest.groups([4], [[1]])
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        cascade_decode(*inputs(forest, 2, 1, 16, 16), forest, 0.25)


def bench_args(*argv):
    from arctic_rl_bench import cascade

    p = argparse.ArgumentParser()
    cascade.add_arguments(p)
    return cascade, p.parse_args(list(argv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_bench_refuses_to_time_on_cpu():
    cascade, args = bench_args()
    with pytest.raises(SystemExit, match="measures on a CUDA GPU only"):
        cascade.main(args)


@pytest.mark.skipif(not INTERPRETED, reason="the smoke run needs the kernel imported under the interpreter")
def test_bench_interpret_smoke(capsys):
    cascade, args = bench_args("--interpret-smoke", "--sweep", "--json")
    assert cascade.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "mean nothing" in result["note"]
    for r in result["results"]:
        assert r["parity_max_rel_err"] <= 1e-2
        # the prompt is read once instead of once per sample; the samples' own tokens are read once either way
        prompt, suffix = cascade.SMOKE["prompt_len"], cascade.SMOKE["suffix_len"]
        assert r["bound_speedup"] == pytest.approx((r["group"] * (prompt + suffix)) / (prompt + r["group"] * suffix))
        for variant in ("cascade", "unshared"):
            x = r[variant]
            assert x["graph_s"] is None and x["timed_by"] == "eager" and x["eager_s"] > 0  # no CUDA graphs on CPU
            assert x["tokens_per_s"] == pytest.approx(r["group"] / x["eager_s"])
            assert x["bound_tokens_per_s"] is None and x["of_bound"] is None  # no bandwidth given: no read bound
    grid = cascade.SMOKE_SWEEP
    assert [s["group"] for s in result["sweep"]] == cascade.SMOKE["group"]
    for s in result["sweep"]:
        assert len(s["tried"]) == math.prod(map(len, grid.values()))
        assert all("error" not in t and t["parity_max_rel_err"] <= 1e-2 for t in s["tried"])
        assert s["best"]["eager_s"] == min(t["eager_s"] for t in s["tried"])
        assert (s["default"]["chunk"], s["default"]["block_n"]) == (cascade.SMOKE["chunk"], 16)


def test_bench_host_plan_times_what_the_vllm_backend_plans_per_step(capsys):
    """`--host-plan`: the per-step host work of zorro.inference's vLLM backend, on the CPU, for the given shape."""
    cascade, args = bench_args("--host-plan", "3", "--prompt-len", "100", "--group", "2", "4", "--suffix-len", "7",
                               "--repeats", "1", "--json")
    assert cascade.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["group"], r["sequences"]) for r in result["results"]] == [(2, 6), (4, 12)]
    assert all(r["host_ms"] > 0 for r in result["results"])


def paged_case(rng: random.Random, block_size: int):
    """GRPO groups in a paged cache as a prefix cache lays them out: a group's full prompt blocks are shared
    (one physical block each), the prompt's partial last block and each sample's own tokens are the sample's."""
    free = list(range(200))
    rng.shuffle(free)
    tables, lengths = [], []
    for _ in range(rng.randint(1, 3)):
        prompt = rng.randint(1, 4 * block_size)
        shared = [free.pop() for _ in range(prompt // block_size)]
        for _ in range(rng.randint(1, 5)):
            length = prompt + rng.randint(0, 2 * block_size)
            own = [free.pop() for _ in range(-(-length // block_size) - len(shared))]
            tables.append(shared + own)
            lengths.append(length)
    return tables, lengths


def paged_reference(q, k_cache, v_cache, tables, lengths, block_size, scale):
    """Each sequence's keys gathered through its block table, softmax in fp32: no forest involved."""
    group = q.shape[1] // k_cache.shape[0]
    out = []
    for b, (table, length) in enumerate(zip(tables, lengths)):
        rows = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(length)])
        k = k_cache[:, rows].float().repeat_interleave(group, 0)
        v = v_cache[:, rows].float().repeat_interleave(group, 0)
        out.append((torch.softmax((k @ q[b].float()[:, :, None])[..., 0] * scale, -1)[:, None, :] @ v)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("seed", range(3))
def test_paged_cache_through_block_tables_matches_reference(seed):
    """A paged cache in vLLM's layout ([blocks, block_size, Hkv, D], seen as [Hkv, rows, D] by strides): the
    forest found from the block tables shares each group's full prompt blocks, and the output is each sequence's
    attention through its own block table."""
    rng = random.Random(seed)
    block_size, H, Hkv, D = 4, 4, 2, 16
    tables, lengths = paged_case(rng, block_size)
    forest = DecodeForest.from_block_tables(tables, lengths, block_size)
    gen = torch.Generator().manual_seed(seed)
    paged_k, paged_v = (torch.randn(200, block_size, Hkv, D, generator=gen) for _ in range(2))
    k_cache, v_cache = (t.view(200 * block_size, Hkv, D).permute(1, 0, 2) for t in (paged_k, paged_v))
    q = torch.randn(len(tables), H, D, generator=gen)
    q, k_cache, v_cache = (t.to(DEVICE) for t in (q, k_cache, v_cache))
    out = cascade_decode(q, k_cache, v_cache, forest, 0.25)
    ref = paged_reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), tables, lengths, block_size, 0.25)
    assert (out.cpu() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # Shared: every distinct cached token is one logical key, read once (one block of readers covers a group).
    distinct = {t[i // block_size] * block_size + i % block_size for t, n in zip(tables, lengths) for i in range(n)}
    assert forest.num_tokens == len(distinct) == len(set(forest.key_rows.tolist()))
    assert (cascade_decode(q, k_cache, v_cache, forest.unshared(), 0.25).cpu() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert forest.plan(CHUNKS[0], 8).keys_read == len(distinct)


def _trie_case(rng: random.Random, block_size: int):
    """Multi-turn shapes a prefix cache makes: a tree of full shared blocks (episodes branching at several depths),
    sequences whose table is another's prefix or equal to one, and each sequence's own partial last block."""
    free = iter(rng.sample(range(1000), 1000))
    tables, lengths = [], []
    trunks = [[next(free) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 3))]
    for _ in range(rng.randint(2, 12)):
        trunk = rng.choice(trunks)
        path = trunk[: rng.randint(0, len(trunk))] + [next(free) for _ in range(rng.randint(0, 2))]
        if rng.random() < 0.3 and path:
            trunks.append(path)  # a later sequence may branch off this one
        partial = rng.randint(0, block_size - 1) if rng.random() < 0.6 else 0
        if not path and not partial:
            partial = 1
        tables.append(path + ([next(free)] if partial else []))
        lengths.append(len(path) * block_size + partial)
    return tables, lengths


@pytest.mark.parametrize("seed", range(40))
def test_block_tables_forest_reads_each_sequence_its_own_keys_and_each_shared_block_once(seed):
    """Random trees of shared blocks: each sequence's chain, read through key_rows, is exactly its own cache rows
    in order; every block two sequences share through a common prefix is one logical range (keys == distinct
    (prefix, block) pairs); a tensor of tables padded with stale ids gives the same forest as the lists."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    tables, lengths = _trie_case(rng, block_size)
    forest = DecodeForest.from_block_tables(tables, lengths, block_size)
    rows = forest.key_rows.tolist()
    for b, (table, length) in enumerate(zip(tables, lengths)):
        own = [table[i // block_size] * block_size + i % block_size for i in range(length)]
        assert [r for i in forest.chains[b] for r in rows[slice(*forest.segments[i])]] == own, b
    distinct = {(tuple(t[: i // block_size + 1]), i % block_size) for t, n in zip(tables, lengths) for i in range(n)}
    assert forest.num_tokens == len(distinct)
    width = max(map(len, tables)) + 2
    padded = torch.tensor([t + [rng.randrange(1000) for _ in range(width - len(t))] for t in tables])
    again = DecodeForest.from_block_tables(padded, lengths, block_size)
    assert (again.segments, again.chains, again.key_rows.tolist()) == (forest.segments, forest.chains, rows)


def test_block_tables_share_only_what_is_shared():
    """Two samples with one full shared block, then their own; a third sequence alone; a shared block filled
    differently is refused."""
    forest = DecodeForest.from_block_tables([[7, 1], [7, 2], [5]], [6, 5, 3], block_size=4)
    assert forest.segments == ((0, 4), (4, 6), (6, 7), (7, 10))
    assert forest.chains == ((0, 1), (0, 2), (3,))
    assert forest.key_rows.tolist() == [28, 29, 30, 31, 4, 5, 8, 20, 21, 22]
    with pytest.raises(ValueError, match="only full blocks are shared"):
        DecodeForest.from_block_tables([[7], [7]], [4, 3], block_size=4)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 9"):
        DecodeForest.from_block_tables([[7, 1]], [9], block_size=4)


def test_block_tables_of_a_32k_prompt_are_one_shared_segment():
    """2,048 shared 16-token blocks (a 32K prompt) and each sample's own: one segment read by all, one each
    (a run of blocks once made one recursive call per block, past Python's recursion limit)."""
    prompt = list(range(2048))
    tables = [prompt + [2048 + i] for i in range(4)]
    forest = DecodeForest.from_block_tables(tables, [2048 * 16 + 5] * 4, 16)
    assert forest.segments == ((0, 32768),) + tuple((32768 + 5 * i, 32768 + 5 * (i + 1)) for i in range(4))
    assert forest.chains == tuple((0, i + 1) for i in range(4))
    assert forest.key_rows[:32768].tolist() == list(range(32768))
    assert forest.key_rows[32768:32773].tolist() == list(range(32768, 32773))


def test_the_key_chunk_splits_the_shared_prompt_to_fill_the_device(monkeypatch):
    """The chunks an H100 (132 multiprocessors) gets at the shapes swept on one (8 KV heads, 32 readers per item):
    the fastest measured there, or within 7% of it; segments read by one sequence do not count, unless none is
    shared."""
    from arctic_rl_kernels import cascade_decode as cd

    monkeypatch.setattr(cd, "_multiprocessors", lambda device: 132)
    gpu = torch.device("cuda")  # only its multiprocessor count is read
    picks = {(P, G): fill_chunk(DecodeForest.groups([P], [[512] * G]), 8, 32, gpu)
             for P, G in ((32768, 8), (32768, 16), (32768, 32), (32768, 64), (4096, 8), (4096, 64))}
    assert picks == {(32768, 8): 2048, (32768, 16): 2048, (32768, 32): 2048, (32768, 64): 2048, (4096, 8): 256,
                     (4096, 64): 512}
    # Nothing shared: every segment counts (a 4K prompt once per sample is 8 x 2 items of 2048 keys, and 8 more).
    assert fill_chunk(DecodeForest.groups([4096], [[512] * 8]).unshared(), 8, 32, gpu) == 2048
    assert fill_chunk(DecodeForest.groups([4096], [[512]]), 8, 32, gpu) == 512
    assert fill_chunk(DecodeForest.groups([64], [[4]]), 1, 32, gpu) == CHUNKS[-1]  # nothing fills it: the finest
