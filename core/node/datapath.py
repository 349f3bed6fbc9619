"""The data path: NIXL transfers between this worker's KV cache and its peers'.

It holds what moving bytes needs — each paired peer's descriptor table, the fences a
WRITE waits on, the blocks a consumer expects, the transfers in flight — and reports
how each transfer ended as Settled records, without knowing the protocol machines.
Everything here runs on the Node's loop thread (the NIXL agent is single-threaded).

A WRITE's grace counts from its hand-off, not its post: the consumer's landing bound
promises that a WRITE the producer handed off lands (or is aborted) within it, so one
that waited out its grace behind others to the same consumer (kvpush.node.write_order)
fails unposted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.backend import DeviceKV
from kvpush.backend.plugins import Backends
from kvpush.errors import KVPushError, TransportError
from kvpush.layout import BlockTable, KVLayout, Unit, blocks_of, plan, units
from kvpush.node import write_order
from kvpush.node.interpreter import MetricsSink, Settled
from kvpush.protocol import actions as act
from kvpush.protocol.messages import join_notifs
from kvpush.transport.agent import NixlAgent, PreparedList, Transfer

log = logging.getLogger(__name__)


@dataclass
class Route:
    """How to address one paired peer's KV cache."""

    peer: str  # the link's name for it
    agent_peer: str  # the peer's NIXL agent name
    local: tuple[Unit, ...]  # our units, aligned with the peer's (kvpush.layout.plan)
    table: BlockTable  # the peer's units' descriptor rows
    prepared: PreparedList
    mem_type: str  # of the peer's KV
    metadata: bytes  # the peer's NIXL metadata, loaded again to reconnect


@dataclass(frozen=True)
class _Part:
    """One kvpush transfer's rows in a NIXL transfer."""

    transfer_id: str
    local_ids: np.ndarray
    remote_ids: np.ndarray
    nbytes: int
    notif: bytes


@dataclass
class _InFlight:
    """One NIXL transfer and the kvpush transfers it carries, with their bytes.

    A READ carries one; a WRITE carries every transfer one hand-off made ready for
    the same consumer (a forward pass's batch), so a layer costs one post, not one
    per request.
    """

    transfer: Transfer
    peer: str  # the link peer whose memory it reads or writes
    posted: float
    deadline: float
    parts: list[tuple[str, int]]


