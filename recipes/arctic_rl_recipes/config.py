"""Recipe configuration: one YAML file plus `key=value` overrides, checked in full before anything loads."""

from __future__ import annotations

import os
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from arctic_rl_core.config import EngineConfig, RaySettings, RopeScaling, SamplerConfig, ZorroConfig
from arctic_rl_core.errors import InvalidRequest, field_path
from arctic_rl_recipes.multihop.task import MultihopConfig
from arctic_rl_recipes.text2sql.task import Text2SQLConfig
from arctic_rl_core.types import LossSpec


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TinyModelSpec(_Section):
    """Build a random-initialised model of this shape, with a tokenizer trained on the task's training texts."""

    family: str = "qwen3"
    layers: int = Field(2, ge=1)
    hidden: int = Field(128, ge=32)
    heads: int = Field(4, ge=1)
    kv_heads: int = Field(1, ge=1)
    vocab_size: int = Field(1024, ge=300)
    max_positions: int = Field(2048, ge=64)
    seed: int = 0


class ModelSection(_Section):
    path: str
    """A Hugging Face model folder (seen by the backend and, for its tokenizer, by the driver)."""
    tiny: TinyModelSpec | None = None
    """If `path` does not exist yet, build a tiny model there first."""
    rope_scaling: RopeScaling | None = None
    """RoPE scaling for every engine of the run (the backend job's `rope_scaling`): YaRN for long contexts."""


class BackendSection(_Section):
    url: str | None = None
    """A running `arctic-rl serve`; default: an embedded backend in this process."""
    token: str | None = None
    """Bearer token for `url` (or $ARCTIC_RL_TOKEN)."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    zorro: ZorroConfig = Field(default_factory=ZorroConfig)
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """With engine.ranks > 1 and sampler.replicas > 1 (docs/placement.md)."""
    ray: RaySettings = Field(default_factory=RaySettings)


class DataSection(_Section):
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Drop (and count) examples whose prompt is longer; default: the sampler's context minus max_tokens."""


class SFTSection(_Section):
    steps: int = Field(0, ge=0)
    """Warm-up steps on the reference responses (`sft` loss) before GRPO."""
    batch_size: int = Field(32, ge=1)
    learning_rate: float | None = Field(None, gt=0)
    """Default: the engine's learning rate."""
    examples: int | None = Field(None, ge=1)
    """SFT on the first this many training examples and run GRPO on the others (default: both on all)."""


class GRPOSection(_Section):
    steps: int = Field(100, ge=0)
    prompts_per_step: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    learning_rate: float | None = Field(None, gt=0)
    loss: LossSpec = Field(default_factory=lambda: LossSpec(name="grpo", config={"eps_clip": 0.2, "eps_clip_higher": 0.28}))
    skip_uniform_groups: bool = True
    """Groups whose samples all got the same reward have zero advantage: leave them out of fwd_bwd."""
    normalize_std: bool = True
    """Divide advantages by the group's reward standard deviation (GRPO); false: mean-centred only (Dr. GRPO)."""


class PipelineSection(_Section):
    max_staleness: int = Field(0, ge=0)
    """0: synchronous. k >= 1: generation for the next k steps overlaps training (see `RolloutPipeline`)."""


class RewardSection(_Section):
    workers: int = Field(2, ge=1)
    timeout_s: float = Field(10.0, gt=0)
    """Hard limit per scored response (the worker is killed and the response scores 0)."""


class EvalSection(_Section):
    every: int = Field(10, ge=0)
    """Evaluate on the held-out split every this many GRPO steps (0: only before and after); greedy decoding."""
    max_examples: int | None = Field(256, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    """Default: grpo.max_tokens."""


class CheckpointSection(_Section):
    every: int = Field(0, ge=0)
    """Save every this many GRPO steps (0: never)."""
    keep_last: int = Field(2, ge=1)


class RecipeConfig(_Section):
    task: Union[Text2SQLConfig, MultihopConfig] = Field(discriminator="name")
    model: ModelSection
    backend: BackendSection = Field(default_factory=BackendSection)
    data: DataSection = Field(default_factory=DataSection)
    sft: SFTSection = Field(default_factory=SFTSection)
    grpo: GRPOSection = Field(default_factory=GRPOSection)
    pipeline: PipelineSection = Field(default_factory=PipelineSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    output_dir: str = "runs/recipe"
    seed: int = 0
    resume: str | None = None
    """A checkpoint folder to continue from, or `auto` for the newest one under output_dir."""
    progress: bool = True
    """Show a progress bar."""


def apply_override(tree: dict, override: str) -> None:
    """Apply one VeRL/Hydra-style `a.b.c=value` (or `+a.b.c=value`); the value is read as YAML."""
    key, sep, raw = override.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key or any(not part for part in key.split(".")):
        raise InvalidRequest("overrides", f"{override!r} is not of the form key.path=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise InvalidRequest(key, f"value {raw!r} is not valid YAML: {err}") from None
    node = tree
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise InvalidRequest(".".join(parts[: i + 1]), f"is a {type(child).__name__}, cannot set {key} under it")
        node = child
    node[parts[-1]] = value


BUNDLED_DIR = os.path.join(os.path.dirname(__file__), "configs")


def bundled_recipes() -> list[str]:
    return sorted(name.removesuffix(".yaml") for name in os.listdir(BUNDLED_DIR) if name.endswith(".yaml"))


def resolve_recipe(path: str) -> str:
    """A recipe file path, or the name of a bundled recipe (`text2sql_tiny`, `multihop_tiny`)."""
    if os.path.isfile(path):
        return path
    bundled = os.path.join(BUNDLED_DIR, f"{path}.yaml")
    if os.path.isfile(bundled):
        return bundled
    raise InvalidRequest("recipe", f"file not found: {path} (bundled recipes: {', '.join(bundled_recipes())})")


def load_recipe(path: str, overrides: list[str] = ()) -> RecipeConfig:
    """Read and check a recipe; every error names the file, key or override at fault."""
    path = resolve_recipe(path)
    with open(path) as f:
        try:
            tree = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise InvalidRequest("recipe", f"{path} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise InvalidRequest("recipe", f"{path} must hold a mapping of sections (task, model, grpo, ...)")
    overridden = {}
    for override in overrides:
        apply_override(tree, override)
        overridden[override.partition("=")[0].strip().lstrip("+")] = override
    return parse_recipe(tree, overridden)


def parse_recipe(tree: dict[str, Any], overridden: dict[str, str] | None = None) -> RecipeConfig:
    try:
        return RecipeConfig.model_validate(tree)
    except ValidationError as err:
        first = err.errors()[0]
        loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p in ("text2sql", "multihop_qa")))
        field = field_path("", loc)
        message = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
        source = (overridden or {}).get(field)
        if source:
            message += f" (from override {source!r})"
        raise InvalidRequest(field, message) from None
