"""Each instance's health as the router's periodic `/health` probes find it.

An instance whose probe fails is not picked until one answers again. The operator
hears of each change once: a WARNING when it goes down, an INFO line when it comes
back, one ejection counted per change, and `instance_up` saying where it stands now.
A probe every few seconds against an instance that stays down says nothing new.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from kvpush.metrics import Metrics
from kvpush.router.instances import Instance

log = logging.getLogger(__name__)

# A probe that takes this long has failed: an instance whose /health hangs must not
# hold up the verdict on every other, as the legs' idle timeout (minutes) would.
PROBE_TIMEOUT_S = 10.0


class HealthWatch:
    def __init__(
        self,
        instances: list[Instance],
        metrics: Metrics,
        http: Callable[[], aiohttp.ClientSession],
    ) -> None:
        self.instances = instances
        self.metrics = metrics
        self._http = http
        for instance in instances:
            self.metrics.set("instance_up", 1, instance=instance.url)

    async def forever(self, interval_s: float) -> None:
        """Probe every instance each interval; one that fails stays out of the pick
        for two intervals, so one probe answering late does not let it flap."""
        while True:
            await asyncio.sleep(interval_s)
            probed = list(self.instances)  # instances come and go meanwhile (membership.py)
            problems = await asyncio.gather(*(self.probe(i) for i in probed))
            for instance, problem in zip(probed, problems, strict=True):
                self.record(instance, problem, hold_s=interval_s * 2)

    async def probe(self, instance: Instance) -> str | None:
        """Why `instance`'s /health is not a 200 now, or None."""
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        try:
            async with self._http().get(instance.url + "/health", timeout=timeout) as response:
                return None if response.status == 200 else f"/health answered {response.status}"
        except asyncio.TimeoutError:
            return f"/health did not answer within {PROBE_TIMEOUT_S:g}s"
        except aiohttp.ClientError as exc:
            return f"/health could not be asked: {exc or type(exc).__name__}"

    def record(self, instance: Instance, problem: str | None, hold_s: float) -> None:
        """One probe's verdict: out of the pick for `hold_s` if it failed; said and
        counted only where it changes the instance's state."""
        if problem is not None:
            instance.ejected_until = max(instance.ejected_until, time.monotonic() + hold_s)
        up = problem is None
        if up == instance.up:
            return
        instance.up = up
        self.metrics.set("instance_up", 1 if up else 0, instance=instance.url)
        if up:
            log.info("kvpush router: %s instance %s is back: /health answers", instance.role,
                     instance.url)  # fmt: skip
            return
        self.metrics.inc("instance_ejections", instance=instance.url, why="health_check")
        log.warning(
            "kvpush router: %s instance %s is down (%s): until its /health answers again "
            "it gets requests only when no other %s instance is up",
            instance.role, instance.url, problem, instance.role,
        )  # fmt: skip
