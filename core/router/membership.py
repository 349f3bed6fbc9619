"""The router's instances at runtime: added, drained, and read from a file.

- `POST /instances` with `{"role": "prefill"|"decode", "url": "http://host:port",
  "identity": PORT, "kv_events": "tcp://host:port", "device": LABEL}` (the last
  three optional) adds an instance. It is probed and its identity asked at once,
  and the next request may go there (a failed probe keeps it out of the pick for
  two health intervals, as a failed periodic probe would).
- `DELETE /instances` with `{"url": ...}` (or `DELETE /instances/<url, quoted>`)
  drains one: it takes no new request; once none is in flight at the router
  (legs, and prefill legs still finishing after their decode answered) it is
  forgotten: pools, health probes, prefix index, event stream. The answer comes
  then (`?wait=0`: at once, 202). The last open instance of a role is not drained.
- `GET /instances`: each instance, its role and state.
- A file of instances (`--instances-file`), one `prefill SPEC` or `decode SPEC` a
  line, `#` for comments, SPEC as `--prefill` takes it, is read again each health
  interval: a new line adds its instance, a line gone drains the instance it named.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import unquote

from aiohttp import web

from kvpush.errors import ConfigError
from kvpush.metrics import Metrics
from kvpush.router.health import HealthWatch
from kvpush.router.instances import Instance, Pool
from kvpush.router.kv_events import Subscription
from kvpush.router.legs import openai_error
from kvpush.router.prefix import PrefixIndex

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


def read_instances(path: Path) -> list[Instance]:
    """A file's instances (see the module's docstring), each line checked."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        role, _, spec = line.partition(" ")
        if role not in ("prefill", "decode") or not spec.strip():
            raise ConfigError(f"{path}:{number}: {line!r} is not 'prefill SPEC' or 'decode SPEC'")
        found.append(Instance.parse(spec.strip(), role))
    return found


