"""Text-to-SQL: BIRD/Spider loaders, a synthetic BIRD-format generator, sandboxed execution-match reward."""
