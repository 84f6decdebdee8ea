"""Tinker's API on Arctic RL: the unmodified `tinker` SDK (and tinker-cookbook) train and sample through it."""
