"""The wire floor: what crosses process boundaries, torch-free, imported by both the proxy and the actors.

``messages`` (typed, versioned messages: requests, reservations, prefill results, token deltas, stats, aborts),
``names`` (Ray namespace and actor names), ``token_stream`` (token deltas from decode actors to proxies over pyzmq),
``worker_config`` (settings every worker shares), ``ray_address`` (joining a Ray cluster) and ``node`` (this node's
address, which endpoints bind and advertise). Nothing in ``cluster/`` imports ``proxy/`` or the other way round
except through this package.
"""
