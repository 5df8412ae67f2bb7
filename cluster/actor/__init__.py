"""The worker actor (layer "worker actor", docs/architecture.md): the Ray actor that hosts a prefill or decode role,
its preStop evacuation and its threads' CPU priorities. Above the roles and the worker loop (cluster/loop/)."""
