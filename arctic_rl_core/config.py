"""Backend configuration: which model, which engine and sampler, and their settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationError, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from arctic_rl_core.types import MAX_LEARNING_RATE

Dtype = Literal["float32", "bfloat16", "float16"]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LoraSettings(_Config):
    r: int = Field(8, ge=1)
    alpha: float = 16.0
    dropout: float = Field(0.0, ge=0, le=0)
    """0 only: the trainer runs the model's inference forward, so its log-probs are the sampler's."""
    target_modules: list[str] | str = "all-linear"


class EngineConfig(_Config):
    name: str = "deepspeed"
    zero_stage: int = Field(2, ge=0, le=3)
    dtype: Dtype = "float32"
    learning_rate: float = Field(1e-5, gt=0, le=MAX_LEARNING_RATE)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)
    micro_batch_tokens: int = Field(8192, ge=1)
    """Token budget of one micro-batch (padded tokens)."""
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    """The model's own attention, used where ZoRRo's cannot serve its family (docs/models.md)."""
    lora: LoraSettings | None = None
    """Train LoRA adapters (peft) instead of all parameters."""
    ds_config: dict[str, Any] = Field(default_factory=dict)
    """Merged over the generated DeepSpeed config (e.g. an `optimizer` block to use DeepSpeed's own)."""
    seed: int = 0
    ranks: int = Field(1, ge=1)
    """Trainer ranks. 1: the engine runs in the backend's process (no Ray). N > 1: N Ray actors forming
    one torch.distributed world (NCCL on GPUs, gloo on CPU) under this DeepSpeed config (docs/placement.md)."""
    weight_bucket_mb: int = Field(256, ge=1)
    """With ranks > 1, weights leave rank 0 for the sampler in buckets of about this size (ZeRO-3: gathered
    one bucket at a time, never the whole model at once)."""

    @field_validator("lora")
    @classmethod
    def _lora_below_zero3(cls, lora, info: ValidationInfo):
        if lora is not None and info.data.get("zero_stage") == 3:
            raise ValueError("LoRA is supported with zero_stage 0-2 (adapters are merged for sync)")
        return lora


class NodeSelection(_Config):
    """Which nodes of a Ray cluster may hold one role's actors (trainer ranks or sampler replicas), by Ray's own
    means: each of the role's placement-group bundles asks for `resources` and carries `labels` as its label
    selector. Nodes get both from `ray start --resources '{"trainer_node": 8}' --labels role=trainer` (or a
    KubeRay group's `rayStartParams`)."""

    resources: dict[str, float] = Field(default_factory=dict)
    """Custom resources each bundle asks for, beside its CPU and devices."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Node labels each bundle's node must carry, each with exactly this value."""

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r} is set by the job itself (one CPU and the role's devices per bundle)")
            if amount <= 0:
                raise ValueError(f"{name!r}: the amount must be positive, not {amount}")
        return resources

    @field_validator("labels")
    @classmethod
    def _exact_values(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if value.startswith("!") or value.startswith("in(") or not value:
                raise ValueError(f"{key!r}: {value!r}: a label takes one exact value (no Ray selector operators)")
        return labels


class RaySettings(_Config):
    """Where the Ray actors of a distributed job run (used with engine.ranks > 1 or sampler.replicas > 1)."""

    address: str | None = None
    """An existing cluster to join (`ray://...`, `auto`, host:port); default: a local Ray started and stopped with the job."""
    trainer_nodes: NodeSelection = Field(default_factory=NodeSelection)
    """The nodes the trainer ranks may run on (default: any)."""
    sampler_nodes: NodeSelection = Field(default_factory=NodeSelection)
    """The nodes the sampler replicas may run on (default: any). With `placement: colocated` rank i and replica i
    share a bundle, which then asks for both roles' resources and labels."""
    num_cpus: int | None = Field(None, ge=1)
    """Logical CPUs of a local Ray (default: this machine's cores)."""
    start_timeout_s: float = Field(120.0, gt=0)
    """How long the actors may take to be placed and to start before the job fails to initialise."""
    call_timeout_s: float = Field(3600.0, gt=0)
    """How long one call may wait for a trainer rank; a rank that does not answer (hung in a collective, or
    stopped) fails the call and the group, as a rank that died does."""


class ZorroConfig(_Config):
    """Zero Redundancy Rollouts: compute each shared prefix once in fwd_bwd and log_probs."""

    enable: bool = True
    min_shared_tokens: int = Field(1, ge=1)
    """Shorter common prefixes are not shared."""
    inference: bool = False
    """Generation's half: vLLM decodes with forest cascade attention, reading a shared prefix's KV cache once per
    step for all the samples that share it (docs/zorro.md). vLLM sampler only; Triton kernels, so CUDA (on a
    CPU only under TRITON_INTERPRET=1, as a correctness check)."""
    attention_backend: Literal["auto", "cpu_flash", "cuda_flash", "math", "triton"] = "auto"
    """Split attention's kernels (docs/zorro.md): `auto` runs the fastest measured on this device model and dtype
    (`arctic-rl bench attention --save`); unmeasured, `triton` (the fused forest kernel) on CUDA and `cpu_flash`
    on CPU."""


class ReferenceConfig(_Config):
    """A frozen reference policy for KL terms: `log_probs(..., source="reference")`."""

    enable: bool = False
    model_path: str | None = None
    """Defaults to the job's `model_path`: the policy's initial weights."""
    dtype: Dtype | None = None
    """Defaults to the engine's dtype."""
    offload: bool = False
    """Park the weights in pinned host memory between calls and copy them to the device for each call: the
    device memory they take is the trainer's while the policy trains, for one host-to-device copy per call.
    (On a CPU-only machine they live in host memory anyway.)"""
    router_replay: bool = False
    """With the job's `router_replay`: the reference's forwards replay each sequence's `routed_experts` too. Off,
    it routes by its own router (verl replays the policy only)."""


class CriticConfig(_Config):
    """A trainable critic for value-based advantages (PPO with GAE): the causal LM's decoder with a linear value
    head on its last hidden state, trained by `fwd_bwd(..., model="critic")` with its own optimizer."""

    enable: bool = False
    model_path: str | None = None
    """The decoder's weights; defaults to the job's `model_path`. The value head starts at zero."""
    engine: dict[str, Any] = Field(default_factory=dict)
    """The critic's engine settings over the job's `engine` (e.g. its own `learning_rate`, `zero_stage`)."""

    def engine_config(self, policy: EngineConfig) -> EngineConfig:
        try:
            merged = EngineConfig.model_validate({**policy.model_dump(), **self.engine})
        except ValidationError as err:
            first = err.errors()[0]
            raise ValueError(f"critic.engine.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        if merged.lora is not None or merged.ranks > 1:
            raise ValueError("critic.engine: the critic trains all its parameters in the backend's process "
                             "(no lora, ranks 1)")
        return merged


ROPE_CONFIG_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings")
"""Model config keys that set positions: the job's `rope_scaling` sets them, for every engine at once."""


class SamplerConfig(_Config):
    name: str = "vllm"
    """`vllm`; or `transformers` (HF generate on a copy of the weights: light, slow, no prefix caching)."""
    replicas: int = Field(1, ge=1)
    """Sampler replicas. 1: the sampler of `placement`. M > 1: M Ray actors, each a sampler of this config
    (with `engine_args.tensor_parallel_size` devices each on GPUs); generate and sampler log-probs are spread
    across them, and a replica that dies is replaced (docs/placement.md)."""
    dtype: Dtype | None = None
    """Defaults to the engine's dtype."""
    placement: Literal["auto", "in_process", "subprocess"] = "auto"
    """Where vLLM's engine core runs. `in_process`: on a thread of this process, beside the trainer (the fastest weight
    sync). `subprocess`: in a process of its own, as `vllm serve` runs it, so a server's HTTP layer and the engine's
    loop do not take turns on one interpreter lock. `auto`: `subprocess` under `arctic-rl serve` (with 2 or more cores;
    on GPUs with `sync: broadcast`), else `in_process`, as for an `InProcessBackend` in a script (docs/sampler.md).
    Each replica of a pool runs its engine in its own Ray actor."""
    sync: Literal["shared_memory", "broadcast", "file"] = "shared_memory"
    """How `sync_weights` moves weights. `shared_memory`: in process, the trainer's tensors are handed over;
    to a vLLM subprocess on a CPU host, buckets go through two shared-memory slots; to replicas, buckets go
    through Ray's object store. `broadcast`: a bucketed torch.distributed broadcast (gloo on CPU, NCCL on GPU)
    to an engine in another process or machine, or from trainer rank 0 to every replica. `file`: safetensors
    files (one sampler only)."""
    sync_dir: str | None = None
    """Where the file path writes (default: a temporary directory)."""
    sync_host: str = "127.0.0.1"
    """Address the vLLM worker uses to reach the trainer for the broadcast path."""
    bucket_mb: float = Field(64, gt=0)
    cpu_weight_layout: Literal["packed", "plain"] = "packed"
    """vLLM-CPU only. Both keep the linear weights as loaded, where a sync writes them in place. `packed` multiplies
    with vLLM's own oneDNN packs of them (its default kernels: at vLLM's decoding speed), rebuilt after each sync;
    `plain` with F.linear on them (a faster sync, half the weights' memory, slower small-batch decoding).
    docs/sampler.md compares both."""
    max_model_len: int | None = None
    """Defaults to the model's context."""
    kv_cache_mb: int = Field(512, ge=16)
    """KV cache size on CPU (vLLM's CPU backend reserves host memory)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    capture_tokens: int = Field(64 * 2**20, ge=1)
    """Tokens of captured episodes (generate calls with a session) kept until collected; past it the least
    recently used episodes are evicted. A turn's routing record (router replay) counts one token per expert id."""
    sleep_during_training: bool = False
    """Release the KV cache (vLLM sleep mode) during fwd_bwd and step; for colocated GPUs, not with pipelining.
    vLLM's CPU build ignores it."""
    adapters: int = Field(0, ge=0)
    """LoRA adapters (of ranks up to the engine's) the sampler serves at once on its base model (vLLM's multi-LoRA,
    `max_loras`): Tinker tenants' saved weights, each request with its own (`SamplingParams.adapter`). 0: none.
    Needs `engine.lora`; a pool of replicas serves each adapter on every replica."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Passed to vLLM's LLM(...) as is."""

    @field_validator("engine_args")
    @classmethod
    def _positions_for_every_engine(cls, engine_args):
        overrides = engine_args.get("hf_overrides", {})
        if not isinstance(overrides, dict):
            raise ValueError("hf_overrides: a mapping of model config keys")
        for key in ROPE_CONFIG_KEYS:
            if key in overrides:
                raise ValueError(f"hf_overrides.{key} would change positions in vLLM alone; set the job's "
                                 "rope_scaling, which every engine applies")
        return engine_args

    @field_validator("sync")
    @classmethod
    def _pool_sync(cls, sync, info: ValidationInfo):
        if sync == "file" and info.data.get("replicas", 1) > 1:
            raise ValueError("replicas sync by shared_memory (Ray's object store) or broadcast, not file")
        return sync


class RopeScaling(_Config):
    """RoPE scaling applied to the model in every engine of the job (trainer, reference, critic, samplers):
    `{rope_type: yarn, factor: 4, original_max_position_embeddings: 32768}` extends a 32K model to 128K."""

    rope_type: Literal["yarn", "linear", "llama3", "dynamic"]
    factor: float = Field(gt=1)
    original_max_position_embeddings: int | None = Field(None, ge=1)
    """The window the model was trained at (yarn, llama3); defaults to the checkpoint's max_position_embeddings.
    The extended window is factor times it."""
    beta_fast: float | None = Field(None, gt=0)
    """yarn: its ramp's bounds (default 32 and 1)."""
    beta_slow: float | None = Field(None, gt=0)
    attention_factor: float | None = Field(None, gt=0)
    """yarn: the cos/sin scale; default 0.1 ln(factor) + 1."""
    low_freq_factor: float | None = Field(None, gt=0)
    """llama3: required, as is high_freq_factor."""
    high_freq_factor: float | None = Field(None, gt=0)

    @field_validator("rope_type")
    @classmethod
    def _same_in_every_engine(cls, rope_type):
        if rope_type == "dynamic":
            raise ValueError("dynamic is refused: Hugging Face recomputes its frequencies from each sequence's "
                             "length and vLLM fixes them at the extended window, so the sampler's log-probs would "
                             "not be the trainer's; use yarn")
        return rope_type

    @model_validator(mode="after")
    def _fields_of_its_type(self):
        given = {name for name in _TYPE_FIELDS["yarn"] | _TYPE_FIELDS["llama3"] if getattr(self, name) is not None}
        if given - _TYPE_FIELDS[self.rope_type]:
            raise ValueError(f"{', '.join(sorted(given - _TYPE_FIELDS[self.rope_type]))}: not a setting of "
                             f"{self.rope_type} scaling")
        if self.rope_type == "llama3" and not {"low_freq_factor", "high_freq_factor"} <= given:
            raise ValueError("low_freq_factor, high_freq_factor: llama3 scaling needs both")
        return self


_TYPE_FIELDS = {"yarn": {"original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"},
                "llama3": {"original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
                "linear": set()}


class BackendConfig(_Config):
    model_path: str
    rope_scaling: RopeScaling | None = None
    """RoPE scaling (YaRN, linear, llama3) applied identically by the trainer, the reference and critic models
    and the samplers (docs/models.md)."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """With engine.ranks > 1 and sampler.replicas > 1: `colocated` puts trainer rank i and sampler replica i
    on the same device (half of one placement-group bundle each); `disaggregated` gives each its own devices,
    so generation can overlap training (docs/placement.md)."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    zorro: ZorroConfig = Field(default_factory=ZorroConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    ray: RaySettings = Field(default_factory=RaySettings)
    router_replay: Literal["off", "R3", "R2"] = "off"
    """Mixture-of-experts router replay (docs/losses.md): every trainer forward over a sequence that carries
    `routed_experts` routes its tokens to those experts, and trainer log-probs return the routing they used. `R3`:
    the sampler records each completion's routing too. `R2`: the first log-prob pass records, the updates replay.
    A family whose routing cannot be replayed is refused at load; a dense model ignores the setting."""

    @field_validator("zorro")
    @classmethod
    def _cascade_in_vllm(cls, zorro: ZorroConfig, info: ValidationInfo):
        sampler = info.data.get("sampler")
        if zorro.inference and sampler is not None and sampler.name != "vllm":
            raise ValueError(f"zorro.inference is forest cascade attention inside vLLM; sampler.name is {sampler.name!r}")
        if zorro.inference and sampler is not None and sampler.adapters:
            raise ValueError("zorro.inference's cascade is not verified with LoRA adapters (sampler.adapters)")
        return zorro

    @field_validator("sampler")
    @classmethod
    def _adapters_of_a_lora_job(cls, sampler: SamplerConfig, info: ValidationInfo):
        engine = info.data.get("engine")
        if sampler.adapters and engine is not None and engine.lora is None:
            raise ValueError("adapters: the sampler serves the trainer's LoRA adapters; set engine.lora")
        dtype = sampler.dtype or (engine.dtype if engine is not None else "float32")
        if sampler.adapters and sampler.name == "transformers" and dtype != "float32":
            raise ValueError("adapters: the transformers sampler merges an adapter into the weights for a call, "
                             f"exact in float32 only (its dtype is {dtype}); use vLLM's")
        return sampler

    @field_validator("ray")
    @classmethod
    def _colocated_bundles_on_one_node(cls, ray: RaySettings, info: ValidationInfo):
        if info.data.get("placement") == "colocated":
            clash = sorted(k for k, v in ray.sampler_nodes.labels.items() if ray.trainer_nodes.labels.get(k, v) != v)
            if clash:
                raise ValueError(f"sampler_nodes.labels {clash} differ from trainer_nodes.labels: with placement: "
                                 "colocated a rank and a replica share one bundle, on one node")
        return ray

    @field_validator("critic")
    @classmethod
    def _critic_beside_one_rank(cls, critic: CriticConfig, info: ValidationInfo):
        engine = info.data.get("engine")
        if critic.enable and engine is not None:
            if engine.ranks > 1:
                raise ValueError("a critic runs beside a one-rank policy engine (engine.ranks 1)")
            critic.engine_config(engine)
        return critic
