"""The decode actor (`worker.DecodeWorker`): a request's owner, continuous decoding; its K/V intake is `kv_transfer.connector`."""
