"""SkyRL adapter. Not implemented yet."""
