"""GRPO recipes and their driver (`arctic-rl train`): text-to-SQL and multi-hop QA."""
