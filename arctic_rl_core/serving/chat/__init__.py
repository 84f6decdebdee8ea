"""`/v1/chat/completions`: its request schema and its route."""
