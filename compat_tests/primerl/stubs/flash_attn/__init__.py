"""Import-only stub of flash_attn for a CPU-only prime-rl compatibility environment.

flash-attn is CUDA-only: PyPI serves only an sdist that cannot produce working kernels on a
machine without CUDA, and prime-rl's `[flash-attn]` extra is a prebuilt wheel on GitHub.
The real `ring-flash-attn` 0.1.8 (PyPI) imports `flash_attn.flash_attn_interface` at module
import time; prime-rl imports `ring_flash_attn` at import time of `prime_rl.utils.cp`
(<- prime_rl.trainer.models.glm_moe_dsa.sparse_mla_attention <- prime_rl.trainer.model
 <- prime_rl.orchestrator.orchestrator).

Deliberately NOT exported here: flash_attn_varlen_func, flash_attn.cute.  prime-rl guards
those with try/except ImportError, so it correctly sees "no flash-attn".  The stub ships no
dist-info, so transformers' is_flash_attn_2_available() stays False.
"""
