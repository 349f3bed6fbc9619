"""The identity endpoint a kvpush instance serves for routers.

GET /query answers this instance's kvpush identity (engine id, boot epoch, transfer
mode, one side-channel address per TP rank), shaped like the Mooncake bootstrap
query production routers already call. GET /kvpush/state answers how many
transfers are in flight, for leak checks; GET /kvpush/spans where requests' time
went, phase by phase, and GET /kvpush/trace?last=N each recent request's
milestones (kvpush.vllm.spans). Plain HTTP/1.1 on its own thread: it must
not depend on the engine's event loop, and it costs nothing while nobody asks.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)


class IdentityServer:
    def __init__(
        self,
        host: str,
        port: int,
        routes: dict[str, Callable[[dict[str, str]], Any]],
    ) -> None:

        class Handler(BaseHTTPRequestHandler):
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
