"""Loss functions and post-processors, and their registries.

The built-in losses are registered by the built-in plugin (`arctic_rl_plugins.builtin`),
so importing the registry does not import torch.
"""
