"""Cluster-level parts: the ``pdcluster`` CLI (and, in later issues, protocol types, launcher, controller, simulator)."""
