"""`arctic-rl bench replay` runs end to end on a small shape and reports what it promises (not a timing test):
replay on leaves no route flipped and the sampled tokens' log-prob gap no larger than with the trainer's own
routing; the runs log every step."""

import json

from tests.preimported import arctic_rl


def test_bench_replay_reports_flips_gaps_curves_and_cost(tmp_path):
    plot = tmp_path / "replay.png"
    out = arctic_rl("bench", "replay", "--steps", "2", "--prompts", "2", "--group", "4", "--max-tokens", "12",
                    "--plot", str(plot), "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    moe, dense = result["mismatch"]["moe"], result["mismatch"]["dense"]
    assert moe["flipped_on"] == 0.0 and 0 < moe["flipped_off"] < 1  # near-tied routers flip some routes in bf16
    assert moe["gap_on"]["max"] <= moe["gap_off"]["max"] and moe["tokens"] == dense["tokens"] == 2 * 4 * 12
    for replay in ("R3", "off"):
        assert [h["step"] for h in result["runs"][replay]] == [0, 1]
    assert {"ratio_std_native", "flipped_native"} <= set(result["runs"]["R3"][0])
    assert set(result["cost_s"]) == {"generate_R3", "generate_off", "fwd_bwd_replayed", "fwd_bwd_own_routing",
                                     "generate_ratio", "fwd_bwd_ratio"}
    assert plot.stat().st_size > 0
