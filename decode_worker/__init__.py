"""The decode actor (`worker.DecodeWorker`): reservations, KV receipt (`kv_receiver`), continuous decoding."""
