"""Moving KV blocks between prefill and decode actors (backends: torch.distributed, UCX). Built in the cluster issue."""
