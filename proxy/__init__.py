"""The OpenAI-compatible routing proxy (no torch import). Built in the cluster issue."""
