"""SkyRL adapter: skyrl 0.4.0's trainer delegates policy training and log-probs to Arctic RL.

Selected on SkyRL's own command line, `trainer.override_entrypoint=arctic_rl_skyrl.entrypoint`,
with SkyRL's generator and environments kept, their inference sent to the Arctic RL server's
vLLM-compatible routes. Nothing in SkyRL is edited. See docs/skyrl.md.
"""
