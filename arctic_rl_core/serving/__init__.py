"""The sampling surface for environments and agent harnesses: OpenAI- and vLLM-compatible routes on the
same sampler, weights and episode capture as the training API."""
