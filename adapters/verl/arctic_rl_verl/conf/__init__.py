"""The adapter's Hydra configs (found through the search-path plugin)."""
