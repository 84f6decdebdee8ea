"""Start-up through the adapter's entry point, and checkpoints through its dispatch.

A configuration the backend would not honour fails in seconds, naming the key, before SkyRL builds
anything; checkpoints live in the server's folder, SkyRL's folder holding only which one it is.
"""

from __future__ import annotations

import json
import os

import pytest

from arctic_rl_core.attach import ArcticSetupError
from arctic_rl_core.checkpoint_handles import RECORD_FILE, server_name
from arctic_rl_core.types import Sequence
from arctic_rl_skyrl.dispatch import ArcticDispatch
from arctic_rl_skyrl.entrypoint import main
from arctic_rl_skyrl.settings import split_overrides


def overrides(server: str, model: str, *extra: str) -> list[str]:
    return ["trainer.override_entrypoint=arctic_rl_skyrl.entrypoint", f"trainer.arctic_rl.url={server}",
            "generator.inference_engine.run_engines_locally=false",
            f"generator.inference_engine.external_proxy_url={server}",
            "generator.inference_engine.enable_ray_prometheus_stats=false", "trainer.placement.colocate_all=false",
            f"trainer.policy.model.path={model}", "trainer.logger=console",
            *extra]


@pytest.mark.parametrize("extra, named", [
    (["generator.inference_engine.external_proxy_url=http://127.0.0.1:1"], "external_proxy_url"),
    (["generator.inference_engine.run_engines_locally=true"], "run_engines_locally"),
    (["generator.inference_engine.enable_ray_prometheus_stats=true"], "enable_ray_prometheus_stats"),
    (["trainer.policy.optimizer_config.weight_decay=0.0"], "optimizer_config.weight_decay"),
    (["trainer.policy.optimizer_config.max_grad_norm=0.5"], "optimizer_config.max_grad_norm"),
    (["trainer.algorithm.kl_estimator_type=abs"], "kl_estimator_type"),
])
def test_a_setting_the_backend_would_not_honour_stops_start_up_by_name(server, tiny_model, extra, named):
    with pytest.raises(ArcticSetupError, match=named):
        main(overrides(server, tiny_model, *extra))


def test_kl_needs_the_jobs_reference_model_on_skyrls_reference_weights(tiny_model, tmp_path):
    from arctic_rl_core.attach import check_reference

    key = "trainer.ref.model.path"
    with pytest.raises(ArcticSetupError, match="reference.enable"):
        check_reference(tiny_model, {"backend": {"reference": None}}, key)
    served = {"model_path": "/elsewhere", "weights_fingerprint": "0" * 64}
    with pytest.raises(ArcticSetupError, match="trainer.ref.model.path .* holds other weights"):
        check_reference(tiny_model, {"backend": {"reference": served}}, key)


def test_the_adapters_own_settings_are_checked_by_name(server, tiny_model):
    with pytest.raises(SystemExit, match="trainer.arctic_rl.tokn_env"):
        main(overrides(server, tiny_model, "trainer.arctic_rl.tokn_env=X"))
    with pytest.raises(ArcticSetupError, match="no Arctic RL server answers"):
        main(overrides("http://127.0.0.1:9", tiny_model))


def test_checkpoints_live_on_the_server_and_resume_weights_and_schedule(server, client, tiny_model, tmp_path):
    from skyrl.train.config import SkyRLTrainConfig

    _, skyrl_overrides = split_overrides(overrides(server, tiny_model, "trainer.policy.optimizer_config.num_warmup_steps=4"))
    cfg = SkyRLTrainConfig.from_cli_overrides(skyrl_overrides)
    batch = [Sequence(prompt_ids=[5, 6, 7], response_ids=[20, 21, 22])]
    client.fwd_bwd(batch, "sft")
    client.step()  # a step of the job's outside this run: SkyRL's schedule does not count it
    dispatch = ArcticDispatch(cfg, client, num_training_steps=10)
    client.fwd_bwd(batch, "sft")
    dispatch.optim_step("policy")
    saved_dir = tmp_path / "global_step_1" / "policy"
    dispatch.save_checkpoint("policy", str(saved_dir))
    saved, saved_lr = client.state_digest(), dispatch.schedules["policy"].get_last_lr()[0]
    saved_logprobs = client.log_probs(batch).logprobs
    # SkyRL's folder holds only the record; the weights are in the server's checkpoint folder.
    assert os.listdir(saved_dir) == [RECORD_FILE]
    record = json.load(open(saved_dir / RECORD_FILE))
    assert record["name"] == server_name("skyrl", str(saved_dir)) and record["name"].startswith("skyrl/")
    assert not record["server_path"].startswith(str(tmp_path)) and os.path.isdir(record["server_path"])
    for _ in range(2):
        client.fwd_bwd(batch, "sft")
        dispatch.optim_step("policy")
    assert client.state_digest() != saved
    resumed = ArcticDispatch(cfg, client, num_training_steps=10)
    resumed.load_checkpoint("policy", str(saved_dir))
    assert client.state_digest() == saved
    assert resumed.schedules["policy"].get_last_lr()[0] == saved_lr  # the warm-up continues where it was
    with pytest.raises(ArcticSetupError, match=RECORD_FILE):
        resumed.load_checkpoint("policy", str(tmp_path))
    # Without the optimizer and schedule states: the weights, a fresh optimizer, the schedule from its start
    restarted = ArcticDispatch(cfg, client, num_training_steps=10)
    restarted.load_checkpoint("policy", str(saved_dir), load_optimizer_states=False, load_lr_scheduler_states=False)
    assert client.log_probs(batch).logprobs == saved_logprobs and client.state_digest() != saved
    assert restarted.schedules["policy"].get_last_lr()[0] == ArcticDispatch(cfg, client, num_training_steps=10
                                                                             ).schedules["policy"].get_last_lr()[0]


