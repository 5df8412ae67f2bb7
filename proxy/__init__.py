"""The OpenAI-compatible routing proxy (no torch import): `server`, `main`, protocol, tokenization, token stream."""
