"""`arctic-rl bench frameworks`: its workload, its runners' parsing of a framework's log, its summary's schema and
arithmetic, a framework that cannot run reported with its reason. The bench itself runs minutes per column and is
not run here."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import pytest

from arctic_rl_bench.frameworks import bench
from arctic_rl_bench.frameworks.workload import SHAPES, Shape, user_message


def _runner(name: str, monkeypatch=None):
    """A module the bench runs by path in a framework's environment, loaded afresh (as that interpreter would)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name.replace('/', '_')}", bench.HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:  # dataclasses look their module up by name while the class is built
        monkeypatch.setitem(sys.modules, spec.name, module)
        if name.startswith("alone/"):  # the alone patches import what they share from their folder, afresh too
            monkeypatch.syspath_prepend(str(bench.HERE / "alone"))
            monkeypatch.delitem(sys.modules, "alone_patching", raising=False)
    spec.loader.exec_module(module)
    return module


# One step's console line as verl 0.9.1 writes it (from a run through Arctic RL, shortened).
VERL_LINE = ("\x1b[36m(TaskRunnerV1 pid=21810)\x1b[0m step:2 - global_seqlen/min:36377.0 - actor/entropy:6.28 - "
             "actor/pg_loss:-0.0735 - actor/arctic/loss:-0.0736 - actor/grad_norm:0.781 - actor/lr:1e-05 - "
             "critic/score/mean:0.53125 - response_length/mean:114.03 - timing_s/gen:8.19 - timing_s/old_log_prob:1.58 - "
             "timing_s/update_actor:6.61 - timing_s/update_weights:0.0285 - timing_s/step:24.62 - perf/mfu:nan")


def test_verl_runner_reads_each_steps_timings_loss_and_reward():
    steps = _runner("verl_runner").parse("unrelated line\n" + VERL_LINE + "\nstep:3 - no timings here\n")
    assert steps == [{"step": 2, "seconds": {"gen": 8.19, "old_log_prob": 1.58, "update_actor": 6.61,
                                             "update_weights": 0.0285, "step": 24.62},
                      "pg_loss": -0.0735, "grad_norm": 0.781, "reward": 0.53125, "response_length": 114.03}]


def test_the_dedup_bound_counts_each_groups_prompt_once():
    shape = Shape(prompts_per_step=4, samples_per_prompt=8, prompt_tokens=1000, response_tokens=125)
    assert shape.dedup_bound() == pytest.approx(8 * 1125 / (1000 + 8 * 125))
    assert SHAPES["prompt-heavy"].dedup_bound() > 4 > SHAPES["generation-heavy"].dedup_bound()


def test_the_compute_bound_counts_attention_to_the_prompt_per_response():
    shape = Shape(prompts_per_step=1, samples_per_prompt=2, prompt_tokens=2, response_tokens=1)
    model = {"layers": 1, "hidden": 2, "heads": 1, "kv_heads": 1, "intermediate": 2}
    # per position 2*4 + 2*4 + 3*4 = 28 multiply-adds, per (query, key) pair 4, the head 2 per response token;
    # unshared: 2 rows of 3 positions and 6 pairs; shared: 4 positions, the prompt's 3 pairs and 2 x (2 + 1)
    assert shape.compute_bound(model, vocab=1) == pytest.approx((2 * (3 * 28 + 6 * 4) + 4) / (4 * 28 + 9 * 4 + 4))
    from arctic_rl_bench.frameworks.workload import MODEL
    heavy = SHAPES["prompt-heavy"]
    assert 1 < heavy.compute_bound(MODEL, 567) < heavy.dedup_bound()


def test_a_prompts_context_reaches_its_length_and_differs_per_prompt():
    words = lambda text: len(text.split())  # noqa: E731 -- a stand-in tokenizer: one token per word
    first, second = user_message(0, 300, words), user_message(1, 300, words)
    assert 290 <= words(first) <= 300 and 290 <= words(second) <= 300
    assert first != second and first.endswith("what is 0 plus 3?")
    assert user_message(0, 300, words) == first  # the same data in every column and round


def _run(seconds: dict, pg_loss: float = -0.07) -> dict:
    """A runner's output: three steps, the first slower (a warm-up)."""
    steps = [{"step": i + 1, "seconds": {p: v * (3 if i == 0 else 1) for p, v in seconds.items()},
              "backend_seconds": {"old_log_prob": seconds["old_log_prob"] / 2},
              "pg_loss": pg_loss, "grad_norm": 0.5, "reward": 0.25 * i} for i in range(3)]
    return {"framework": "verl", "steps": steps}


