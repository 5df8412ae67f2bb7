"""The worker runtime: the engine loop both roles run, the Ray actor that hosts a role, its preStop evacuation."""
