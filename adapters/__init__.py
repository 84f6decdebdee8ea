"""Framework adapters (VeRL, SkyRL, PrimeRL): thin, CPU-only translations of each framework's
worker/backend contract into Arctic RL's training API."""
