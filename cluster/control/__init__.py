"""The control plane: the pure controller, its observations, the pool manager that carries its decisions out, the
record and replay of a live control loop, and the cluster simulator the controller is tried in."""
