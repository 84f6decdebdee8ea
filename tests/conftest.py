import os

import pytest
from hypothesis import settings

from tests import preimported

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray starts its workers at nice 15, below every other process of the machine: the Ray scenarios' ranks and
# replicas would wait behind the other test worker and CI's environment builds (.ci/run), and the suite's longest
# group (one Ray cluster at a time, on one worker) would run last.
os.environ.setdefault("RAY_worker_niceness", "0")
# Without a GPU the Triton kernels' parity tests run under Triton's interpreter, which reads this when a kernel
# is defined and when it runs. (vLLM's CPU build does not use this Triton, which has no CPU backend.)
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite runs the same examples every time (main stays green); explore with
# HYPOTHESIS_PROFILE=explore to search fresh inputs.
settings.register_profile("suite", derandomize=True, max_examples=300)
settings.register_profile("explore", max_examples=5000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


def pytest_configure(config):
    if not hasattr(config, "workerinput") and not os.environ.get(preimported.RUN):  # the run's first process
        preimported.share_within_run()
        config.add_cleanup(preimported.end_run)


# Tests that are about the training API, not the sampler, use the light transformers sampler: many
# backends live in this one process, and an in-process vLLM engine is one per process
# (tests/test_vllm_sampler.py runs vLLM in its own interpreters).
LIGHT_SAMPLER = {"name": "transformers"}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random models of each family, built once per session."""
    from arctic_rl_core.models.tiny import FAMILIES, make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {family: make_tiny_model(family, str(root / family), max_positions=256) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_model(tiny_models):
    return tiny_models["qwen3"]


@pytest.fixture
def make_backend(tiny_model):
    from arctic_rl_core.backend import InProcessBackend

    def make(model_path=None, zorro=True, **engine):
        engine.setdefault("learning_rate", 1e-3)
        return InProcessBackend({"model_path": model_path or tiny_model, "engine": engine, "zorro": {"enable": zorro},
                                 "sampler": LIGHT_SAMPLER})

    return make


@pytest.fixture(params=["inprocess", "http"])
def make_api(request, tiny_model, tmp_path):
    """The training API in process, or through a loopback server wrapping the same backend."""
    from arctic_rl_core.backend import InProcessBackend
    from arctic_rl_core.client import ArcticRLClient
    from arctic_rl_core.config import BackendConfig
    from arctic_rl_core.engines.distributed import free_loopback_port
    from arctic_rl_core.server.app import ServerSettings
    from arctic_rl_core.server.run import ServerThread

    servers = []

    def make(zorro=True, reference=None, critic=None, **engine):
        engine.setdefault("learning_rate", 1e-3)
        config = BackendConfig.model_validate({"model_path": tiny_model, "engine": engine, "zorro": {"enable": zorro},
                                               "sampler": LIGHT_SAMPLER, "reference": reference or {},
                                               "critic": critic or {}})
        if request.param == "inprocess":
            return InProcessBackend(config)
        server = ServerThread(ServerSettings(port=free_loopback_port(), checkpoint_dir=str(tmp_path)), config)
        url = server.__enter__()
        servers.append(server)
        return ArcticRLClient(url, retries=0)

    yield make
    for server in servers:
        server.__exit__(None, None, None)

