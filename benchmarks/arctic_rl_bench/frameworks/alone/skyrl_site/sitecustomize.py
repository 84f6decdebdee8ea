"""Python imports `sitecustomize` at start-up: in the SkyRL alone run, every process (the driver, Ray's workers,
vLLM's processes) applies the alone patches (skyrl_alone_patches.py; skyrl_runner.py puts this folder and its parent
on PYTHONPATH)."""

import skyrl_alone_patches

skyrl_alone_patches.apply_all()
