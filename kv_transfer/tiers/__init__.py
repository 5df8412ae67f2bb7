"""K/V tiers that live beside the transfer backends: the local disk tier (L3). See docs/kv-tiers.md."""
