"""Plugins: the hook specifications and the manager that builds registries from installed plugins.

A package extends Arctic RL by declaring an entry point in the `arctic_rl`
group that names a module with `@hookimpl` functions (docs/plugins.md).
"""

from arctic_rl_core.plugins.hookspecs import Command, hookimpl
from arctic_rl_core.plugins.manager import PluginManager, load_plugins

__all__ = ["Command", "PluginManager", "hookimpl", "load_plugins"]
