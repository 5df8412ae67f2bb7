"""What runs in a step: ``scheduler`` (continuous batching, chunked prefill, preemption) and ``kv_cache_manager`` (block
tables, the prefix cache)."""
