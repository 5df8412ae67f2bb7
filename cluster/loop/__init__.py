"""The worker loop (layer "worker loop", docs/architecture.md): the one engine loop both roles run, and its opt-in
profiler. Below the roles; the worker actor (cluster/actor/) hosts it."""
