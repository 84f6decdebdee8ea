"""Loss functions and post-processors, and the registry type the plugin manager fills with them.

The built-in ones are declared here and registered by the built-in plugin
(`arctic_rl_plugins.builtin`); importing the registry does not import torch.
"""
