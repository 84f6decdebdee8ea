import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
        return InProcessBackend({"model_path": model_path or tiny_model, "engine": engine, "zorro": {"enable": zorro}})

    return make
