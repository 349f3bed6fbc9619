"""Real kvpush Nodes over host memory, as the security tests attack them."""

from __future__ import annotations

import struct

import numpy as np

from kvpush.backend.plugins import Backends
from kvpush.node import Node, NodeConfig

SECRET = b"the-deployment-secret-0123456789"
HEADER = struct.Struct("!I")  # the side channel's frame length prefix


def host_node(role: str, engine: str, **config) -> Node:
    """A started Node with two layers of eight 4 KiB blocks, under SECRET."""
    backends = Backends(["host"])
    buf = np.zeros((2, 8, 4096), dtype=np.uint8)
    kv = backends.describe({f"layer.{i}": buf[i] for i in range(2)}, ("blocks", "bytes"))
    node = Node(NodeConfig(engine, role, secret=SECRET, **config), kv, backends).start()
    node._buffers = buf  # kept alive with the node
    return node