class Membership:
    def __init__(
        self,
        pools: dict[str, Pool],
        watch: HealthWatch,
        index: PrefixIndex,
        metrics: Metrics,
        learn: Callable[[Instance], Awaitable[str | None]],
        hold_s: float,
        drain_timeout_s: float,
    ) -> None:
        self.pools, self.watch, self.index, self.metrics = pools, watch, index, metrics
        self.learn, self.hold_s, self.drain_timeout_s = learn, hold_s, drain_timeout_s
        self.subscriptions: dict[str, Subscription] = {}
        self.from_file: set[str] = set()
        self._file_stamp: float | None = None
        self._draining: set[asyncio.Future] = set()

    def everyone(self) -> list[Instance]:
        return self.pools["prefill"].instances + self.pools["decode"].instances

    def subscribe(self, instance: Instance) -> None:
        if instance.kv_events and instance.url not in self.subscriptions:
            blocks = self.index.of(instance.url)
            subscription = Subscription(instance.kv_events, instance.url, blocks, self.metrics)
            self.subscriptions[instance.url] = subscription
            subscription.start()

    async def close(self) -> None:
        for subscription in self.subscriptions.values():
            await subscription.close()
        for task in self._draining:
            task.cancel()

    # -- changes ----------------------------------------------------------------------

    async def add(self, instance: Instance) -> dict:
        known = next((i for i in self.everyone() if i.url == instance.url), None)
        if known is not None and not known.draining:
            raise web.HTTPConflict(text=f"{instance.url} is already a {known.role} instance")
        if known is not None:
            raise web.HTTPConflict(text=f"{instance.url} is draining; add it once it is gone")
        problem = await self.watch.probe(instance)
        self.watch.record(instance, problem, hold_s=self.hold_s)
        learnt = await self.learn(instance)
        self.pools[instance.role].instances.append(instance)
        self.watch.instances.append(instance)
        self.metrics.set("instance_up", 1 if problem is None else 0, instance=instance.url)
        self.subscribe(instance)
        self.metrics.inc("membership_changes", change="added", role=instance.role)
        log.info("kvpush router: added %s instance %s%s", instance.role, instance.url,
                 f" ({problem})" if problem else "")  # fmt: skip
        return {"url": instance.url, "role": instance.role, "healthy": problem is None,
                "identity_problem": learnt}  # fmt: skip

    def start_drain(self, instance: Instance) -> asyncio.Future:
        """No new request for `instance`; the task that forgets it when none is left."""
        pool = self.pools[instance.role]
        if not instance.draining:
            if not any(i is not instance and not i.draining for i in pool.instances):
                raise web.HTTPConflict(
                    text=f"{instance.url} is the last {instance.role} instance taking requests"
                )
            instance.draining = True
            self.metrics.set("instance_draining", 1, instance=instance.url)
            log.info("kvpush router: draining %s instance %s (%d in flight)", instance.role,
                     instance.url, instance.outstanding + len(instance.pending))  # fmt: skip
        task = asyncio.ensure_future(self._forget_when_idle(instance))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)
        return task

    async def _forget_when_idle(self, instance: Instance) -> float:
        started = time.monotonic()
        deadline = started + self.drain_timeout_s
        while instance.outstanding or instance.pending:
            if time.monotonic() > deadline:
                log.warning("kvpush router: %s still has requests in flight after %gs; "
                            "forgetting it anyway", instance.url, self.drain_timeout_s)  # fmt: skip
                break
            await asyncio.sleep(DRAIN_POLL_S)
        if instance not in self.pools[instance.role].instances:
            return time.monotonic() - started  # forgotten by an earlier drain
        self.pools[instance.role].instances.remove(instance)
        if instance in self.watch.instances:
            self.watch.instances.remove(instance)
        subscription = self.subscriptions.pop(instance.url, None)
        if subscription is not None:
            await subscription.close()
        self.index.forget(instance.url)
        self.from_file.discard(instance.url)
        self.metrics.set("instance_draining", 0, instance=instance.url)
        self.metrics.inc("membership_changes", change="drained", role=instance.role)
        log.info("kvpush router: %s instance %s drained and forgotten", instance.role,
                 instance.url)  # fmt: skip
        return time.monotonic() - started

    # -- the file ---------------------------------------------------------------------

    async def reread(self, path: Path) -> None:
        """Add what the file names anew, drain what it no longer names."""
        try:
            stamp = os.stat(path).st_mtime_ns
            if stamp == self._file_stamp:
                return
            listed = read_instances(path)
        except (OSError, ConfigError) as exc:
            self.metrics.inc("instances_file_errors")
            log.warning("kvpush router: instances file %s: %s", path, exc)
            return
        self._file_stamp = stamp
        urls = {i.url for i in listed}
        for instance in listed:
            if not any(i.url == instance.url for i in self.everyone()):
                await self.add(instance)
            self.from_file.add(instance.url)
        for instance in self.everyone():
            if instance.url in self.from_file and instance.url not in urls:
                try:
                    self.start_drain(instance)
                except web.HTTPConflict as exc:
                    log.warning("kvpush router: instances file %s: %s", path, exc.text)

    # -- HTTP -------------------------------------------------------------------------

    async def list_(self, request: web.Request) -> web.Response:
        return web.json_response([
            {"url": i.url, "role": i.role, "outstanding": i.outstanding,
             "computing_tokens": i.computing, "up": i.up,
             "seconds_per_token": i.pace.seconds_per_token(time.monotonic()),
             "state": "draining" if i.draining else "open", "kv_events": i.kv_events,
             "device": i.device}
            for i in self.everyone()
        ])  # fmt: skip

    async def post(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ConfigError("the body must be a JSON object")
            role, url = body.get("role"), body.get("url")
            if role not in ("prefill", "decode") or not isinstance(url, str):
                raise ConfigError('give {"role": "prefill" or "decode", "url": "http://..."}')
            options = ("identity", "kv_events", "device")
            spec = url + "".join(f",{key}={body[key]}" for key in options if body.get(key))
            instance = Instance.parse(spec, role)
        except (ValueError, ConfigError) as exc:
            return _refused(400, f"cannot add an instance: {exc}")
        try:
            return web.json_response(await self.add(instance), status=201)
        except web.HTTPConflict as exc:
            return _refused(409, exc.text or "conflict")

    async def delete(self, request: web.Request) -> web.Response:
        url = unquote(request.match_info.get("url", ""))
        if not url and request.can_read_body:
            try:
                url = (await request.json()).get("url", "")
            except (ValueError, AttributeError):
                return _refused(400, 'give {"url": "http://..."} or DELETE /instances/<url>')
        instance = next((i for i in self.everyone() if i.url == url.rstrip("/")), None)
        if instance is None:
            return _refused(404, f"no instance {url!r} here")
        try:
            task = self.start_drain(instance)
        except web.HTTPConflict as exc:
            return _refused(409, exc.text or "conflict")
        answer = {"url": instance.url, "role": instance.role}
        if request.query.get("wait", "1") == "0":
            return web.json_response({**answer, "state": "draining"}, status=202)
        seconds = await asyncio.shield(task)
        return web.json_response({**answer, "state": "forgotten", "drained_s": seconds})


def _refused(status: int, message: str) -> web.Response:
    return web.json_response(openai_error(message, "invalid_request_error", status), status=status)
