"""VeRL adapter (issue: verl 0.9.1 through its `verl.plugins` entry point). Not implemented yet."""
