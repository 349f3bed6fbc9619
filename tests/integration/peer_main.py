"""A test peer in its own OS process, driven by JSON lines on stdin.

The first command, {"op": "init", "kind": "agent" | "node", ...}, builds the peer;
every later {"op": method, ...} calls that method. Each command answers one line:
the method's dict plus "ok", or "ok": false with the error.
"""

from __future__ import annotations

import json
import sys

from agent_peer import Peer
from node_peer import NodePeer

KINDS = {"agent": Peer, "node": NodePeer}


def main() -> None:
    peer = None
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            if op == "init":
                peer = KINDS[command.pop("kind", "agent")](**command)
                reply = peer.hello()
            else:
                reply = getattr(peer, op)(**command)
            reply["ok"] = True
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    if hasattr(peer, "close"):
        peer.close()


if __name__ == "__main__":
    main()
