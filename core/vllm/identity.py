"""This instance's kvpush identity, and the endpoint that serves it to routers.

GET /query answers this instance's kvpush identity (engine id, boot epoch, transfer
mode, one side-channel address per TP rank), shaped like the Mooncake bootstrap
query production routers already call. GET /kvpush/state answers how many
transfers are in flight, for leak checks; GET /kvpush/spans where requests' time
went, phase by phase, and GET /kvpush/trace?last=N each recent request's
milestones (kvpush.vllm.spans). POST /kvpush/release takes a router's word that a
transfer's decode leg never reached decode (kvpush.vllm.release). Plain HTTP/1.1
on its own threads: it must not depend on the engine's event loop, and it costs
nothing while nobody asks. Each read of a request is bounded in size and time, so
a slow or greedy client holds one of those threads for seconds at most.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvpush.addresses import network_id
from kvpush.identities import (
    EPOCH_SEPARATOR,
    InstanceIdentity,
    RankIdentity,
    dp_siblings,
    mooncake_query,
)
from kvpush.vllm.config import ConnectorConfig, rank_port
from kvpush.vllm.metadata import KVPushHandshake

log = logging.getLogger(__name__)

Route = Callable[[dict[str, str]], Any]  # a GET's query -> its JSON answer
PostRoute = Callable[[Any], tuple[int, Any]]  # a POST's JSON body -> (status, JSON answer)
MAX_BODY = 4096  # bytes of a POST body: a transfer id and a token fit many times over
READ_TIMEOUT_S = 5.0  # each read of a request's line, headers and body


class IdentityServer:
    def __init__(
        self,
        host: str,
        port: int,
        routes: Mapping[str, Route],
        posts: Mapping[str, PostRoute] | None = None,
    ) -> None:
        posts = dict(posts or {})

        class Handler(BaseHTTPRequestHandler):
            timeout = READ_TIMEOUT_S

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                route = routes.get(path)
                if route is None:
                    self._answer(404, {"error": f"no such path {self.path!r}"})
                    return
                try:
                    self._answer(200, route(dict(urllib.parse.parse_qsl(query))))
                except Exception as exc:  # the engine must not die of a bad query
                    self._answer(500, {"error": repr(exc)})

            def do_POST(self) -> None:
                route = posts.get(self.path.partition("?")[0])
                if route is None:
                    self._answer(404, {"error": f"no such path {self.path!r}"})
                    return
                body = self._body()
                if body is None:
                    return  # answered already
                try:
                    self._answer(*route(body))
                except Exception as exc:  # the engine must not die of a bad request
                    self._answer(500, {"error": repr(exc)})

            def _body(self) -> Any:
                """The request's JSON body, or None once an error is answered."""
                length = self.headers.get("Content-Length", "")
                if not length.isdigit():
                    self._answer(411, {"error": "a POST needs a Content-Length"})
                    return None
                if int(length) > MAX_BODY:
                    self._answer(413, {"error": f"a body of at most {MAX_BODY} bytes"})
                    return None
                try:
                    return json.loads(self.rfile.read(int(length)))
                except ValueError as exc:  # not JSON, or not UTF-8
                    self._answer(400, {"error": f"the body is not JSON: {exc}"})
                    return None

            def _answer(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("identity endpoint: " + format, *args)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="kvpush-identity", daemon=True
        )
        self._thread.start()
        log.info("kvpush identity endpoint on http://%s:%d/query", host, self.port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class IdentityService:
    """This instance as routers see it (GET /query, and the prefill answer's echo),
    and the HTTP servers that answer for it: its own identity endpoint, and on DP
    rank 0 a Mooncake-shaped bootstrap server speaking for every DP rank."""

    def __init__(
        self,
        config: ConnectorConfig,
        engine_id: str,
        block_size: int,
        world: int,
        dp_rank: int = 0,
        data_parallel: bool = False,
        block_pages: bool = True,
        kv_groups: int = 1,
    ) -> None:
        self.config = config
        self.kv_groups = kv_groups
        self.kv_states = 0  # of them, recurrent-state groups: the connector says how many
        self.seeds_rewind = False  # its generators rewind: the connector says so
        self.engine_id = engine_id
        self.block_size = block_size
        self.world = world
        self.dp_rank, self.data_parallel = dp_rank, data_parallel
        # Whether a peer of another block size may take our blocks as pages of its own.
        self.block_pages = block_pages
        self.epoch = os.urandom(4).hex()
        self._ranks: dict[int, KVPushHandshake] = {}
        self.identity_server: IdentityServer | None = None
        self.bootstrap_server: IdentityServer | None = None

    def serve(
        self,
        handshakes: dict[int, KVPushHandshake],
        routes: Mapping[str, Route],
        posts: Mapping[str, PostRoute] | None = None,
    ) -> None:
        """Learn every worker rank's identity, and start answering: /query, `routes`
        (GET) and `posts` (POST)."""
        self._ranks = {}
        self.learn(handshakes)
        if self.identity_server is None:
            port = rank_port(self.config.identity_port, self.dp_rank)
            self.identity_server = IdentityServer(
                self.config.listen,
                port,
                {"/query": lambda _: self.identity().to_query(), **routes},
                posts,
            )
        if self.config.bootstrap_port and self.dp_rank == 0 and self.bootstrap_server is None:
            query = {"/query": lambda _: mooncake_query(self._dp_identities())}
            self.bootstrap_server = IdentityServer(
                self.config.listen, self.config.bootstrap_port, query
            )

    def learn(self, handshakes: Mapping[int, KVPushHandshake]) -> None:
        """Worker ranks' identities: every rank's at the start, a rank's again when its
        node started afresh (a new boot, after vLLM let go of the KV cache's memory)."""
        self._ranks.update(handshakes)
        ranks = self._ranks
        if ranks and all(h.epoch for h in ranks.values()):
            # This boot, as decode legs will name it: every rank's own, so a decode
            # worker can check the one it pairs with.
            self.epoch = EPOCH_SEPARATOR.join(ranks[r].epoch for r in sorted(ranks))

    def identity(self) -> InstanceIdentity:
        port = self.identity_server.port if self.identity_server is not None else 0
        return InstanceIdentity(
            engine_id=self.engine_id,
            endpoint=f"{self.config.host}:{port}",
            epoch=self.epoch,
            transfer_mode=self.config.protocol.mode,
            tp_size=self.world,
            block_size=self.block_size,
            block_pages=self.block_pages,
            kv_groups=self.kv_groups,
            kv_states=self.kv_states,
            dp_rank=self.dp_rank,
            data_parallel=self.data_parallel,
            seeds_rewind=self.seeds_rewind,
            network=network_id(),
            addresses=[self._ranks[r].address for r in sorted(self._ranks)],
            ranks=[
                RankIdentity(r, h.address, h.epoch, h.agent) for r, h in sorted(self._ranks.items())
            ],
        )

    def _dp_identities(self) -> list[InstanceIdentity]:
        """Every DP rank's identity: ours, then DP rank 1, 2, ... from their identity
        endpoints until one does not answer (vLLM tells an engine its own DP rank, not
        how many there are)."""
        mine = self.identity()
        url = f"http://{self.config.host}:{self.config.identity_port}"
        return [mine, *dp_siblings(url, mine)]

    def close(self) -> None:
        for server in (self.identity_server, self.bootstrap_server):
            if server is not None:
                server.close()
