"""Arctic RL plugins: pluggy hook specifications, the plugin manager, and the built-in plugin.

A third-party package extends Arctic RL by declaring an entry point in the
`arctic_rl` group that names a module with hook implementations.
"""

from arctic_rl_plugins.hookspecs import hookimpl
from arctic_rl_plugins.manager import get_plugin_manager

__all__ = ["get_plugin_manager", "hookimpl"]
