"""`arctic-rl bench zorro` runs end to end on a small shape and reports what it promises (not a timing test)."""

import json
import os
import subprocess
import sys

import pytest


def test_bench_zorro_reports_parity_and_fields():
    cli = os.path.join(os.path.dirname(sys.executable), "arctic-rl")
    out = subprocess.run(
        [cli, "bench", "zorro", "--layers", "1", "--hidden", "64", "--prompt-len", "48", "--response-len", "8",
         "--group", "4", "--groups", "2", "--repeats", "1", "--json"],
        capture_output=True, text=True, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    common = ("naive_s", "zorro_s", "speedup", "theory", "logprob_max_abs_err", "peak_mem_naive_mb", "peak_mem_zorro_mb")
    assert set(common) | {"grad_rel_err"} <= set(result)
    assert set(common) <= set(result["log_probs"])
    # the tokens the engine reports it ran: every sequence whole, or each group's prompt once
    assert result["tokens_naive"] == 2 * 4 * 56 and result["tokens_zorro"] == 2 * (48 + 4 * 8)
    assert result["logprob_max_abs_err"] < 1e-4 and result["grad_rel_err"] < 1e-4
    assert 1.0 < result["theory"] < 56 * 4 / (48 + 4 * 8) + 1e-9  # bounded by the token ratio


def test_bench_zorro_multi_turn_episodes_share_the_prompt_and_each_episodes_history():
    cli = os.path.join(os.path.dirname(sys.executable), "arctic-rl")
    out = subprocess.run(
        [cli, "bench", "zorro", "--layers", "1", "--hidden", "64", "--prompt-len", "16", "--response-len", "8",
         "--turns", "3", "--group", "2", "--groups", "1", "--repeats", "1", "--json"],
        capture_output=True, text=True, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Turn k's prompt: the first prompt, then k x (8 response + 4 reply) tokens. Unshared: 6 rows padded to the
    # longest turn (16 + 2 x 12 + 8 = 48); shared: the prompt once, then each episode's 3 responses and 2 replies.
    assert result["tokens_naive"] == 6 * 48 and result["tokens_zorro"] == 16 + 2 * (3 * 8 + 2 * 4)
    assert result["logprob_max_abs_err"] < 1e-4 and result["grad_rel_err"] < 1e-4
    assert result["theory"] is None and result["shape"]["turns"] == 3


@pytest.mark.scenario
def test_bench_zorro_against_the_packed_baseline_with_checkpointing_and_a_token_budget():
    """The long-prompt rows' options on a small shape: both modes on one set of ZoRRo kernels, the baseline packed
    unshared, activations checkpointed, each group across micro-batches of a token budget."""
    cli = os.path.join(os.path.dirname(sys.executable), "arctic-rl")
    out = subprocess.run(
        [cli, "bench", "zorro", "--layers", "1", "--hidden", "64", "--prompt-len", "24", "--response-len", "6",
         "--group", "3", "--groups", "1", "--repeats", "1", "--baseline", "packed", "--attention-backend", "math",
         "--gradient-checkpointing", "--micro-batch-tokens", "40", "--json"],
        capture_output=True, text=True, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["shape"]["baseline"] == "packed" and result["shape"]["attention_backend"] == "math"
    # Unshared: 3 whole sequences of 30, one per micro-batch. Shared under a 40-token budget: the prompt and one
    # response (30), then the prompt again with the next response... at most 40 packed tokens each: 24+6+6, 24+6.
    assert result["tokens_naive"] == 3 * 30 and result["tokens_zorro"] == (24 + 2 * 6) + (24 + 6)
    assert result["logprob_max_abs_err"] < 1e-4 and result["grad_rel_err"] < 1e-4
