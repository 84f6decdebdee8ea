"""The training engine: any Hugging Face causal LM under DeepSpeed ZeRO (stage 0-3).

Gradient accumulation across micro-batches *and* across `fwd_bwd` calls:
every backward runs with DeepSpeed's accumulation boundary off; `step` sets
the boundary, reduces gradients once and steps. With ZeRO-1/2 a boundary per
`fwd_bwd` call would make the second call overwrite the first one's
gradients, so the boundary belongs to `step` alone. ZeRO-2 runs with
`contiguous_gradients` off because its contiguous bucket cannot be flushed
empty at that boundary (DeepSpeed 0.19 raises IndexError).
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from arctic_rl_core.batching import MicroBatch
from arctic_rl_core.config import BackendConfig, EngineConfig
from arctic_rl_core.engines.base import TrainingEngine
from arctic_rl_core.engines.checkpoint_files import SafeCheckpointEngine, preflight
from arctic_rl_core.engines.response_logits import ResponseLogits, inputs_on_device, response_outputs
from arctic_rl_core.engines.distributed import init_distributed
from arctic_rl_core.errors import ArcticRLError, InvalidRequest
from arctic_rl_core.losses.registry import Registered
from arctic_rl_core.models.determinism import inference_behaviour
from arctic_rl_core.models.exactness import check_exactness, check_features, zorro_attention_possible
from arctic_rl_core.models.router_replay import load_router_replay
from arctic_rl_core.models.head import output_head
from arctic_rl_core.models.loading import load_causal_lm, pad_token_id
from arctic_rl_core.models.lora_shape import AdapterLayout, AdapterShape, AdapterShaper
from arctic_rl_core.models.rope_scaling import context_window, model_config
from arctic_rl_core.types import AdamSettings
from arctic_rl_kernels.split_attention import select_ops

_CHECKPOINT_TAG = "state"


def deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def deepspeed_config(config: EngineConfig) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage == 2:
        zero["contiguous_gradients"] = False
    generated = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "gradient_clipping": config.grad_clip or 0.0,
        "bf16": {"enabled": config.dtype == "bfloat16"},
        "fp16": {"enabled": config.dtype == "float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    return deep_merge(generated, config.ds_config)


def _digest_update(h: "hashlib._Hash", obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            h.update(str(key).encode())
            _digest_update(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _digest_update(h, item)
    elif obj is None or isinstance(obj, (int, float, str, bool)):
        h.update(repr(obj).encode())


def _finite_flag_into(flags: list):
    """A gradient hook recording whether the gradient is finite. It holds the list, not the engine: a hook
    holding the engine would keep it (and a ZeRO-3 engine's global config) alive after its last use."""
    def record(grad: torch.Tensor) -> torch.Tensor:
        # Flags stay on the device until the backward ends: one sync per micro-batch, not per parameter.
        flags.append(torch.isfinite(grad).all())
        return grad

    return record


def refuse_unsupported(config: BackendConfig) -> None:
    """What the configuration's own checks cannot see, refused before anything starts (also a trainer group's
    ranks)."""
    if not os.path.isdir(config.model_path):
        raise InvalidRequest("model_path", f"{config.model_path!r} is not a directory")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        select_ops(config.zorro.attention_backend, device, getattr(torch, config.engine.dtype))
    except ValueError as err:
        raise InvalidRequest("zorro.attention_backend", str(err)) from None
    if config.zorro.inference:
        from arctic_rl_core.samplers.vllm_forest_cascade import check

        check(device.type == "cuda", config.sampler.dtype or config.engine.dtype)


class DeepSpeedEngine(TrainingEngine):
    def __init__(self, config: BackendConfig):
        init_distributed()
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        ec = config.engine
        refuse_unsupported(config)
        self.config = ec
        self.stage = ec.zero_stage
        self.concurrent_forward = ec.zero_stage < 3
        self.lockstep = int(os.environ.get("WORLD_SIZE", "1")) > 1
        """One rank of several: every micro-batch's forward and backward runs even after a refusal."""
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        hf_config = model_config(config.model_path, config.rope_scaling)
        # ZoRRo's attention is loaded wherever the family allows it, so flipping `zorro.enable` switches packing at run
        # time exactly; zorro.enable only decides the packing. A family it cannot serve is an error with
        # zorro.enable, and runs its own attention (engine.attn_implementation) without.
        want_zorro = config.zorro.enable
        if want_zorro:
            check_features(hf_config)
        self.zorro_loaded = want_zorro or zorro_attention_possible(hf_config)
        self.max_context = context_window(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.pad_token_id = pad_token_id(hf_config)

        torch.manual_seed(ec.seed)
        ds_config = deepspeed_config(ec)
        # Alive only while the model loads: from_pretrained then partitions weights as it reads them (ZeRO-3).
        # transformers holds it as a process-wide setting, so kept longer it would partition every model loaded
        # later in this process too (a transformers sampler's, another backend's).
        zero3_loading = HfDeepSpeedConfig(ds_config) if ec.zero_stage == 3 else None
        model, self.zorro_loaded = load_causal_lm(config.model_path, hf_config, getattr(torch, ec.dtype),
                                                  ec.attn_implementation, zorro=self.zorro_loaded, required=want_zorro)
        del zero3_loading
        if ec.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        if ec.lora is not None:
            import peft

            model = peft.get_peft_model(
                model,
                peft.LoraConfig(
                    r=ec.lora.r, lora_alpha=ec.lora.alpha, lora_dropout=ec.lora.dropout,
                    target_modules=ec.lora.target_modules, task_type="CAUSAL_LM",
                ),
            )
        self._lora = ec.lora is not None
        self._causal_lm = model.get_base_model() if self._lora else model
        self._shaper = AdapterShaper(model, self._causal_lm.get_output_embeddings()) if self._lora else None
        wrapper = self._wrap(model, hf_config, config)
        params = [p for p in wrapper.parameters() if p.requires_grad]
        optimizer = None
        if "optimizer" not in ds_config:
            optimizer = torch.optim.AdamW(params, lr=ec.learning_rate, betas=ec.betas, eps=ec.eps, weight_decay=ec.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=wrapper, optimizer=optimizer, model_parameters=params, config=ds_config
        )
        # ZeRO-3 keeps DeepSpeed's engine reachable after the job is gone (its process-wide forward stack and a
        # class-level cache hold the model), and with it its buffers: a 2 GB gradient bucket by default. It is
        # destroyed with the job, at `close` or once ours is collected, which frees the buffers, so a process that
        # starts jobs one after another (tests, tenants) does not pile them up. The model itself stays reachable.
        self._destroy = weakref.finalize(self, self.engine.destroy)
        self._destroy.atexit = False  # a process that ends frees it all anyway
        inference_behaviour(self.engine.module)
        self._check_exactness(wrapper, want_zorro)
        wrapper.router_replay = self.router_replay = (
            load_router_replay(self._causal_lm, hf_config, self.device) if config.router_replay != "off" else None)
        self.replay_shape = None if self.router_replay is None else self.router_replay.shape
        if self.router_replay is not None:
            # One routing state per model: forwards take turns (gradient checkpointing's recompute in backward reads it).
            self.concurrent_forward = False
        # DeepSpeed's own loader unpickles with weights_only=False; ours reads data only.
        self.engine.checkpoint_engine = SafeCheckpointEngine(self.engine._config)
        self.engine.set_gradient_accumulation_boundary(False)
        self._has_gradients = False
        self._steps = 0
        self._trainable = [(n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad]
        self._grad_finite: list[torch.Tensor] = []
        for _, param in self._trainable:
            param.register_hook(_finite_flag_into(self._grad_finite))

    def close(self) -> None:
        """Destroy DeepSpeed's engine: its hooks and buffers (see `_destroy`). Once."""
        self._destroy()

    def _wrap(self, model: torch.nn.Module, hf_config, config: BackendConfig) -> torch.nn.Module:
        """The module DeepSpeed trains: the policy's logits (log-probs) at the response rows."""
        return ResponseLogits(model, self._causal_lm, output_head(hf_config), config.zorro.attention_backend)

    def _check_exactness(self, wrapper: torch.nn.Module, want_zorro: bool) -> None:
        """The log-probs are the model's own, packed or not, or the job does not load; without zorro.enable, a
        family whose packed forward is not exact falls back to its own attention."""
        probe = dict(pad_id=self.pad_token_id, vocab_size=self.vocab_size, device=self.device,
                     dtype=getattr(torch, self.config.dtype))
        try:
            check_exactness(self.engine, wrapper, self._causal_lm, zorro=self.zorro_loaded, **probe)
        except InvalidRequest as err:
            if want_zorro or not self.zorro_loaded or err.field != "zorro.enable":
                raise
            self._causal_lm.set_attn_implementation(self.config.attn_implementation)  # possible: zorro_attention_possible
            self.zorro_loaded = False
            check_exactness(self.engine, wrapper, self._causal_lm, zorro=False, **probe)

    # -- forward ---------------------------------------------------------------------------------

    output_keys: tuple[str, ...] = ("logprobs", "entropy")
    """The per-token outputs `forward` returns and `forward_backward` keeps."""
    reports_routes = True
    """A replaying forward also returns the routing it took (the policy's, which R2 replays in the update)."""

    def _outputs(self, mb: MicroBatch, post: list[tuple[Registered, Any]], with_entropy: bool,
                 record_routes: bool = False) -> dict[str, torch.Tensor]:
        return response_outputs(self.engine, mb, post, with_entropy, self.device, record_routes)

    def forward_backward(self, micro_batches, loss, loss_config, post, scales=None, keep_outputs=False,
                         with_entropy=False):
        with_entropy = with_entropy or bool(getattr(loss_config, "needs_entropy", lambda: False)())
        kept = [] if keep_outputs else None
        total = 0.0
        metrics: dict[str, float] = defaultdict(float)
        failure: InvalidRequest | None = None
        for k, mb in enumerate(micro_batches):
            scale = 1.0 if scales is None else scales[k]
            mb.inputs = inputs_on_device(mb.inputs, self.device)
            outputs = self._outputs(mb, post, with_entropy)
            value, mb_metrics = loss.fn(outputs, mb.inputs, loss_config)
            if kept is not None:
                kept.append({k: v.detach().float().cpu() for k, v in outputs.items() if k in self.output_keys})
            if value.dim() != 0:
                raise ArcticRLError(f"loss {loss.name!r} returned shape {tuple(value.shape)}, expected a scalar")
            if failure is None and not torch.isfinite(value):
                failure = InvalidRequest("loss", f"loss {loss.name!r} is {value.item()} in micro-batch {k}")
            if failure is not None and not self.lockstep:
                raise failure
            self._grad_finite.clear()
            # After a failure, ranks of a group still run every backward (their collectives must pair up);
            # the caller then discards these gradients.
            weight = 0.0 if failure is not None else scale
            self.engine.backward(value if weight == 1.0 else value * weight)
            self._has_gradients = True
            if failure is None and self._grad_finite and not bool(torch.stack(self._grad_finite).all()):
                failure = InvalidRequest("loss", f"loss {loss.name!r} has non-finite gradients in micro-batch {k}")
                if not self.lockstep:
                    raise failure
            if scale and failure is None:
                total += value.item()
                for name, m in mb_metrics.items():
                    metrics[name] += float(m)
        if failure is not None:
            raise failure
        return total, dict(metrics), kept

    @torch.no_grad()
    def forward(self, micro_batches, post, with_entropy):
        results = []
        for mb in micro_batches:
            mb.inputs = inputs_on_device(mb.inputs, self.device)
            record = self.router_replay is not None and self.reports_routes
            out = self._outputs(mb, post, with_entropy, record_routes=record)
            kept = {k: v.float().cpu() for k, v in out.items() if k in self.output_keys}
            if record:  # the routing this forward took, replayed or its own, per flat position
                kept["routed_experts"] = self.router_replay.recorded.cpu()
            results.append((mb, kept))
        return results

    # -- optimizer -------------------------------------------------------------------------------

    @property
    def has_gradients(self) -> bool:
        return self._has_gradients

    @property
    def steps(self) -> int:
        return self._steps

    def discard_gradients(self) -> None:
        """Drop every gradient accumulated since the last step, wherever this ZeRO stage keeps it."""
        opt = self.engine.optimizer
        self.engine.zero_grad()  # param.grad (stage 0)
        if opt is not None and hasattr(opt, "zero_grad"):
            opt.zero_grad(set_to_none=True)  # ZeRO-1/2: param.grad and grad_accum; ZeRO-3: restarts accumulation
        for name in ("all_grad_tensors", "averaged_gradients"):  # ZeRO-1/2: sums across backward calls
            held = getattr(opt, name, None)
            if isinstance(held, dict):
                held.clear()
        flat = getattr(opt, "grad_partitions_flat_buffer", None)  # ZeRO-3's accumulated partitions
        if isinstance(flat, torch.Tensor):
            flat.zero_()
        self.engine.set_gradient_accumulation_boundary(False)
        self._has_gradients = False

    def _set_adam(self, adam: AdamSettings) -> None:
        """This step's betas, eps and weight decay on every parameter group (the ZeRO optimizers' groups are their
        inner AdamW's), and its clipping where this engine's DeepSpeed reads it: the engine's configuration (stage 0)
        and the ZeRO optimizer's own copy (stages 1-3)."""
        ec = self.config
        betas = tuple(adam.betas) if adam.betas is not None else tuple(ec.betas)
        eps = ec.eps if adam.eps is None else adam.eps
        weight_decay = ec.weight_decay if adam.weight_decay is None else adam.weight_decay
        clip = (ec.grad_clip or 0.0) if adam.grad_clip is None else adam.grad_clip
        for group in self.engine.optimizer.param_groups:
            group.update(betas=betas, eps=eps, weight_decay=weight_decay)
        self.engine._config.gradient_clipping = clip
        if hasattr(self.engine.optimizer, "clip_grad"):
            self.engine.optimizer.clip_grad = clip

    def _grad_norm_stage0(self) -> float:
        grads = [p.grad.detach().float() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0

    def optimizer_step(self, learning_rate, adam=None):
        self._set_adam(adam or AdamSettings())
        if learning_rate is not None:
            for group in self.engine.optimizer.param_groups:
                group["lr"] = learning_rate
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.allreduce_gradients()
        grad_norm = self._grad_norm_stage0() if self.stage == 0 else None
        self.engine.step()
        if grad_norm is None:
            grad_norm = float(self.engine.get_global_grad_norm())
        self.engine.set_gradient_accumulation_boundary(False)
        self._has_gradients = False
        self._steps += 1
        return grad_norm, float(self.engine.optimizer.param_groups[0]["lr"])

    # -- weights and state ------------------------------------------------------------------------

    @contextmanager
    def _gathered(self, params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params), enabled=self.stage == 3):
            yield

    @contextmanager
    def _merged(self):
        if not self._lora:
            yield
            return
        self.engine.module.model.merge_adapter()
        try:
            yield
        finally:
            self.engine.module.model.unmerge_adapter()

    def named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        # Full parameters are handed out as they are (no copy); gathered (ZeRO-3) or merged (LoRA)
        # ones only exist inside their context, so those are copied.
        copy = self.stage == 3 or self._lora
        with self._merged():
            for name, param in self._causal_lm.named_parameters():
                if self._lora:
                    if "lora_" in name:
                        continue
                    name = name.replace(".base_layer.", ".")
                with self._gathered([param]):
                    yield name, param.detach().clone() if copy else param.detach()

    def save(self, path: str, client_state: dict, trainable_only: bool = False) -> None:
        self.engine.save_checkpoint(path, tag=_CHECKPOINT_TAG, client_state={**client_state, "steps": self._steps},
                                    exclude_frozen_parameters=trainable_only)

    def load(self, path: str, trainable_only: bool = False, optimizer: bool = True) -> dict:
        shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in self._trainable}
        preflight(os.path.join(path, _CHECKPOINT_TAG), shapes)
        self.discard_gradients()
        # A trainable-only checkpoint lacks the frozen weights, which stay as they are.
        _, client_state = self.engine.load_checkpoint(path, tag=_CHECKPOINT_TAG, load_optimizer_states=True,
                                                      load_module_strict=not trainable_only)
        self.engine.set_gradient_accumulation_boundary(False)
        self._steps = int(client_state.get("steps", 0))
        if not optimizer:
            # Loaded whole first, so that ZeRO's fp32 master copies are the checkpoint's weights; then the moments go.
            # Every stage's AdamW (the ZeRO optimizers' inner one) starts with no state and makes it at its first step.
            inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
            inner.state.clear()
        return client_state

    def save_adapter(self, path: str) -> None:
        if not self._lora:
            raise InvalidRequest("engine.lora", "this engine trains all parameters: it has no adapter to save")
        # Below ZeRO-3 every rank holds the whole adapter; one writes it.
        if int(os.environ.get("RANK", "0")) == 0:
            # The adapter alone: PEFT would add an adapted output head's frozen base weights ("embedding layers").
            self.engine.module.model.save_pretrained(path, save_embedding_layers=False)
            self._shaper.write(path)

    def adapter_layout(self) -> AdapterLayout | None:
        return None if self._shaper is None else self._shaper.layout

    def shape_adapter(self, shape: AdapterShape | None) -> None:
        if self._shaper is None:
            if shape is not None:
                raise InvalidRequest("engine.lora", "this engine trains all parameters: it has no adapter to shape")
            return
        self._shaper.apply(shape)

    def state_digest(self) -> str:
        h = hashlib.sha256()
        for name, param in self.engine.module.named_parameters():
            with self._gathered([param]):
                h.update(name.encode())
                _digest_update(h, param)
        _digest_update(h, self.engine.optimizer.state_dict())
        return h.hexdigest()
