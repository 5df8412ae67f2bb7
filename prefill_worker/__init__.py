"""The prefill actor (`worker.PrefillWorker`): chunked prefill, per-layer KV streaming, first token."""