class DataPath:
    """Moves KV for one worker rank: routes, fences, staging and transfers in flight."""

    def __init__(
        self,
        agent: NixlAgent,  # or a test's fake with the same methods
        kv: DeviceKV,
        backends: Backends,
        metrics: MetricsSink,
        write_grace_s: float,
        clock: Callable[[], float] = time.monotonic,
        order: Callable[[str], write_order.SideBySide] = lambda machine: write_order.SideBySide(),
    ) -> None:
        self.agent = agent
        self.kv = kv
        self.backends = backends
        self.metrics = metrics
        self.write_grace_s = write_grace_s
        self.clock = clock
        self.order = order  # a consumer's machine -> how its WRITEs are posted
        self.agent_metadata = agent.metadata()  # what peers load to reach our memory
        self.routes: dict[str, Route] = {}  # link peer -> how to reach its memory
        self._notifiers: dict[str, str] = {}  # NIXL agent name -> link peer (outgoing)
        self._local_tables: dict[tuple[Unit, ...], tuple[BlockTable, PreparedList]] = {}
        # NIXL agent name -> what gone links prepared for it, released (and the NIXL
        # peer dropped, if no link uses it) once no transfer moves bytes with it.
        self._retiring: dict[str, list[PreparedList]] = {}
        self._fences: dict[str, dict[int, Any]] = {}  # transfer -> layers ready -> fence
        self._expected: dict[str, tuple[list[int], float]] = {}
        # NIXL agents a WRITE to failed outright: reconnected before the next post.
        self._broken: set[str] = set()
        self.writes: list[_InFlight] = []
        self.reads: list[_InFlight] = []
        self._orders: dict[str, write_order.SideBySide] = {}  # link peer -> its WRITEs' order
        self._whole = tuple(units(kv.layout, split=False))
        self.local(self._whole)

    # -- peers -------------------------------------------------------------------------

    def pair(
        self,
        peer: str,
        agent_name: str,
        layout: KVLayout,
        metadata: bytes,
        notifies: bool,
        machine: str = "",
    ) -> None:
        """Load a peer's NIXL metadata and prepare its descriptor table. `notifies`:
        its NIXL notifications reach us (we dialled it, so it writes to us); `machine`:
        where it runs (kvpush.addresses.machine_id), which orders our WRITEs to it."""
        added = agent_name not in self.agent.peers
        # Already paired over another link (a kv_both peer dialled us too): agent
        # names carry the boot epoch, so it is the same incarnation; share it.
        agent_peer = self.agent.add_peer(metadata) if added else agent_name
        try:
            # We dialled it: it produces into our memory; else we produce into its.
            ours, theirs = (
                plan(layout, self.kv.layout)[::-1] if notifies else plan(self.kv.layout, layout)
            )
            table = BlockTable(layout, layout_units=theirs)
            prepared = self.agent.prepare(table.rows, layout.mem_type, agent_peer)
            self.local(tuple(ours))
        except Exception:
            if added:
                self._forget_agent(agent_peer)
            raise
        self.routes[peer] = Route(
            peer, agent_peer, tuple(ours), table, prepared, layout.mem_type, metadata
        )
        if notifies:
            self._notifiers[agent_peer] = peer
        else:
            order = self.order(machine)
            self.metrics.inc("paired_consumers", write_order=order.name)
            for handed, writes in self._orders.pop(peer, write_order.SideBySide()).waiting:
                order.hand(handed, writes)
            self._orders[peer] = order

    def unpair(self, peer: str) -> None:
        """The link to `peer` is gone: release its descriptor table, and its NIXL
        peer, once nothing uses them."""
        route = self.routes.pop(peer, None)
        order = self._orders.get(peer)
        if order is not None and not order.waiting:  # else its WRITEs fail as they come up
            self._orders.pop(peer)
        if route is None:
            return
        self._retiring.setdefault(route.agent_peer, []).append(route.prepared)
        self._retire(route.agent_peer)

    def _retire(self, agent_peer: str) -> None:
        if self._in_flight_to(agent_peer):
            return  # a transfer still uses its table: again when that one settles
        self._release(self._retiring.pop(agent_peer, []))
        if not any(r.agent_peer == agent_peer for r in self.routes.values()):
            self._forget_agent(agent_peer)

    def _forget_agent(self, agent_peer: str) -> None:
        self._notifiers.pop(agent_peer, None)
        self._remove_peer(agent_peer)

    def _in_flight_to(self, agent_peer: str) -> bool:
        return any(f.transfer.peer == agent_peer for f in [*self.writes, *self.reads])

    def _release(self, lists: list[PreparedList]) -> None:
        for prepared in lists:
            try:
                self.agent.release_list(prepared)
            except Exception as exc:
                log.debug("kvpush: releasing a NIXL descriptor list: %s", exc)

    def _remove_peer(self, agent_peer: str) -> None:
        try:
            self.agent.remove_peer(agent_peer)
        except TransportError as exc:  # already gone
            log.debug("kvpush: removing NIXL peer %s: %s", agent_peer, exc)

    def _reconnect(self, agent_peer: str) -> None:
        """A WRITE to `agent_peer` (or a READ from it) failed outright: the UCX
        endpoint it used may have died with its network route (a short cut) while the
        side channel held. Load the peer's metadata again, so the next post opens a
        fresh endpoint, and prepare its descriptor tables anew. Transfers still in
        flight to it keep the old endpoint: it waits until they settled."""
        if agent_peer not in self._broken or self._in_flight_to(agent_peer):
            return
        routes = [route for route in self.routes.values() if route.agent_peer == agent_peer]
        self._release([r.prepared for r in routes] + self._retiring.pop(agent_peer, []))
        self._remove_peer(agent_peer)  # loading it again is what matters
        self.agent.add_peer(routes[0].metadata)
        for route in routes:
            route.prepared = self.agent.prepare(route.table.rows, route.mem_type, agent_peer)
        self._broken.discard(agent_peer)
        self.metrics.inc("reconnects")

    def local(self, layout_units: tuple[Unit, ...]) -> tuple[BlockTable, PreparedList]:
        """Our own descriptor table for these units (a pairing's plan), prepared once."""
        if layout_units not in self._local_tables:
            table = BlockTable(self.kv.layout, layout_units=list(layout_units))
            prepared = self.agent.prepare(table.rows, self.kv.layout.mem_type)
            self._local_tables[layout_units] = (table, prepared)
        return self._local_tables[layout_units]

    # -- what the engine said ------------------------------------------------------------

    def expect(self, transfer_id: str, block_ids: list[int]) -> None:
        """These blocks will receive `transfer_id`'s KV."""
        self._expected[transfer_id] = (block_ids, self.clock())

    def add_fence(self, transfer_id: str, upto: int, fence: Any) -> bool:
        """Layers 0..upto-1 are computed, their last device write marked by `fence`;
        True the first time the transfer is seen."""
        first = transfer_id not in self._fences
        fences = self._fences.setdefault(transfer_id, {})
        if fence is not None:
            fences[upto] = fence
        return first

    def drop_fences(self, transfer_id: str) -> None:
        """The producer let `transfer_id` go: no WRITE of it will be posted again."""
        self._fences.pop(transfer_id, None)
        for order in self._orders.values():
            order.forget(transfer_id)

    def drop_expected(self, transfer_id: str) -> None:
        self._expected.pop(transfer_id, None)

    # -- actions ---------------------------------------------------------------------------

    def expose(self, transfer_id: str, block_ids: list[int]) -> None:
        """A READ copies whatever the memory holds: make it the finished KV first."""
        self._wait_fences(transfer_id, len(self.kv.layout.layers))
        self.backends.stage(self.kv, block_ids, "to_host")

    def landed(self, transfer_id: str) -> int:
        """The KV of `transfer_id` is in our memory: stage it onto the device; its bytes."""
        blocks, started = self._expected.pop(transfer_id, ([], self.clock()))
        self.backends.stage(self.kv, blocks, "to_device")
        self.metrics.observe("consumer_wait_seconds", self.clock() - started)
        # Counted from our own layout: the notification that delivers a push transfer
        # often beats the Complete message that carries the producer's count.
        table, _ = self.local(self._whole)
        return int(table.rows[table.ids(blocks), 1].sum()) if blocks else 0

    def post_writes(self, writes: list[act.PostWrite]) -> list[Settled]:
        """Hand off one batch of WRITEs: to each consumer, posted in its order
        (kvpush.node.write_order), as one NIXL transfer where they go together."""
        by_peer: dict[str, list[act.PostWrite]] = {}
        for write in writes:
            by_peer.setdefault(write.peer, []).append(write)
        settled: list[Settled] = []
        handed = self.clock()
        for peer, group in by_peer.items():
            self._orders.setdefault(peer, write_order.SideBySide()).hand(handed, group)
            settled += self._post_next(peer)
        return settled

    def post_queued(self) -> list[Settled]:
        """Post what each consumer's order lets go now that transfers ended: call it
        after handing back what progress() settled, so that a transfer's follow-up
        WRITE, handed off then, can go before a younger transfer's."""
        settled: list[Settled] = []
        for peer in [peer for peer, order in self._orders.items() if order.waiting]:
            settled += self._post_next(peer)
        return settled

    def _post_next(self, peer: str) -> list[Settled]:
        """Post `peer`'s WRITEs while its order lets them go; a WRITE past its grace
        fails unposted (may not land), so the producer may retry it."""
        order = self._orders[peer]
        settled: list[Settled] = []
        while (batch := order.take(any(f.peer == peer for f in self.writes))) is not None:
            handed, group = batch
            if self.clock() > handed + self.write_grace_s:
                detail = (f"waited over {self.write_grace_s:g} s behind older transfers' "
                          "WRITEs to this consumer; not posted")  # fmt: skip
                settled += [Settled("WRITE", w.transfer_id, peer, False, detail) for w in group]
                continue
            settled += self._post_write_group(peer, group, handed)
        if peer not in self.routes and not order.waiting:
            self._orders.pop(peer, None)
        return settled

    def _post_write_group(
        self, peer: str, group: list[act.PostWrite], handed: float
    ) -> list[Settled]:
        """Fence and stage each WRITE's source, then post them as one; a WRITE that
        cannot go fails alone, the rest still go."""
        route = self.routes.get(peer)
        problem = self._reconnect_problem(route, "consumer")
        if problem:
            return [Settled("WRITE", write.transfer_id, peer, False, problem) for write in group]
        settled: list[Settled] = []
        parts: list[_Part] = []
        for write in group:
            try:
                if route is None:
                    raise TransportError("WRITE", "the consumer's session is gone", peer)
                self._wait_fences(write.transfer_id, write.layers[1])
                pages = self.local(route.local)[0].pages  # ids are pages of this pairing
                self.backends.stage(self.kv, blocks_of(write.src_blocks, pages), "to_host")
                parts.append(self._part(route, write.transfer_id, write.src_blocks,
                                        write.dst_blocks, write.layers, write.notif))  # fmt: skip
            except Exception as exc:  # fencing, staging or descriptors: nothing was posted
                if not isinstance(exc, KVPushError):
                    log.error("kvpush: preparing a WRITE failed", exc_info=True)
                settled.append(Settled("WRITE", write.transfer_id, peer, False, str(exc)))
        if not parts:
            return settled
        assert route is not None
        try:
            flight = self._post(self.writes, "WRITE", route, parts, handed)
        except Exception as exc:  # NIXL refused the post: nothing is in flight
            self._broken.add(route.agent_peer)
            failed = [Settled("WRITE", p.transfer_id, peer, False, str(exc)) for p in parts]
            return settled + failed
        return settled + self._settle_if_finished(self.writes, flight)

    def post_read(self, read: act.PostRead) -> list[Settled]:
        route = self.routes.get(read.peer)
        problem = self._reconnect_problem(route, "producer")
        if problem:
            return [Settled("READ", read.transfer_id, read.peer, False, problem)]
        try:
            if route is None:
                raise TransportError("READ", "the producer's session is gone", read.peer)
            part = self._part(route, read.transfer_id, read.local_blocks,
                              read.remote_blocks, None, b"")  # fmt: skip
        except Exception as exc:  # descriptors: nothing was posted
            return [Settled("READ", read.transfer_id, read.peer, False, str(exc))]
        try:
            flight = self._post(self.reads, "READ", route, [part])
        except Exception as exc:  # NIXL refused the post: nothing is in flight
            self._broken.add(route.agent_peer)
            return [Settled("READ", read.transfer_id, read.peer, False, str(exc))]
        return self._settle_if_finished(self.reads, flight)

    def _reconnect_problem(self, route: Route | None, whose: str) -> str:
        """Reconnect `route`'s NIXL peer if a transfer to it failed outright; why that
        failed ("": it did not, or had no need). It stays broken then: the next post
        tries again."""
        try:
            if route is not None:
                self._reconnect(route.agent_peer)
        except Exception as exc:
            return f"reconnecting to the {whose}'s NIXL agent failed: {exc}"
        return ""

    def _part(
        self,
        route: Route,
        transfer_id: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        layers: tuple[int, int] | None,
        notif: bytes,
    ) -> _Part:
        """One transfer's share of a NIXL transfer: its rows on both sides."""
        local_table, _ = self.local(route.local)
        local_ids = local_table.ids(local_blocks, layers)
        remote_ids = route.table.ids(remote_blocks, layers)
        nbytes = int(local_table.rows[local_ids, 1].sum())
        return _Part(transfer_id, local_ids, remote_ids, nbytes, notif)

    def _post(
        self,
        table: list[_InFlight],
        op: str,
        route: Route,
        parts: list[_Part],
        since: float | None = None,
    ) -> _InFlight:
        """Post one NIXL transfer; its grace runs from `since` (a WRITE's hand-off),
        else from now."""
        _, local_list = self.local(route.local)
        local_ids = np.concatenate([part.local_ids for part in parts])
        remote_ids = np.concatenate([part.remote_ids for part in parts])
        notif = join_notifs([part.notif for part in parts if part.notif])
        nbytes = sum(part.nbytes for part in parts)
        started = self.clock()
        transfer = self.agent.post(
            op, local_list, local_ids, route.prepared, remote_ids, notif, nbytes
        )
        posted = self.clock()
        self.metrics.observe("post_seconds", posted - started)
        sizes = [(part.transfer_id, part.nbytes) for part in parts]
        deadline = (started if since is None else since) + self.write_grace_s
        flight = _InFlight(transfer, route.peer, posted, deadline, sizes)
        table.append(flight)
        return flight

    def _wait_fences(self, transfer_id: str, upto: int) -> None:
        """Wait on the fence of every layer the WRITE reads.

        Each, not just the latest: a backend's fence may cover only its own layer.
        A fence is forgotten only once its wait returned: after a failed wait the
        KV may not be written yet, and a retry of the WRITE must wait again.
        """
        fences = self._fences.get(transfer_id, {})
        for layers in sorted(layers for layers in fences if layers <= upto):
            self.backends.wait_fence(self.kv, fences[layers])
            del fences[layers]

    # -- progress ----------------------------------------------------------------------

    def busy(self) -> bool:
        """NIXL transfers of ours are in flight."""
        return bool(self.writes or self.reads)

    def progress(self) -> list[Settled]:
        """Every finished, failed or overdue transfer, settled."""
        now = self.clock()
        settled = self._check(self.writes, now) + self._check(self.reads, now)
        for agent_peer in list(self._retiring):
            self._retire(agent_peer)
        return settled

    def notifs(self) -> list[tuple[str, bytes]]:
        """NIXL notifications since the last call, as (link peer, message); those from
        agents we did not dial are counted and dropped."""
        try:
            batch = self.agent.notifs()
        except TransportError as exc:
            log.warning("kvpush: polling notifications: %s", exc)
            return []
        known = []
        for agent_peer, message in batch:
            peer = self._notifiers.get(agent_peer)
            if peer is None:
                self.metrics.inc("rejected_notifs", why="unknown_agent")
            else:
                known.append((peer, message))
        return known

    def _settle_if_finished(self, table: list[_InFlight], flight: _InFlight) -> list[Settled]:
        """A transfer that completed inside its posting call ends now, not at the next poll."""
        if not flight.transfer.finished:
            return []
        table.remove(flight)
        return self._succeeded(flight, self.clock())

    def _succeeded(self, flight: _InFlight, now: float) -> list[Settled]:
        try:
            self.agent.release(flight.transfer)
        except Exception as exc:  # the bytes moved; a handle NIXL keeps must not undo that
            log.warning("kvpush: releasing a finished %s: %s", flight.transfer.op, exc)
        self.metrics.observe("transfer_seconds", now - flight.posted)
        self.metrics.inc("bytes_moved", flight.transfer.nbytes, op=flight.transfer.op)
        return _settled(flight, True)

    def _check(self, table: list[_InFlight], now: float) -> list[Settled]:
        settled: list[Settled] = []
        for flight in list(table):
            try:
                done = self.agent.done(flight.transfer)
            except TransportError as exc:
                table.remove(flight)
                self._broken.add(flight.transfer.peer)
                settled += _settled(flight, False, str(exc))
                continue
            except Exception as exc:  # a bug below us: the transfer's state is unknown
                table.remove(flight)
                log.error("kvpush: checking a %s: %s", flight.transfer.op, exc, exc_info=True)
                self._abandon(flight.transfer)
                settled += _settled(flight, False, f"checking it failed: {exc}", may_land=True)
                continue
            if done:
                table.remove(flight)
                settled += self._succeeded(flight, now)
            elif now > flight.deadline:
                table.remove(flight)
                self._abandon(flight.transfer)
                settled += _settled(flight, False, "timed out", may_land=True)
        return settled

    def _abandon(self, transfer: Transfer) -> None:
        # Releasing an unfinished transfer asks NIXL to abort it.
        try:
            self.agent.release(transfer)
        except Exception as exc:
            log.warning("kvpush: aborting a stuck %s: %s", transfer.op, exc)

    def counts(self) -> dict[str, int]:
        return {
            "writes_in_flight": len(self.writes),
            "writes_queued": sum(order.queued() for order in self._orders.values()),
            "reads_in_flight": len(self.reads),
            "fences_held": len(self._fences),
        }


def _settled(
    flight: _InFlight, ok: bool, detail: str = "", may_land: bool = False
) -> list[Settled]:
    return [
        Settled(flight.transfer.op, tid, flight.peer, ok, detail, nbytes if ok else 0, may_land)
        for tid, nbytes in flight.parts
    ]
