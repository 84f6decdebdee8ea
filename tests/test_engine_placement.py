"""Where vLLM's engine core runs by default (`sampler.placement: auto`), and the placements refused at start-up,
naming the setting, before anything starts."""

import json
import os
import subprocess
import sys

import httpx
import pytest

from arctic_rl_core.config import BackendConfig
from arctic_rl_core.engines.distributed import free_loopback_port
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_core.samplers import engine_placement
from arctic_rl_core.samplers.engine_placement import MULTIPROCESSING_ENV, resolved
from arctic_rl_core.server.app import ServerSettings
from arctic_rl_core.server.run import ServerThread


def _job(tiny_model, **sampler) -> BackendConfig:
    return BackendConfig(model_path=tiny_model, sampler={"name": "vllm", **sampler})


@pytest.fixture
def cores():
    if engine_placement.usable_cores() < engine_placement.MIN_CORES:
        pytest.fail(f"this test needs {engine_placement.MIN_CORES} cores; this process may use "
                    f"{engine_placement.usable_cores()}")


def test_auto_is_an_engine_core_of_its_own_under_a_server_and_in_process_in_a_script(tiny_model, cores, monkeypatch):
    monkeypatch.delenv(MULTIPROCESSING_ENV, raising=False)
    job = _job(tiny_model)
    assert job.sampler.placement == "auto"
    assert resolved(job, served=True).sampler.placement == "subprocess"
    assert resolved(job, served=False).sampler.placement == "in_process"
    # A pool's replicas each run in a Ray actor of their own; the transformers sampler has no engine core.
    assert resolved(_job(tiny_model, replicas=2), served=True).sampler.placement == "in_process"
    light = BackendConfig(model_path=tiny_model, sampler={"name": "transformers"})
    assert resolved(light, served=True).sampler.placement == "in_process"
    # What is asked stays as asked.
    for asked in ("in_process", "subprocess"):
        for served in (True, False):
            assert resolved(_job(tiny_model, placement=asked), served).sampler.placement == asked
    # Where vLLM's engine core cannot have a process of its own, auto keeps it in this one.
    monkeypatch.setenv(MULTIPROCESSING_ENV, "0")
    assert resolved(job, served=True).sampler.placement == "in_process"


def test_a_subprocess_that_vllms_environment_forbids_is_refused_naming_the_setting(tiny_model, monkeypatch):
    monkeypatch.setenv(MULTIPROCESSING_ENV, "0")
    with pytest.raises(InvalidRequest) as refused:
        resolved(_job(tiny_model, placement="subprocess"), served=True)
    assert refused.value.field == "sampler.placement" and MULTIPROCESSING_ENV in refused.value.message
    # Through a server: the job is refused by field before anything loads, and the server has no job.
    with ServerThread(ServerSettings(port=free_loopback_port())) as url:
        response = httpx.post(f"{url}/v1/initialize", json=_job(tiny_model, placement="subprocess").model_dump(),
                              timeout=60)
        assert response.status_code == 400 and response.json()["error"]["field"] == "sampler.placement"
        assert httpx.get(f"{url}/v1/status", timeout=60).json()["initialized"] is False


def test_a_subprocess_on_one_core_is_refused_at_start_up_and_the_server_never_comes_up(tiny_model, tmp_path):
    (tmp_path / "job.json").write_text(json.dumps(_job(tiny_model, placement="subprocess").model_dump()))
    port = free_loopback_port()
    one_core = min(os.sched_getaffinity(0))
    # `arctic-rl serve` as a user starts it, on one core of this machine.
    command = [sys.executable, "-c", f"import os, sys; os.sched_setaffinity(0, {{{one_core}}}); "
               "from arctic_rl_core.cli import main; sys.exit(main(sys.argv[1:]))",
               "serve", "--port", str(port), "--config", str(tmp_path / "job.json"),
               "--checkpoint-dir", str(tmp_path / "checkpoints")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "sampler.placement" in done.stderr and "may run on 1:" in done.stderr, done.stderr[-2000:]
    with pytest.raises(httpx.ConnectError):  # nothing listens: the server never came up
        httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=5)


def test_the_worker_inside_a_core_of_its_own_leaves_cores_to_the_server_as_vllms_own_worker_does():
    """vLLM's CPU worker process computes on all cores but `VLLM_CPU_NUM_OF_RESERVED_CPU` (one by default), on the
    cores `VLLM_CPU_OMP_THREADS_BIND` lists, or as it is with `nobind`; the worker inside our engine core the same."""
    from arctic_rl_core.samplers.vllm_core_executor import worker_cores

    assert [worker_cores(cores, {}) for cores in (1, 2, 16)] == [(1, None), (1, None), (15, None)]
    assert worker_cores(16, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "4"}) == (12, None)
    assert worker_cores(16, {"VLLM_CPU_OMP_THREADS_BIND": "2-4,7|8-15"}) == (4, [2, 3, 4, 7])
    assert worker_cores(16, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) is None
