"""Import-only stub (see torchtitan/__init__.py)."""
