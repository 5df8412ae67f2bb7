"""This process's node address: where endpoints that other nodes reach (KV transfer, token stream) bind and what they
advertise. Torch-free; never imports Ray itself.

In order: ``PDCLUSTER_NODE_IP`` (an explicit per-node setting; the chart sets it from the pod IP), else the address
Ray knows this node by (``ray start --node-ip-address``, or the one Ray detected) once Ray is initialized in this
process (inside every actor; in a driver after ``ray.init``), else ``127.0.0.1``. Ray never reports ``127.0.0.1``
for a node on a machine with a network: it replaces a loopback ``--node-ip-address`` with the machine's address.
"""

from __future__ import annotations

import os
import sys

NODE_IP_ENV = "PDCLUSTER_NODE_IP"
LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "")  # bind addresses meaning every interface: nobody can connect to them elsewhere


def node_ip() -> str:
    """The address other nodes reach this process's node at. Reads the environment and Ray's state; no side effects."""
    explicit = os.environ.get(NODE_IP_ENV, "").strip()
    if explicit:
        return explicit
    ray = sys.modules.get("ray")  # not imported: certainly not initialized (and importing it costs a second)
    if ray is not None and ray.is_initialized():
        from ray.util import get_node_ip_address

        return str(get_node_ip_address())
    return LOOPBACK


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` means every interface (an address to bind, never one to advertise). Pure."""
    return host.strip("[]") in WILDCARDS


def advertised(bind_host: str) -> str:
    """The address peers reach an endpoint bound to ``bind_host`` at: this node's address for a wildcard, else the
    bound address itself."""
    return node_ip() if is_wildcard(bind_host) else bind_host
