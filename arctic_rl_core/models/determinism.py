"""RL needs the trainer's log-probs to equal the sampler's: no dropout and no training-time noise
(MoE router jitter) anywhere in the model, although the engine keeps it in train mode."""

from __future__ import annotations


_RANDOM_IN_TRAINING = ("dropout", "pdrop", "jitter")


def without_dropout(config):
    """Set every dropout probability and router jitter of `config` (and its text config) to 0, before the
    model is built: modules copy theirs at construction, so zeroing the config afterwards is too late."""
    for sub in {id(c): c for c in (config, config.get_text_config())}.values():
        for key, value in vars(sub).items():
            if isinstance(value, float) and any(word in key for word in _RANDOM_IN_TRAINING):
                setattr(sub, key, 0.0)
    return config
