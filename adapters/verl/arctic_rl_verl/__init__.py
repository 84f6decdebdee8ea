"""VeRL adapter: verl 0.9.1 delegates actor training, log-probs and rollout to Arctic RL.

Loaded by verl itself: `import verl` imports the `verl.plugins` entry point
`arctic_rl = arctic_rl_verl.plugin` in every process. Nothing in verl is
edited. See docs/verl.md.
"""
