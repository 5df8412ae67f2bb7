"""Tiered K/V below the device pool: keys (model fingerprint + tenant), the host tier (L2), the hooks that demote
evicted blocks and promote hits back, and the fetch-or-recompute sum. See docs/kv-tiers.md."""
