"""`/v1/completions`: its request schema and its route."""
