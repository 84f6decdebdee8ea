"""Arctic RL's built-in plugin (`builtin`): its losses, post-processors, engine and samplers,
registered through the same `arctic_rl` entry-point group as any third-party plugin."""
