"""The paged K/V cache's blocks: ``block_hash`` (prefix hashes, torch-free), ``block_pool`` (free / used / cached
blocks), ``prefix_events`` (add / evict events), ``kv_memory`` (the cache tensor and its layout); ``tiers/`` the host
and disk tiers below the device pool."""
