"""The wire floor: what crosses process boundaries, torch-free, imported by both the proxy and the actors.

``messages`` (typed, versioned messages: requests, reservations, prefill results, token deltas, stats, aborts),
``names`` (Ray namespace and actor names), ``token_stream`` (token deltas from decode actors to proxies over pyzmq),
``worker_config`` (settings every worker shares), ``ray_address`` (joining a Ray cluster), ``node`` (this node's
address, which endpoints bind and advertise), ``auth`` (the cluster secret) and ``slo`` (what "met the SLOs" means,
judged alike by proxies and controller). It stands on ``engine``'s torch-free value types only (``sampling_params``,
``grammar_spec``, ``config``); every room above ``engine`` may import it. The layers and their check:
``scripts/check_imports.py``, docs/architecture.md "Layers".
"""
