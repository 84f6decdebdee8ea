"""PrimeRL adapter. Not implemented yet."""
