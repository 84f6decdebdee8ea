"""The token routes (`/inference/v1/generate`, `/skyrl/v1/generate`, `/tokenize`, `/detokenize`): their request schemas and routes."""
