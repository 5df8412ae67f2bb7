"""The local Ray that the test modules asking for the ``local_ray`` fixture share, one per pytest process.

A local Ray costs ~6 s of CPU to start on two cores (gcs, raylet, dashboard API server and agent, runtime-env agent,
log monitor, autoscaler monitor: each a process that imports Ray) and ~1.5 s to stop. Modules that run their clusters
on a local Ray (``Cluster(cfg, local_ray=True)``, cluster/local_ray.py) share one: the first module that asks starts
it; it stays up for the next module that asks; a module that does not ask gets no Ray of ours (it may start its own, or
a ``Cluster`` that starts an embedded one), so it is shut down before that module's first fixture. A module that
leaves a pdcluster actor behind (a failed stop), or whose Ray died, hands the next one a fresh Ray, as a Ray per
module did: every cluster starts on a Ray with no other cluster's actors (``cluster.local_ray.claim``).
"""

from __future__ import annotations

CPUS = 6  # the largest cluster a module starts: actors x CPUs each + 1, as serve's own embedded Ray would offer


class SharedRay:
    """Whether this process's shared local Ray is up; ``ensure`` / ``release`` / ``shutdown`` start and stop it."""

    def __init__(self) -> None:
        self.up = False
        self.starts = 0  # how many times it was started (a fresh one after a module that left actors counts)

    def ensure(self) -> None:
        """Start the shared Ray unless it is up."""
        if self.up:
            return
        from cluster.local_ray import start_local_ray

        start_local_ray(num_cpus=CPUS)
        self.up = True
        self.starts += 1

    def release(self) -> None:
        """After a module that used it: keep it up for the next module only if no pdcluster actor is left on it and it
        still answers; else shut it down."""
        if not self.up:
            return
        from cluster.local_ray import named_actors

        try:
            clean = not named_actors()
        except Exception:  # a Ray that died under the module (its raylet killed): the next module gets a fresh one
            clean = False
        if not clean:
            self.shutdown()

    def shutdown(self) -> None:
        """Shut the shared Ray down if it is up."""
        if self.up:
            import ray

            ray.shutdown()
            self.up = False