def test_the_critics_checkpoint_resumes_the_job_and_the_critics_schedule(server, client, tiny_model, tmp_path):
    from skyrl.train.config import SkyRLTrainConfig

    _, skyrl_overrides = split_overrides(overrides(server, tiny_model, f"trainer.critic.model.path={tiny_model}",
                                                   "trainer.critic.optimizer_config.num_warmup_steps=4"))
    cfg = SkyRLTrainConfig.from_cli_overrides(skyrl_overrides)
    batch = [Sequence(prompt_ids=[5, 6, 7], response_ids=[20, 21, 22], returns=[0.5, -0.5, 1.0], old_values=[0.0] * 3)]
    dispatch = ArcticDispatch(cfg, client, num_training_steps=10, critic_training_steps=10)

    def critic_step(on):
        client.fwd_bwd(batch, "value", model="critic")
        on.optim_step("critic")

    critic_step(dispatch)
    saved_dir = tmp_path / "global_step_1" / "critic"
    dispatch.save_checkpoint("critic", str(saved_dir))
    critic_step(dispatch)
    continued = client.state_digest(), client.status()["backend"]["critic"]["learning_rate"]
    critic_step(dispatch)  # wander off, then resume in a fresh dispatch (a restarted SkyRL)
    resumed = ArcticDispatch(cfg, client, num_training_steps=10, critic_training_steps=10)
    resumed.load_checkpoint("critic", str(saved_dir))
    critic_step(resumed)
    assert (client.state_digest(), client.status()["backend"]["critic"]["learning_rate"]) == continued
    assert 0 < continued[1] < cfg.trainer.critic.optimizer_config.lr  # mid warm-up: the critic's schedule resumed


def test_the_experiments_prompt_data_sets_filter_in_the_processes_their_prompts_pay_for(server, tiny_model, tmp_path,
                                                                                         monkeypatch):
    """SkyRL's main_base builds each prompt data set with 8 filtering processes, each a new interpreter (75 CPU s
    on a 2-core machine) whatever the data: the adapter's experiment asks at most the driver's cores and one per
    50,000 prompts counted in local files, and leaves main_base as it was."""
    import pandas as pd
    import skyrl.train.entrypoints.main_base as main_base
    from skyrl.train.config import SkyRLTrainConfig

    from arctic_rl_skyrl.trainer import ArcticPPOExp, filter_processes

    data = str(tmp_path / "prompts.parquet")
    pd.DataFrame([{"data_source": "arctic_toy", "prompt": [{"role": "user", "content": f"what is {i} plus 3?"}],
                   "env_class": "gsm8k", "reward_spec": {"method": "rule", "ground_truth": str(i + 3)},
                   "extra_info": {"split": "train"}} for i in range(4)]).to_parquet(data)
    _, skyrl_overrides = split_overrides(overrides(server, tiny_model, f"data.train_data=['{data}']",
                                                   f"data.val_data=['{data}']", "trainer.eval_interval=1",
                                                   "trainer.train_batch_size=2"))
    cfg = SkyRLTrainConfig.from_cli_overrides(skyrl_overrides)
    built = main_base.PromptDataset
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))  # an 8-core driver, four prompts
    experiment = ArcticPPOExp(cfg, client=None)
    assert experiment.train_dataset.num_workers == experiment.eval_dataset.num_workers == 1
    assert len(experiment.train_dataset) == 4
    assert main_base.PromptDataset is built

    # 150,000 prompts in a Parquet file (counted from its footer): three processes on 8 cores; one more prompt in
    # JSON lines: four. A Hub data set, of a size unknown until read: the driver's cores, SkyRL's 8 at most.
    many = str(tmp_path / "many.parquet")
    pd.DataFrame({"prompt": ["x"] * 150_000}).to_parquet(many)
    (tmp_path / "one.jsonl").write_text('{"prompt": "x"}\n\n')
    assert filter_processes(many, 8) == 3 and filter_processes([many, str(tmp_path / "one.jsonl")], 8) == 4
    assert filter_processes(many, 2) == 2 and filter_processes("openai/gsm8k", 16) == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert filter_processes(many, 8) == 2 and filter_processes("openai/gsm8k", 8) == 2
