"""What UCX says it chose: the transports of each endpoint's protocols, read from the
report UCX prints with `UCX_PROTO_INFO=y` (one table per endpoint configuration).

Between two network namespaces of one machine UCX moves the bytes through shared
memory unless `UCX_TLS` keeps it off, so a run across hosts checks here that its
remote memory writes and reads went over TCP on the link it meant.
"""

from __future__ import annotations

import re

# Pin UCX to TCP and have it print its choices.
TCP_ONLY = {"UCX_TLS": "tcp,self", "UCX_PROTO_INFO": "y"}
TABLE_TITLE = re.compile(r"\s(\S+) cfg#\d+\s*\|")  # "| kvpush-1f2e- inter-node cfg#1 |"
TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/([\w.:-]+)")  # "tcp/eth0", "cma/memory"


def peer_lanes(log: str) -> set[str]:
    """The transports UCX reported for remote memory writes and reads to another
    process: its tables for "intra-node" and "inter-node" endpoints, not for this
    process's own ("self")."""
    lanes: set[str] = set()
    scope, rma = "", False
    for line in log.splitlines():
        if (title := TABLE_TITLE.search(line)) is not None:
            scope, rma = title.group(1), False
        elif "remote memory write" in line or "remote memory read" in line:
            rma = True
        elif "active message" in line:
            rma = False
        elif scope and scope != "self" and rma and line.rstrip().endswith("|"):
            lanes |= {m.group(0) for m in TRANSPORT.finditer(line.rsplit("|", 2)[-2])}
    return lanes
