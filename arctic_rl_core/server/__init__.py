"""The training API as an HTTP service (`arctic-rl serve`)."""
