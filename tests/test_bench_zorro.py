"""`arctic-rl bench zorro` runs end to end on a small shape and reports what it promises (not a timing test)."""

import json
import os

import pytest

from tests.preimported import arctic_rl


def bench_zorro(*args: str) -> dict:
    """`arctic-rl bench zorro ARGS`: its JSON line."""
    proc = arctic_rl("bench", "zorro", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_zorro_reports_parity_and_fields():
    result = bench_zorro("--layers", "1", "--hidden", "64", "--prompt-len", "48", "--response-len", "8",
                         "--group", "4", "--groups", "2", "--repeats", "1", "--json")
    common = ("naive_s", "zorro_s", "speedup", "theory", "logprob_max_abs_err", "peak_mem_naive_mb", "peak_mem_zorro_mb")
    assert set(common) | {"grad_rel_err"} <= set(result)
    assert set(common) <= set(result["log_probs"])
    # the tokens the engine reports it ran: every sequence whole, or each group's prompt once
    assert result["tokens_naive"] == 2 * 4 * 56 and result["tokens_zorro"] == 2 * (48 + 4 * 8)
    assert result["logprob_max_abs_err"] < 1e-4 and result["grad_rel_err"] < 1e-4
    assert 1.0 < result["theory"] < 56 * 4 / (48 + 4 * 8) + 1e-9  # bounded by the token ratio


def test_bench_zorro_multi_turn_episodes_share_the_prompt_and_each_episodes_history():
    result = bench_zorro("--layers", "1", "--hidden", "64", "--prompt-len", "16", "--response-len", "8",
                         "--turns", "3", "--group", "2", "--groups", "1", "--repeats", "1", "--json")
    # Turn k's prompt: the first prompt, then k x (8 response + 4 reply) tokens. Unshared: 6 rows padded to the
    # longest turn (16 + 2 x 12 + 8 = 48); shared: the prompt once, then each episode's 3 responses and 2 replies.
    assert result["tokens_naive"] == 6 * 48 and result["tokens_zorro"] == 16 + 2 * (3 * 8 + 2 * 4)
    assert result["logprob_max_abs_err"] < 1e-4 and result["grad_rel_err"] < 1e-4
    assert result["theory"] is None and result["shape"]["turns"] == 3


@pytest.mark.scenario
def test_bench_zorro_against_the_packed_baseline_with_checkpointing_and_a_token_budget():
    """The long-prompt rows' options on a small shape: both modes on one set of ZoRRo kernels, the baseline packed
    unshared, activations checkpointed, each group across micro-batches of a token budget."""
    result = bench_zorro("--layers", "1", "--hidden", "64", "--prompt-len", "24", "--response-len", "6",
                         "--group", "3", "--groups", "1", "--repeats", "1", "--baseline", "packed",
                         "--attention-backend", "math",
                         "--gradient-checkpointing", "--micro-batch-tokens", "40", "--json")
    assert result["shape"]["baseline"] == "packed" and result["shape"]["attention_backend"] == "math"
    # Unshared: 3 whole sequences of 30, one per micro-batch. Shared under a 40-token budget: the prompt and one
    # response (30), then the prompt again with the next response... at most 40 packed tokens each: 24+6+6, 24+6.
    assert result["tokens_naive"] == 3 * 30 and result["tokens_zorro"] == (24 + 2 * 6) + (24 + 6)
    assert result["logprob_max_abs_err"] < 1e-4 and result["grad_rel_err"] < 1e-4


def test_the_memory_plan_checkpoints_and_budgets_only_what_the_device_needs():
    """On an 80 GB GPU at Qwen3-0.6B's shape, G=8: the padded batch ran out of memory at P=4096 without
    checkpointing while ZoRRo fit at P=16384; the plan checkpoints where the estimate says the batch needs it, adds a
    token budget past that, and names the flags where one sequence cannot fit."""
    from transformers import Qwen3Config

    from arctic_rl_bench import zorro_memory
    from arctic_rl_bench.zorro import _parameters

    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    h100 = 80 * 10**9
    args = {"prompt_len": 1024, "response_len": 128, "turns": 1, "group": 8, "groups": 1, "baseline": "padded",
            "dtype": "bfloat16", "gradient_checkpointing": "auto", "micro_batch_tokens": None}
    params = _parameters(config)
    assert 0.5e9 < params < 0.7e9  # Qwen3-0.6B
    small = zorro_memory.plan(config, args, h100, params)
    assert small["gradient_checkpointing"] is False and small["micro_batch_tokens"] is None
    # Measured on the H100 without checkpointing: 39.5 GB padded at P=2048 (18,432 tokens), 70.2 GB ZoRRo at
    # P=16384 (32,768 tokens); with it at P=16384: 21.1 GB padded, 5.0 GB ZoRRo. Each estimated within 15%.
    def estimate(prompt_len, mode, checkpointing):
        computed = zorro_memory.tokens({**args, "prompt_len": prompt_len, "response_len": prompt_len // 8}, mode)
        return zorro_memory.activation_bytes(config, computed, 2, checkpointing) / 1e9

    assert zorro_memory.tokens({**args, "prompt_len": 8192, "response_len": 1024}, "zorro") == 8192 + 8 * 1024
    for (prompt_len, mode, checkpointing), measured in {(2048, "naive", False): 39.5, (16384, "zorro", False): 70.2,
                                                        (16384, "naive", True): 21.1, (16384, "zorro", True): 5.0}.items():
        assert 0.85 * measured < estimate(prompt_len, mode, checkpointing) < 1.15 * measured
    at_4k = zorro_memory.plan(config, {**args, "prompt_len": 4096, "response_len": 512}, h100, params)
    assert at_4k["gradient_checkpointing"] is True and at_4k["micro_batch_tokens"] is None
    at_64k = zorro_memory.plan(config, {**args, "prompt_len": 65536, "response_len": 8192}, h100, params)
    assert at_64k["gradient_checkpointing"] is True and 73728 <= at_64k["micro_batch_tokens"] < 8 * 73728
    assert max(at_64k["estimate_gb"].values()) < 0.85 * 80
    # Flags set by the user are kept; a sequence that cannot fit names them.
    forced = zorro_memory.plan(config, {**args, "gradient_checkpointing": "off", "micro_batch_tokens": 4096}, h100, params)
    assert forced["gradient_checkpointing"] is False and forced["micro_batch_tokens"] == 4096
    with pytest.raises(SystemExit, match="--prompt-len 1048576: .*--gradient-checkpointing on and --micro-batch-tokens"):
        zorro_memory.plan(config, {**args, "prompt_len": 2**20, "response_len": 2**17}, h100, params)


def test_bench_zorro_measures_both_16_bit_modes_against_fp32_and_profiles_them():
    """`--fp32-reference`: ZoRRo run again in fp32, and each bf16 mode's gradients and log-probs measured against
    it (bf16 rounding: about 1e-2 relative, not the 1e-4 of fp32 parity). `--profile 3`: each mode's three
    costliest operators, by their own time."""
    result = bench_zorro("--layers", "1", "--hidden", "64", "--prompt-len", "48", "--response-len", "8",
                         "--group", "4", "--repeats", "1", "--dtype", "bfloat16", "--fp32-reference", "--profile", "3",
                         "--json")
    against = result["fp32_reference"]
    assert result["shape"]["dtype"] == "bfloat16" and result["shape"]["fp32_reference"] is True
    for mode in ("naive", "zorro"):
        assert 0 < against["grad_rel_err"][mode] < 5e-2 and 0 < against["logprob_max_abs_err"][mode] < 0.1
        ops = result["profile"][mode]
        assert len(ops) == 3 and ops[0]["ms"] >= ops[1]["ms"] >= ops[2]["ms"] > 0 and ops[0]["calls"] >= 1
        assert all(op["op"] and 0 < op["share"] <= 1 for op in ops)


def test_bench_zorro_builds_the_model_once_into_its_cache_and_reuses_it(tmp_path):
    """`--model-cache DIR`: the first run builds the random model there (nothing half-written left beside it), the
    next run of the same shape loads that one instead of building another, and reports where its time went."""
    args = ["--layers", "1", "--hidden", "64", "--prompt-len", "24", "--response-len", "8",
            "--group", "2", "--repeats", "1", "--model-cache", str(tmp_path), "--json"]
    first = bench_zorro(*args)
    [model] = os.listdir(tmp_path)
    assert os.path.exists(tmp_path / model / "config.json")
    (tmp_path / model / "marker").write_text("built by the first run")
    second = bench_zorro(*args)
    assert sorted(os.listdir(tmp_path)) == [model] and (tmp_path / model / "marker").exists()
    for result in (first, second):
        assert result["logprob_max_abs_err"] < 1e-4 and result["grad_rel_err"] < 1e-4
        seconds = result["seconds"]
        for mode in ("naive", "zorro"):
            assert 0 < seconds[mode]["setup"] < seconds[mode]["worker"]
    assert first["seconds"]["model"] > 0

    # A cache that is a file is refused by the flag's name, before anything is built or written.
    (tmp_path / "file").write_text("")
    refused = arctic_rl("bench", "zorro", *args[:-3], "--model-cache", str(tmp_path / "file"), "--json")
    assert refused.returncode != 0 and "--model-cache" in refused.stderr and "not a folder" in refused.stderr
    assert sorted(os.listdir(tmp_path)) == sorted([model, "file"]) and (tmp_path / "file").read_text() == ""