def test_the_summary_holds_medians_ratios_and_the_share_of_the_bound():
    verl = bench.FRAMEWORKS["verl"]
    runs = {"alone": [_run({"gen": 4.0, "old_log_prob": 8.0, "update_actor": 20.0, "update_weights": 1.0, "step": 33.0})],
            "zorro-off": [_run({"gen": 2.0, "old_log_prob": 2.0, "update_actor": 4.0, "update_weights": 0.1, "step": 8.1})],
            "zorro-on": [_run({"gen": 2.0, "old_log_prob": 1.0, "update_actor": 2.0, "update_weights": 0.1, "step": 5.1})]}
    summary = bench.summarise(verl, "prompt-heavy", runs, 567)
    json.dumps(summary)  # the --json file holds it as it is
    assert summary["seconds"]["alone"]["update_actor"] == 20.0  # the warm-up step is left out
    assert summary["ratios"]["alone_over_zorro_off"]["old_log_prob"] == pytest.approx(4.0)
    assert summary["ratios"]["zorro_off_over_on"]["gen"] == pytest.approx(1.0)
    assert summary["ratios"]["zorro_off_over_on_update"] == pytest.approx(2.0)
    bound = SHAPES["prompt-heavy"].dedup_bound()
    assert summary["dedup_bound"] == bound
    assert summary["zorro_fraction_of_bound"] == pytest.approx(2.0 / bound)
    assert summary["zorro_fraction_of_compute_bound"] == pytest.approx(2.0 / summary["compute_bound"])
    assert summary["zorro_share_of_gain"] == pytest.approx(1.0 / (bound - 1))
    assert summary["first_step"]["alone"] == {"pg_loss": -0.07, "grad_norm": 0.5}
    assert summary["reward_per_step"]["zorro-on"] == [[0.0, 0.25, 0.5]]
    assert summary["errors"] == {"alone": [], "zorro-off": [], "zorro-on": []}
    assert summary["backend_seconds"]["zorro-on"]["old_log_prob"] == 0.5  # alone has no backend
    assert "alone" not in summary["backend_seconds"]
    assert "| old_log_prob | 8.00 | 2.00 | 1.00 | 4.00x | 2.00x |" in bench.table(
        {"frameworks": {"verl": {"shapes": {"prompt-heavy": summary}}}})


def test_a_failed_column_is_reported_not_averaged():
    verl = bench.FRAMEWORKS["verl"]
    runs = {"alone": [{"error": "verl failed: out of memory"}],
            "zorro-off": [_run({"gen": 2.0, "old_log_prob": 2.0, "update_actor": 4.0, "update_weights": 0.1, "step": 8.1})]}
    summary = bench.summarise(verl, "prompt-heavy", runs, 567)
    assert summary["seconds"]["alone"]["gen"] is None
    assert summary["ratios"]["alone_over_zorro_off"]["gen"] is None
    assert summary["errors"]["alone"] == ["verl failed: out of memory"]


def test_a_column_that_cannot_run_here_is_reported_with_its_reason(tmp_path):
    result = bench.run(["primerl"], ["prompt-heavy"], ["alone"], rounds=1, steps=2, alone_overrides=[],
                       work=tmp_path, log=lambda *_: None, mode="async")
    # prime-rl runs through Arctic RL; alone it cannot, so asked for alone alone, nothing runs and the reason stands.
    entry = result["frameworks"]["primerl"]
    assert entry["alone_not_run"] == bench.FRAMEWORKS["primerl"].alone_not_run and "flash-attn" in entry["alone_not_run"]
    assert entry["shapes"]["prompt-heavy"]["runs"] == {}
    assert "primerl alone: not run" in bench.table(result)
    assert all(bench.FRAMEWORKS[name].alone_env and not bench.FRAMEWORKS[name].alone_not_run for name in ("verl", "skyrl"))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_mode_sets_every_column_and_the_alone_tuning_only_alone(tmp_path, monkeypatch, mode):
    commands = []
    monkeypatch.setattr(bench, "environment", lambda script: sys.executable)
    monkeypatch.setattr(bench, "run_column", lambda fw, column, shape, python, model, folder, steps, overrides, dtype,
                        diagnostics, placement: commands.append((fw.name, column, overrides)) or {"error": "not run here"})
    result = bench.run(["verl", "primerl"], ["prompt-heavy"], ["alone", "zorro-off", "zorro-on"], rounds=1, steps=2,
                       alone_overrides=["tuned=1"], work=tmp_path, log=lambda *_: None, mode=mode)
    verl = list(bench.FRAMEWORKS["verl"].modes[mode])
    verl_runs = [("verl", "alone", verl + ["tuned=1"]), ("verl", "zorro-off", verl), ("verl", "zorro-on", verl)]
    assert result["mode"] == mode and result["frameworks"]["verl"]["mode_settings"] == verl
    assert ("trainer.v1.trainer_mode=colocate_async" in verl) == (mode == "async")  # verl's own async trainer
    assert "trainer.fully_async.enabled=true" in bench.FRAMEWORKS["skyrl"].modes["async"]
    primerl = result["frameworks"]["primerl"]
    if mode == "async":  # its orchestrator one step ahead
        assert commands == verl_runs + [("primerl", "zorro-off", ["max_off_policy_steps=1"]),
                                        ("primerl", "zorro-on", ["max_off_policy_steps=1"])]
    else:  # prime-rl has no synchronous mode: nothing runs, the reason stands
        assert commands == verl_runs and primerl["shapes"] == {} and "no synchronous mode" in primerl["mode_not_run"]
        assert "primerl sync: not run: prime-rl 0.8's orchestrator has no synchronous mode" in bench.table(result)


