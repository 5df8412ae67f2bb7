"""Speculative decoding: config, policy, proposers (n-gram, draft model, MTP), rows and verification."""
