"""In what order one consumer's WRITEs go to NIXL, chosen once per pairing.

UCX's TCP lane carries every WRITE to a peer on one connection and moves the WRITEs
posted to it side by side. On a link slower than prefill, every request of a burst
then gets its last byte at the end of the burst, and push loses to pull, whose READs
end one after another. There `OldestFirst` posts one NIXL transfer at a time per
consumer, the oldest kvpush transfer's first, so each request's KV lands as soon as
the link can carry it; the link stays as busy, since the next goes as the last one's
completion is polled. Through shared memory or RDMA a WRITE ends within a poll or
two, and waiting for the one before adds only those polls: on one host at 8
requests/s that raised push's TTFT p50 from 289 to 630 ms (docs/benchmarks.md). So
`SideBySide` posts each hand-off at once, and "auto" picks `OldestFirst` only where
UCX will carry the WRITEs over TCP (`tcp_lane`).

Either way a hand-off's WRITEs to one consumer (one forward pass's) share a post, up
to MAX_WRITES_PER_POST, since a batched WRITE's notification lists every transfer
it ends.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpush.errors import KVPushError
from kvpush.protocol.actions import PostWrite
from kvpush.transport.agent import WRITE_ORDERS

MAX_WRITES_PER_POST = 64


@dataclass(frozen=True)
class Family:
    """UCX transports that reach a peer one way, as UCX_TLS names them."""

    members: frozenset[str]
    aliases: frozenset[str] = frozenset()  # names UCX_TLS gives the whole family
    suffix: str = ""  # a transport named so belongs too

    def has(self, name: str) -> bool:
        in_name = bool(self.suffix) and name.endswith(self.suffix)
        return name in self.members or name in self.aliases or in_name


# Within one machine: shared memory, and an accelerator's own IPC ("<device>_ipc").
SHARED_MEMORY = Family(
    frozenset({"posix", "sysv", "xpmem", "cma", "knem"}), frozenset({"sm", "shm", "mm"}), "_ipc"
)
RDMA_TRANSPORTS = {"rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "ud", "ud_v", "ud_x",
                   "ud_verbs", "ud_mlx5", "dc", "dc_x", "dc_mlx5"}  # fmt: skip
RDMA = Family(frozenset(RDMA_TRANSPORTS), frozenset({"ib"}))
TCP = Family(frozenset({"tcp"}))
RDMA_DEVICES = Path("/sys/class/infiniband")

Handed = tuple[float, list[PostWrite]]  # when the WRITEs were handed off, and they


def ucx_allows(family: Family, tls: str) -> bool:
    """Whether UCX_TLS's value `tls` ("" when unset) lets UCX use any of `family`."""
    names = {n.strip().split(":")[0] for n in tls.lstrip("^").split(",") if n.strip()}
    if not names or ("all" in names and not tls.startswith("^")):
        return True
    if not tls.startswith("^"):
        return any(family.has(name) for name in names)
    # "^shm" drops the whole family; "^cma" leaves its other members.
    return not (family.aliases & names or family.members <= names)


def rdma_here() -> bool:
    """Whether this machine has an RDMA device UCX could use."""
    try:
        return any(RDMA_DEVICES.iterdir())
    except OSError:
        return False


def tcp_lane(ours: str, theirs: str, tls: str, rdma: bool) -> bool:
    """Whether UCX will carry WRITEs from machine `ours` to machine `theirs` (their
    boot digests, kvpush.addresses.machine_id; "" where a peer does not say) over TCP,
    given UCX_TLS `tls` and whether this machine has an RDMA device."""
    if not ours or not theirs:
        return False  # not known: keep the order that costs nothing where it is wrong
    if ours == theirs and ucx_allows(SHARED_MEMORY, tls):
        return False
    if rdma and ucx_allows(RDMA, tls):
        return False
    return ucx_allows(TCP, tls)


class SideBySide:
    """Each hand-off posted as it comes, whatever is in flight."""

    name = "side_by_side"

    def __init__(self) -> None:
        self.waiting: list[Handed] = []

    def hand(self, handed: float, writes: list[PostWrite]) -> None:
        self.waiting.append((handed, writes))

    def take(self, writing: bool) -> Handed | None:
        """The next WRITEs to post (None: nothing now); `writing`: one to this
        consumer is in flight."""
        return self._split(0) if self.waiting else None

    def forget(self, transfer_id: str) -> None:
        """`transfer_id` was let go: no WRITE of it comes again."""

    def queued(self) -> int:
        return sum(len(writes) for _, writes in self.waiting)

    def _split(self, index: int) -> Handed:
        """Hand-off `index`, up to the cap; the rest waits at the back."""
        handed, writes = self.waiting.pop(index)
        if len(writes) > MAX_WRITES_PER_POST:
            self.waiting.append((handed, writes[MAX_WRITES_PER_POST:]))
        return handed, writes[:MAX_WRITES_PER_POST]


class OldestFirst(SideBySide):
    """One post in flight per consumer; the next is the hand-off holding the oldest
    transfer (by its first WRITE here), its WRITEs oldest first."""

    name = "oldest_first"

    def __init__(self) -> None:
        super().__init__()
        self._age: dict[str, int] = {}
        self._ages = itertools.count()

    def hand(self, handed: float, writes: list[PostWrite]) -> None:
        for write in writes:
            self._age.setdefault(write.transfer_id, next(self._ages))
        super().hand(handed, sorted(writes, key=self._age_of))

    def take(self, writing: bool) -> Handed | None:
        if writing or not self.waiting:
            return None
        oldest = min(range(len(self.waiting)), key=lambda i: self._age_of(self.waiting[i][1][0]))
        return self._split(oldest)

    def forget(self, transfer_id: str) -> None:
        self._age.pop(transfer_id, None)

    def _age_of(self, write: PostWrite) -> int:
        return self._age.get(write.transfer_id, -1)


def choose(
    setting: str, ours: str, theirs: str, *, ucx: bool, environ: Mapping[str, str] | None = None
) -> SideBySide:
    """The order for WRITEs to a consumer on machine `theirs`, per `write_order`;
    `ucx`: NIXL moves them with its UCX backend."""
    if setting not in WRITE_ORDERS:
        raise KVPushError(f"write_order must be one of {WRITE_ORDERS}, got {setting!r}")
    if setting == "auto":
        if not ucx:
            return SideBySide()
        tls = (os.environ if environ is None else environ).get("UCX_TLS", "")
        setting = "oldest_first" if tcp_lane(ours, theirs, tls, rdma_here()) else "side_by_side"
    return OldestFirst() if setting == "oldest_first" else SideBySide()