def test_the_primerl_runner_takes_its_staleness_bound_and_refuses_other_settings():
    runner = _runner("primerl_runner")
    assert runner.off_policy_steps([]) == 1 and runner.off_policy_steps(["max_off_policy_steps=2"]) == 2
    with pytest.raises(SystemExit, match="max_off_policy_steps=N only"):
        runner.off_policy_steps(["batch_size=4"])


def test_verl_runner_gives_each_step_the_backends_share_from_the_adapters_trace(tmp_path):
    trace = tmp_path / "trace.jsonl"
    records = [{"kind": "generate", "global_steps": 1, "first_arrival": 10.0, "answered": 12.0},
               {"kind": "generate", "global_steps": 1, "first_arrival": 10.5, "answered": 13.0},
               {"kind": "log_probs", "call_s": 0.7}, {"kind": "fwd_bwd", "call_s": 1.5},
               {"kind": "generate", "global_steps": 2, "first_arrival": 20.0, "answered": 21.0},
               {"kind": "log_probs", "call_s": 0.6}, {"kind": "fwd_bwd", "call_s": 1.4}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = [{"step": 1, "seconds": {}}, {"step": 2, "seconds": {}}]
    _runner("verl_runner").backend_shares(str(trace), steps)
    assert steps[0]["backend_seconds"] == {"gen": 3.0, "old_log_prob": 0.7, "update_actor": 1.5}
    assert steps[1]["backend_seconds"] == {"gen": 1.0, "old_log_prob": 0.6, "update_actor": 1.4}


def test_the_alone_patches_are_listed_with_why_and_timing_and_apply_once(monkeypatch):
    patches = _runner("alone/verl_alone_patches", monkeypatch)
    assert patches.APPLIED == []  # imported without verl's hook naming it: nothing applied
    rows = patches.listing()
    assert [r["name"] for r in rows] == ["P1 cpu-platform", "P2 gloo-process-group", "P3 vllm-cpu-keep-linear-weight",
                                         "P4 vllm-pause-keyword"]
    assert all(r["why"] and r["timing"] for r in rows)
    docs = (bench.ROOT / "docs" / "benchmarks.md").read_text()
    assert all(r["name"] in docs for r in rows)  # the bench's documentation lists every one

    calls = []
    probe = patches.AlonePatch("P9 probe", why="a test", timing="none", needed=lambda: True,
                               apply=lambda: calls.append("applied"))
    assert patches.apply(probe) and patches.APPLIED == ["P9 probe"] and calls == ["applied"]
    with pytest.raises(patches.AppliedTwice):
        patches.apply(probe)
    assert calls == ["applied"]
    skipped = patches.AlonePatch("P8 not here", why="a test", timing="none", needed=lambda: False,
                                 apply=lambda: calls.append("wrong"))
    assert not patches.apply(skipped) and "P8 not here" not in patches.APPLIED and calls == ["applied"]


def test_verls_diagnostic_patches_apply_only_where_named_and_are_documented(monkeypatch):
    patches = _runner("alone/verl_alone_patches", monkeypatch)
    assert patches.diagnostics_named("") == []  # verl alone: none
    assert [p.name for p in patches.diagnostics_named("D2, D1")] == ["D2 causal-sdpa", "D1 vectorised-logprobs"]
    with pytest.raises(ValueError, match="D3"):
        patches.diagnostics_named("D1,D3")
    docs = (bench.ROOT / "docs" / "benchmarks.md").read_text()
    assert all(p.why and p.timing and p.name in docs for p in patches.DIAGNOSTICS)
    runner = _runner("verl_runner", monkeypatch)
    assert runner.DIAGNOSTICS == bench.FRAMEWORKS["verl"].diagnostics == tuple(p.name.split()[0] for p in patches.DIAGNOSTICS)
    _, env = runner.alone(SHAPES["prompt-heavy"], "/tmp/ray", 2, diagnostics=("D1", "D2"))
    assert env["VERL_ALONE_DIAGNOSTICS"] == "D1,D2"
    assert "VERL_ALONE_DIAGNOSTICS" not in runner.alone(SHAPES["prompt-heavy"], "/tmp/ray", 2)[1]


def test_a_diagnostic_reaches_the_alone_runner_only_and_is_refused_where_the_runner_has_none(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="skyrl's runner takes none"):
        bench.run(["skyrl"], ["prompt-heavy"], ["alone"], 1, 2, [], tmp_path, diagnostics=("D1",))
    assert not (tmp_path / "model").exists()  # refused before anything ran
    commands = []
    monkeypatch.setattr(bench.subprocess, "run", lambda command, **kw: commands.append(command) or
                        type("Done", (), {"stdout": "{}", "stderr": ""})())
    bench.run_column(bench.FRAMEWORKS["verl"], "alone", "prompt-heavy", "python", "/m", tmp_path, 2, [],
                     "bfloat16", ("D1", "D2"))
    assert commands[-1][-2:] == ["--diagnostic=D1", "--diagnostic=D2"]
    result = {"alone_diagnostics": ["D1", "D2"], "mode": "sync", "dtype": "bfloat16", "frameworks": {}}
    runs = {c: [_run({"gen": 1.0, "old_log_prob": 1.0, "update_actor": 1.0, "update_weights": 0.1, "step": 3.1})]
            for c in ("alone", "zorro-off")}
    result["frameworks"]["verl"] = {"shapes": {"prompt-heavy": bench.summarise(bench.FRAMEWORKS["verl"], "prompt-heavy",
                                                                               runs, 567)}}
    assert "alone with the diagnostic patches D1, D2: not verl as shipped" in bench.table(result)
    result["alone_diagnostics"] = []
    assert "diagnostic" not in bench.table(result)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_vectorised_logprobs_equal_verls_loop_over_rows(monkeypatch, dtype):
    import torch

    patches = _runner("alone/verl_alone_patches", monkeypatch)
    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    logits, labels = (torch.randn(300, 567) * 4).to(dtype), torch.randint(0, 567, (300,))
    if dtype == torch.float32:  # verl 0.9.1's logprobs_from_logits_v2, row by row
        loop = logits.gather(-1, labels[:, None])[:, 0] - torch.stack([torch.logsumexp(row, -1) for row in logits])
    else:
        loop = torch.stack([torch.log_softmax(row, -1)[label] for row, label in zip(logits, labels)])
    got = patches.logprobs_vectorised(logits, labels)
    assert got.dtype == loop.dtype
    # fp32 to within the reduction order (a whole tensor's kernel may sum a row in another order); 16 bits within
    # torch's bf16 tolerances (the rounding of one more step may differ by the CPU's instructions)
    torch.testing.assert_close(got, loop, **({"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else {}))


def test_causal_sdpa_for_right_padded_rows_drops_the_dense_mask_and_keeps_every_real_tokens_logits(monkeypatch):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers import masking_utils

    patches = _runner("alone/verl_alone_patches", monkeypatch)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    lengths = [20, 13, 7]
    ids = torch.randint(0, 97, (3, 20))
    right = (torch.arange(20)[None] < torch.tensor(lengths)[:, None]).long()
    left = right.flip(-1)
    positions = (right.cumsum(-1) - 1).clamp(min=0)
    masks = []
    spy = masking_utils.sdpa_mask

    def sdpa_mask(*args, **kwargs):
        masks.append(spy(*args, **kwargs))
        return masks[-1]

    monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa", sdpa_mask)
    with torch.no_grad():
        dense = model(input_ids=ids, attention_mask=right, position_ids=positions).logits
        assert masks[-1] is not None  # transformers as shipped: a dense mask for right-padded rows
        monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", masking_utils._ignore_causal_mask_sdpa)
        patches._causal_sdpa_for_right_padding(masking_utils)
        causal = model(input_ids=ids, attention_mask=right, position_ids=positions).logits
        assert masks[-1] is None  # SDPA's is_causal instead
        model(input_ids=ids, attention_mask=left)
        assert masks[-1] is not None  # left padding keeps its mask
    for row, n in enumerate(lengths):
        torch.testing.assert_close(causal[row, :n], dense[row, :n], rtol=1e-5, atol=1e-5)


def test_the_pause_keyword_patch_renames_verls_argument_once_vllm_is_imported(monkeypatch, tmp_path):
    import asyncio
    import types

    patches = _runner("alone/verl_alone_patches", monkeypatch)
    (tmp_path / "late_engine.py").write_text(
        "class AsyncLLM:\n"
        "    async def pause_generation(self, *, mode='abort', clear_cache=True):\n"
        "        return mode, clear_cache\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the hook is undone with the test
    monkeypatch.setattr(patches, "ASYNC_LLM", "late_engine")
    patches._vllm_pause_keyword()  # before the module is imported: it waits for the import
    assert "late_engine" not in sys.modules
    import late_engine  # imported later than the patch, as vLLM is in verl's server actor

    assert not any(getattr(finder, "name", None) == "late_engine" for finder in sys.meta_path)  # spent
    engine = late_engine.AsyncLLM()
    assert asyncio.run(engine.pause_generation(wait_for_inflight_requests=False, clear_cache=False)) == ("abort", False)
    assert asyncio.run(engine.pause_generation(wait_for_inflight_requests=True)) == ("wait", True)
    assert asyncio.run(engine.pause_generation(mode="keep")) == ("keep", True)
    wrapped = late_engine.AsyncLLM.pause_generation
    patches._vllm_pause_keyword()  # once imported, at once: verl's keyword is there already, nothing wraps it again
    assert late_engine.AsyncLLM.pause_generation is wrapped

    class Newer:  # a vLLM that takes verl's keyword is left as it is
        async def pause_generation(self, *, wait_for_inflight_requests=True):
            return wait_for_inflight_requests

    original = Newer.pause_generation
    patches._pause_generation_takes_verls_keyword(types.SimpleNamespace(AsyncLLM=Newer))
    assert Newer.pause_generation is original


def test_a_runner_reports_a_run_with_fewer_steps_than_asked_as_failed(capsys):
    from arctic_rl_bench.frameworks.workload import report

    assert report({"returncode": 0, "steps": [{"step": 1}, {"step": 2}]}, "log", steps_wanted=2) == 0
    assert report({"returncode": 0, "steps": [{"step": 1}]}, "...the log's tail", steps_wanted=2) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "error" not in json.loads(lines[0]) and json.loads(lines[1])["error"] == "...the log's tail"


def test_an_import_hook_for_a_module_already_hooked_fires_too(monkeypatch, tmp_path):
    """Two patches waiting for the same module both take effect, before it runs (the import system walks
    sys.meta_path as a list: a hook that removed itself there made it skip the next one)."""
    patching = _runner("alone/alone_patching", monkeypatch)
    (tmp_path / "hooked_twice.py").write_text("import events\nevents.seen.append('module')\n")
    (tmp_path / "events.py").write_text("seen = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import events

    hooks = [patching.BeforeImport("hooked_twice", lambda i=i: events.seen.append(f"hook {i}")) for i in (1, 2)]
    monkeypatch.setattr(sys, "meta_path", [*reversed(hooks), *sys.meta_path])
    import hooked_twice  # noqa: F401

    assert events.seen == ["hook 2", "hook 1", "module"]
    monkeypatch.delitem(sys.modules, "hooked_twice")
    import hooked_twice  # noqa: F401,F811 (a second import runs no hook again)

    assert events.seen == ["hook 2", "hook 1", "module", "module"]


def test_skyrls_alone_patches_are_listed_documented_and_apply_once(monkeypatch):
    patches = _runner("alone/skyrl_alone_patches", monkeypatch)
    rows = patches.listing()
    assert [r["name"] for r in rows] == ["S1 flash-attn-import", "S2 vllm-router-pd-flag", "S3 cuda-calls-on-cpu",
                                         "S4 gloo-process-group"]
    assert all(r["why"] and r["timing"] for r in rows)
    docs = (bench.ROOT / "docs" / "benchmarks.md").read_text()
    assert all(r["name"] in docs for r in rows)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the hooks apply_all installs stay in this test
    patches.apply_all()
    assert patches.APPLIED == [r["name"] for r in rows]
    with pytest.raises(patches.AppliedTwice):
        patches.apply_all()


def test_skyrls_model_wrapper_alone_gets_a_flash_attn_that_refuses_to_run(monkeypatch):
    patches = _runner("alone/skyrl_alone_patches", monkeypatch)
    finder = patches.FlashAttnForModelWrapper()
    for name in ("flash_attn", "flash_attn.bert_padding"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, finder])
    assert finder.find_spec("flash_attn", None) is None  # asked by anyone else (transformers): not installed
    wrapper = {"__name__": patches.MODEL_WRAPPER}
    exec("from flash_attn.bert_padding import pad_input, unpad_input", wrapper)
    with pytest.raises(RuntimeError, match="padding removal is off"):
        wrapper["unpad_input"]()
    for name in ("flash_attn", "flash_attn.bert_padding"):
        monkeypatch.delitem(sys.modules, name)


def test_skyrls_router_arguments_get_the_flag_skyrl_reads_only_where_missing(monkeypatch):
    import types

    patches = _runner("alone/skyrl_alone_patches", monkeypatch)

    class Old:  # vllm-router 0.1.17
        vllm_pd_disaggregation = False

    class New:
        pd_disaggregation = True

    for cls, expected in ((Old, False), (New, True)):
        patches._router_args_without_pd(types.SimpleNamespace(RouterArgs=cls))
        assert cls.pd_disaggregation is expected


def test_skyrls_cuda_calls_answer_for_the_cpu_in_a_worker_process(tmp_path):
    """In a process of its own (they change torch for the whole process, as in SkyRL's worker): tensors stay on the
    CPU, a 'cuda' device mesh is a CPU one over gloo, and the sync and memory calls answer."""
    import subprocess

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(bench.HERE / 'alone')!r})\n"
        "import skyrl_alone_patches as p\n"
        "p.cuda_calls_on_the_cpu(); p.gloo_process_group()\n"
        "import torch, torch.distributed as dist\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(29400 + os.getpid() % 500), RANK='0', WORLD_SIZE='1')\n"
        "dist.init_process_group(backend='cpu:gloo,cuda:nccl')\n"
        "mesh = init_device_mesh('cuda', (1,))\n"
        "torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.set_device(0)\n"
        "print(dist.get_backend(), mesh.device_type, torch.ones(2).cuda().device.type,\n"
        "      torch.ones(1).to(torch.cuda.current_device()).device.type, torch.cuda.memory_allocated(),\n"
        "      torch.cuda.mem_get_info()[1] > 0, torch.cuda.is_available())\n")
    out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["gloo", "cpu", "cpu", "cpu", "0", "True", "False"]
    assert "in effect: S3 cuda-calls-on-cpu" in out.stderr and "in effect: S4 gloo-process-group" in out.stderr


def test_skyrl_runner_runs_alone_on_skyrls_own_engines_and_collects_what_the_patches_did(tmp_path):
    runner = _runner("skyrl_runner")
    settings, env = runner.alone(str(tmp_path), threads=2)
    assert "generator.inference_engine.run_engines_locally=true" in settings
    assert "generator.inference_engine.weight_sync_backend=delta" in settings and "trainer.strategy=fsdp2" in settings
    # Nothing of the adapter: SkyRL's own entry point and engines, no Arctic RL setting or variable.
    assert not any(s.startswith(("trainer.arctic_rl", "trainer.override_entrypoint")) for s in settings)
    assert not any(key.startswith("ARCTIC") for key in env)
    assert env["OMP_NUM_THREADS"] == "2" and env["PYTHONPATH"].split(":")[0].endswith("alone/skyrl_site")
    # The same micro-batches in every column: SkyRL's default, set by neither.
    assert not any("_batch_size_per_gpu" in s for s in settings + runner.through_arctic("http://127.0.0.1:1"))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "infra.log").write_text("x [skyrl-alone patches] pid=7 in effect: S3 cuda-calls-on-cpu\n")
    log = "(pid=5) [skyrl-alone patches] pid=5 in effect: S1 flash-attn-import\n"
    assert runner.patches_in_effect(str(tmp_path), log) == ["S1 flash-attn-import", "S3 cuda-calls-on-cpu"]


def test_a_dtype_trains_every_column_in_it_and_generation_stays_fp32(tmp_path, monkeypatch):
    runner = _runner("skyrl_runner")
    fp32, _ = runner.alone(str(tmp_path), threads=2)
    bf16, _ = runner.alone(str(tmp_path), threads=2, dtype="bfloat16")
    assert "trainer.bf16=false" in fp32 and "param_dtype: fp32" in fp32[-1]
    assert "trainer.bf16=true" in bf16 and "param_dtype: bf16" in bf16[-1] and "reduce_dtype: fp32" in bf16[-1]
    # Alone, vLLM generates in fp32 whatever the training dtype; through Arctic RL the job's sampler does too.
    assert "generator.inference_engine.model_dtype=float32" in bf16
    # verl's FSDP engine reads its compute dtype from `mixed_precision` alone (bf16 when unset), never `dtype`.
    verl = _runner("verl_runner")
    shape = SHAPES["prompt-heavy"]
    for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        settings, _ = verl.alone(shape, str(tmp_path), threads=2, dtype=dtype)
        precision = [s for s in settings if "fsdp_config.mixed_precision=" in s]
        assert precision == [f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={{param_dtype: {short}, "
                             "reduce_dtype: fp32, buffer_dtype: fp32}"]
        assert "actor_rollout_ref.rollout.dtype=float32" in settings
        assert not any(s.startswith("actor_rollout_ref.actor.fsdp_config.dtype=") for s in settings)
    spec = bench.job(bench.FRAMEWORKS["skyrl"], "/m", True, "bfloat16")
    assert spec["engine"]["dtype"] == "bfloat16" and spec["sampler"]["dtype"] == "float32"
    assert spec["engine"]["learning_rate"] == 1e-5 and spec["sampler"]["name"] == "vllm" and spec["zorro"]["enable"]
    assert bench.FRAMEWORKS["skyrl"].job["engine"].get("dtype") is None  # the shared job is not changed
    # The runner gets the dtype; a framework whose alone column is not set up for it is reported, not run.
    seen = []
    monkeypatch.setitem(bench.FRAMEWORKS, "verl", dataclasses.replace(bench.FRAMEWORKS["verl"], dtypes=("float32",)))
    monkeypatch.setattr(bench, "environment", lambda script: sys.executable)
    monkeypatch.setattr(bench, "run_column", lambda fw, column, shape, python, model, folder, steps, overrides, dtype,
                        diagnostics, placement: seen.append((fw.name, column, dtype)) or {"error": "not run here"})
    result = bench.run(["verl", "skyrl"], ["prompt-heavy"], ["alone", "zorro-off"], rounds=1, steps=2,
                       alone_overrides=[], work=tmp_path, log=lambda *_: None, dtype="bfloat16")
    assert seen == [("skyrl", "alone", "bfloat16"), ("skyrl", "zorro-off", "bfloat16")] and result["dtype"] == "bfloat16"
    assert "float32 only" in result["frameworks"]["verl"]["dtype_not_run"]
    assert "verl in bfloat16: not run" in bench.table(result)
    with pytest.raises(SystemExit):  # a runner refuses a dtype it is not set up for
        verl.runner_parser("verl", ("alone", "arctic"), ("float32",)).parse_args(
            ["--column", "alone", "--shape", "{}", "--model", "m", "--work", "w", "--dtype", "bfloat16"])


def test_skyrls_environment_rewards_the_answers_first_digit_and_registers_once(monkeypatch):
    """The bench's SkyRL-Gym environment, against the two names it takes from SkyRL-Gym (stand-ins here: SkyRL-Gym
    is in SkyRL's environments, not this one)."""
    import types

    base = types.ModuleType("skyrl_gym.envs.base_text_env")
    base.BaseTextEnv = type("BaseTextEnv", (), {"__init__": lambda self: None})
    base.BaseTextEnvStepOutput = dict
    registration = types.ModuleType("skyrl_gym.envs.registration")
    registration.registry = {}
    envs = types.ModuleType("skyrl_gym.envs")
    envs.register = lambda id, entry_point: registration.registry.__setitem__(id, entry_point)
    for name, module in {"skyrl_gym": types.ModuleType("skyrl_gym"), "skyrl_gym.envs": envs,
                         "skyrl_gym.envs.base_text_env": base, "skyrl_gym.envs.registration": registration}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.syspath_prepend(str(bench.HERE))
    for name in ("skyrl_sql", "skyrl_sql.env"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import skyrl_sql
    from skyrl_sql.env import SqlEnv

    env = SqlEnv(extras={"reward_spec": {"method": "rule", "ground_truth": "47"}})
    assert env.step("SELECT 4 FROM t")["reward"] == 1.0 and env.step("SELECT 7 FROM t")["reward"] == 0.0
    assert env.step("x")["done"] is True
    with pytest.raises(ValueError, match="reward_spec.ground_truth"):
        SqlEnv(extras={"reward_spec": {}})
    skyrl_sql.register()
    skyrl_sql.register()
    assert registration.registry == {skyrl_sql.ENV_ID: "skyrl_sql.env:SqlEnv"}


def test_skyrl_runner_fails_a_run_whose_trainer_is_not_the_one_asked_for():
    runner = _runner("skyrl_runner")
    synchronous = [{"step": 1, "seconds": {}}, {"step": 2, "seconds": {}}]
    fully_async = [{"step": 1, "seconds": {}, "staleness": 0.0}, {"step": 2, "seconds": {}, "staleness": 1.0}]
    asked = list(bench.FRAMEWORKS["skyrl"].modes["async"])
    assert runner.trainer_mismatch(asked, fully_async) is None and runner.trainer_mismatch([], synchronous) is None
    assert "asked for SkyRL's fully async trainer" in runner.trainer_mismatch(asked, synchronous)
    assert "asked for SkyRL's synchronous trainer" in runner.trainer_mismatch([], fully_async)
    assert runner.trainer_mismatch(asked, []) is None  # a run with no steps fails as such (report)


def test_skyrls_entry_point_runs_the_fully_async_trainer_where_asked(monkeypatch):
    """SkyRL's main_base runs its synchronous trainer whatever `trainer.fully_async.enabled` says: the bench's entry
    point builds the fully async one as SkyRL's example does (SkyRL's classes stand in here)."""
    import types

    class BasePPOExp:
        def __init__(self, cfg):
            self.cfg = cfg

        def get_trainer(self, *args, **kwargs):
            return "synchronous"

    fully_async = type("FullyAsyncRayPPOTrainer", (), {"__init__": lambda self, *a, **k: None})
    modules = {"skyrl": {}, "skyrl.train": {}, "skyrl.train.entrypoints": {},
               "skyrl.train.entrypoints.main_base": {"BasePPOExp": BasePPOExp},
               "skyrl.train.fully_async_trainer": {"FullyAsyncRayPPOTrainer": fully_async}}
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.syspath_prepend(str(bench.HERE))
    monkeypatch.delitem(sys.modules, "skyrl_sql", raising=False)
    import skyrl_sql

    def cfg(enabled):
        return types.SimpleNamespace(trainer=types.SimpleNamespace(fully_async=types.SimpleNamespace(enabled=enabled)))

    assert skyrl_sql.experiment(cfg(False)).get_trainer(cfg=None) == "synchronous"
    assert isinstance(skyrl_sql.experiment(cfg(True)).get_trainer(cfg=None, tracker=None), fully_async)


def test_disaggregated_cores_give_generation_the_lower_half_and_the_trainer_the_rest():
    split = bench.core_split({3, 0, 2, 1})
    assert split == bench.CoreSplit(trainer=(2, 3), rollout=(0, 1))
    assert bench.core_split([0, 1]) == bench.CoreSplit(trainer=(1,), rollout=(0,))
    assert bench.core_split([4, 5, 6]).rollout == (4,)
    # The server's trainer computes on its own cores' count of threads; vLLM binds its worker to generation's.
    assert bench.core_split([0, 1, 2, 3]).server_env() == {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    with pytest.raises(ValueError, match="--placement disaggregated: needs 2 cores"):
        bench.core_split([0])
    shared, apart = (bench.job(bench.FRAMEWORKS["primerl"], "/m", True, "float32", p) for p in bench.PLACEMENTS)
    assert "placement" not in shared["sampler"] and apart["sampler"]["placement"] == "subprocess"  # shared: the default
    assert bench.FRAMEWORKS["primerl"].job["sampler"].get("placement") is None  # the shared job is not changed


def test_a_server_is_held_to_the_trainers_cores_and_every_process_below_it_to_generations(tmp_path):
    """A real process tree: a parent (the server) with a thread, and a child it started (vLLM's engine core)."""
    import os
    import subprocess

    cpus = sorted(os.sched_getaffinity(0))
    split = bench.core_split(cpus)
    ready = tmp_path / "ready"
    script = ("import subprocess, sys, threading, time\n"
              "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(ready)!r}, 'w').close()\n"
              "child.wait()\n")
    server = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(200):
            if ready.exists():
                break
            __import__("time").sleep(0.05)
        placed = bench.pin_server(server.pid, split)
        import psutil

        (child,) = psutil.Process(server.pid).children()
        assert len(psutil.Process(server.pid).threads()) == 2  # its own thread is held too
        assert bench.process_cores(psutil.Process(server.pid)) == list(split.trainer)
        assert bench.process_cores(child) == list(split.rollout)
        assert placed == {f"{server.pid} {psutil.Process(server.pid).name()}": list(split.trainer),
                          f"{child.pid} {child.name()}": list(split.rollout)}
    finally:
        for process in psutil.Process(server.pid).children():
            process.kill()
        server.kill()
        server.wait()


def test_a_placement_reaches_the_server_and_runner_where_the_framework_takes_it(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "environment", lambda script: sys.executable)
    monkeypatch.setattr(bench, "run_column", lambda fw, column, shape, python, model, folder, steps, overrides, dtype,
                        diagnostics, placement: seen.append((fw.name, column, placement)) or {"error": "not run here"})
    result = bench.run(["verl", "primerl"], ["prompt-heavy"], ["alone", "zorro-off", "zorro-on"], rounds=1, steps=2,
                       alone_overrides=[], work=tmp_path, log=lambda *_: None, mode="async", placement="disaggregated")
    assert seen == [("primerl", "zorro-off", "disaggregated"), ("primerl", "zorro-on", "disaggregated")]
    assert result["placement"] == "disaggregated"
    assert "shared only" in result["frameworks"]["verl"]["placement_not_run"]
    assert "verl disaggregated: not run" in bench.table(result)
    # A framework's own engines alone are not placed: its alone column is reported, not run shared unnoticed.
    monkeypatch.setitem(bench.FRAMEWORKS, "skyrl", dataclasses.replace(bench.FRAMEWORKS["skyrl"],
                                                                      placements=bench.PLACEMENTS))
    seen.clear()
    result = bench.run(["skyrl"], ["prompt-heavy"], ["alone", "zorro-on"], rounds=1, steps=2, alone_overrides=[],
                       work=tmp_path / "again", log=lambda *_: None, placement="disaggregated")
    assert seen == [("skyrl", "zorro-on", "disaggregated")]
    assert "through Arctic RL only" in result["frameworks"]["skyrl"]["column_not_run"]["alone"]


def test_the_primerl_runner_holds_its_rollout_processes_and_its_trainer_to_their_cores(tmp_path, monkeypatch):
    import os

    runner = _runner("primerl_runner")
    assert runner.cores("0,2") == {0, 2} and runner.cores(None) is None
    assert set(runner.ROLES.values()) == {"rollout", "trainer"} and runner.ROLES["orchestrator"] == "rollout"
    (rollout, *_), trainer = sorted(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    shape = json.dumps(dataclasses.asdict(SHAPES["prompt-heavy"]))
    monkeypatch.setattr(sys, "argv", ["primerl_runner", "--column", "arctic", "--shape", shape, "--model", "m",
                                      "--work", str(tmp_path), "--url", "u", "--rollout-cpus", "0"])
    with pytest.raises(SystemExit):  # one without the other is refused
        runner.main()
    # The processes it starts: here a stand-in that reports its own cores.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("env-server", "orchestrator", "arctic-rl-primerl-trainer"):
        (bin_dir / name).write_text(f"#!{sys.executable}\nimport os, time\n"
                                    f"open(os.path.join(os.getcwd(), '{name}.cpus'), 'w').write("
                                    "','.join(map(str, sorted(os.sched_getaffinity(0)))))\ntime.sleep(0.5)\n")
        (bin_dir / name).chmod(0o755)
    runner.BIN = bin_dir
    codes, _, on_cores = runner.run(tmp_path, "m", "http://127.0.0.1:1", SHAPES["prompt-heavy"], 1, 1,
                                    {"rollout": {rollout}, "trainer": {trainer}})
    assert codes == {"orchestrator": 0, "trainer": 0}
    assert (tmp_path / "orchestrator.cpus").read_text() == (tmp_path / "env-server.cpus").read_text() == str(rollout)
    assert (tmp_path / "arctic-rl-primerl-trainer.cpus").read_text() == str(trainer)
    assert on_cores == {"env": [rollout], "orchestrator": [rollout], "trainer": [trainer]}
