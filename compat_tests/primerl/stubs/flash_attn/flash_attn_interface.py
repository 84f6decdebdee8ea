"""Import-only stub (see flash_attn/__init__.py). Every function raises when called."""


def _unavailable(name):
    raise NotImplementedError(f"flash_attn.{name}: flash-attn is an import-only stub (CUDA-only package)")


def _flash_attn_forward(*args, **kwargs):
    _unavailable("_flash_attn_forward")


def _flash_attn_backward(*args, **kwargs):
    _unavailable("_flash_attn_backward")


def _flash_attn_varlen_forward(*args, **kwargs):
    _unavailable("_flash_attn_varlen_forward")


def _flash_attn_varlen_backward(*args, **kwargs):
    _unavailable("_flash_attn_varlen_backward")
