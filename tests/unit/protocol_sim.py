"""A producer and consumers wired through an in-memory network and a fake NIXL.

The simulation keeps block ledgers for both engines and a record of whose bytes sit
in every consumer block, so the checks catch what matters: a block freed twice, a
block leaked, a WRITE landing in a block that is free or belongs to another
transfer, a source block freed while a WRITE still reads it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvpush.errors import BackendError, TransportError
from kvpush.layout import BlockRun, KVLayout
from kvpush.node.interpreter import Interpreter, Outcome, Settled
from kvpush.protocol import actions as act
from kvpush.protocol.config import ProtocolConfig
from kvpush.protocol.consumer import Consumer, Source
from kvpush.protocol.handshake import unexpected_producer
from kvpush.protocol.messages import Hello, Identity
from kvpush.protocol.producer import Producer
from kvpush.regions import MemRegion

PRODUCER = "prefill:7000"


def layout(num_blocks: int, base: int = 0x100000, groups: int = 1, null: int = -1) -> KVLayout:
    region = MemRegion(base, num_blocks * 1024)
    return KVLayout(
        (region,), ((BlockRun(base, 1024, 1024, "mixed"),),), num_blocks, 16, "f32", "x",
        groups=groups, null_block=null,
    )  # fmt: skip


def hello(
    role: str,
    mode: str,
    blocks: int,
    name: str,
    base: int,
    config: ProtocolConfig,
    groups: int = 1,
    null: int = -1,
) -> Hello:
    return Hello(
        identity=Identity(name, 0, 1, "epoch1"),
        mode=mode,
        role=role,
        agent_name=name,
        layout_digest=layout(blocks, base, groups, null).digest(),
        nonce=b"n" * 16,
        lease_s=config.lease_s,
        registration_ttl_s=config.registration_ttl_s,
        silence_s=config.silence_s,
        heartbeat_s=config.heartbeat_s,
    )


class Ledger:
    """Blocks of one engine: each allocated to one owner, freed exactly once."""

    def __init__(self, side: str, size: int, null: int = -1) -> None:
        self.side = side
        self.free = [b for b in range(size) if b != null]  # the null block is no one's
        self.owner: dict[int, str] = {}
        self.live: set[str] = set()
        self.errors: list[str] = []

    def alloc(self, owner: str, count: int) -> list[int]:
        self.live.add(owner)
        blocks, self.free = self.free[:count], self.free[count:]
        assert len(blocks) == count, f"{self.side}: out of blocks"
        for block in blocks:
            self.owner[block] = owner
        return blocks

    def release(self, owner: str) -> None:
        if owner not in self.live:
            self.errors.append(f"{self.side}: {owner} freed twice or never allocated")
        self.live.discard(owner)
        blocks = [b for b, o in self.owner.items() if o == owner]
        for block in blocks:
            del self.owner[block]
            self.free.append(block)

    def free_block(self, owner: str, block: int) -> None:
        """One block of `owner` back early (a sliding window has left it)."""
        if self.owner.get(block) != owner:
            self.errors.append(f"{self.side}: block {block} freed by {owner}, who lacks it")
            return
        del self.owner[block]
        self.free.append(block)

    def holds(self, owner: str, blocks: list[int]) -> bool:
        return all(self.owner.get(b) == owner for b in blocks)


@dataclass
class ConsumerSide:
    name: str
    machine: Consumer
    hello: Hello
    layout: KVLayout
    ledger: Ledger
    # (block, layer) -> (transfer id, the producer block it came from)
    memory: dict[tuple[int, int], tuple[str, int]] = field(default_factory=dict)
    expected: dict[str, list[int]] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # tid -> leading blocks held here
    delivered: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    reads: dict[str, act.PostRead] = field(default_factory=dict)
    interpreter: Interpreter | None = None


class _Recorder:
    """Metrics as the simulation keeps them: every count, in order."""

    def __init__(self, counted: list[act.Counted]) -> None:
        self.counted = counted

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        self.counted.append(act.Counted(name, labels))

    def observe(self, name: str, seconds: float) -> None:
        pass


class _Ports:
    """What neither simulated engine tracks: fences and expected blocks."""

    def drop_expected(self, transfer_id: str) -> None:
        pass

    def drop_fences(self, transfer_id: str) -> None:
        pass


class _ProducerPorts(_Ports):
    """The prefill engine's links and data path: the network queue and its ledger."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    def send(self, peer: str, message: object) -> None:
        if peer not in self.sim.half_closed:
            self.sim.network.append((peer, "producer", message))

    def connect(self, peer: str, engine: str = "", epoch: str = "") -> None:
        self.sim.errors.append(f"the producer dialled {peer}")

    def disconnect(self, peer: str, reason: str) -> None:
        sim = self.sim
        sim.disconnected.append(peer)
        if peer in sim.half_closed or sim.partitioned:
            # The consumer's end is gone already, or our close cannot reach it.
            sim.half_closed.discard(peer)
            sim._run_producer(sim.producer.on_peer_lost(peer, reason, sim.now))
        else:
            sim.kill_link(peer)

    def post_writes(self, writes: list[act.PostWrite]) -> list[Settled]:
        sim = self.sim
        if sim.strike("post"):
            raise TransportError("WRITE", "injected fault: the post failed")
        for write in writes:
            if write.transfer_id in sim.writes:
                sim.errors.append(f"two WRITEs in flight for {write.transfer_id}")
            sim.writes[write.transfer_id] = (write.peer, write)
            sim.posted_at[write.transfer_id] = sim.now
        return []

    def post_read(self, read: act.PostRead) -> list[Settled]:
        self.sim.errors.append(f"the producer posted a READ for {read.transfer_id}")
        return []

    def expose(self, transfer_id: str, block_ids: list[int]) -> None:
        if self.sim.strike("stage"):
            raise BackendError("injected fault: staging for a READ failed")
        # A position a consumer's window has left is never read: the block there may
        # be one the engine freed already (staging it copies bytes no one takes).
        claims = [s.expected[transfer_id] for s in self.sim.consumers.values()
                  if transfer_id in s.expected]  # fmt: skip
        wanted = block_ids if not claims else [
            block for claim in claims
            for block, dst in zip(block_ids, claim, strict=False) if dst != self.sim.null
        ]  # fmt: skip
        if not self.sim.p_ledger.holds(transfer_id, wanted):
            self.sim.errors.append(f"{transfer_id} exposed blocks it does not hold")

    def landed(self, transfer_id: str) -> int:
        self.sim.errors.append(f"the producer was delivered {transfer_id}")
        return 0

    def publish(self, outcome: Outcome) -> None:
        sim, tid = self.sim, outcome.transfer_id
        if outcome.kind == "chunk_sent":
            sim.chunks_sent.append(tid)
            return
        if outcome.kind == "release_refused":
            sim.kept[tid] = outcome.reason
            return
        if outcome.kind != "released":
            sim.errors.append(f"the producer reported {outcome.kind} for {tid}")
            return
        if tid in sim.writes:
            sim.errors.append(f"{tid} released during its WRITE")
        if tid in sim.released:
            sim.errors.append(f"{tid} released twice by the producer")
        sim.released[tid] = outcome.reason
        if not sim.engine_frees:
            sim.p_ledger.release(tid)


class _ConsumerPorts(_Ports):
    """A decode engine's links and data path: the network, its ledger and memory."""

    def __init__(self, sim: Sim, side: ConsumerSide) -> None:
        self.sim = sim
        self.side = side

    def send(self, peer: str, message: object) -> None:
        self.sim.network.append(("producer", self.side.name, message))

    def disconnect(self, peer: str, reason: str) -> None:
        self.sim.errors.append(f"{self.side.name} dropped {peer}: {reason}")

    def connect(self, peer: str, engine: str = "", epoch: str = "") -> None:
        # As Links does: a producer that is not the one named gets nothing of ours.
        problem = unexpected_producer(self.sim.producer_hello, engine, epoch)
        self.sim._handshake(self.side, problem)

    def post_writes(self, writes: list[act.PostWrite]) -> list[Settled]:
        self.sim.errors.append(f"{self.side.name} posted WRITEs")
        return []

    def post_read(self, read: act.PostRead) -> list[Settled]:
        if self.sim.strike("post"):  # as DataPath does: nothing posted, failed at once
            return [Settled("READ", read.transfer_id, read.peer, False, "injected fault")]
        self.side.reads[read.transfer_id] = read
        return []

    def expose(self, transfer_id: str, block_ids: list[int]) -> None:
        self.sim.errors.append(f"{self.side.name} exposed {transfer_id}")

    def landed(self, transfer_id: str) -> int:
        if self.sim.strike("stage"):
            raise BackendError("injected fault: staging onto the device failed")
        return 0

    def publish(self, outcome: Outcome) -> None:
        sim, side, tid = self.sim, self.side, outcome.transfer_id
        if outcome.kind == "delivered":
            sim._end(side, tid)
            # Block i of the claim holds the producer's block skip + i, in every layer.
            sources = sim.p_blocks.get(tid, [])[side.skipped.get(tid, 0) :]
            wrong = [
                (b, layer)
                for i, b in enumerate(side.expected[tid])
                for layer in range(sim.layers)
                if b != sim.null
                and side.memory.get((b, layer)) != (tid, sources[i] if i < len(sources) else None)
            ]
            if wrong:
                sim.errors.append(f"{tid} delivered but blocks {wrong} hold other bytes")
            if tid in sim.stale_reads:
                sim.errors.append(f"{tid} delivered bytes read from freed producer blocks")
            side.delivered.append(tid)
            side.ledger.release(tid)  # the request ran and finished with its blocks
        elif outcome.kind == "failed":
            sim._end(side, tid)
            side.failed[tid] = outcome.reason
            side.ledger.release(tid)
        else:
            sim.errors.append(f"{side.name} reported {outcome.kind} for {tid}")


class Sim:
    def __init__(
        self,
        mode: str = "push",
        config: ProtocolConfig | None = None,
        consumers: int = 1,
        producer_blocks: int = 64,
        consumer_blocks: int = 64,
        handshake_ok: bool = True,
        layers: int = 1,
        engine_frees: bool = False,
        groups: int = 1,
        null: int = -1,
    ) -> None:
        self.config = config or ProtocolConfig(
            mode=mode,
            lease_s=10,
            registration_ttl_s=10,
            watchdog_s=8,
            heartbeat_s=1,
            write_grace_s=2,
            landing_s=3,
            tombstone_s=60,
            max_wait_s=40,
            orphan_grace_s=3,
            silence_s=4,
        )
        self.mode = self.config.mode
        # Whether the prefill engine frees its blocks itself (an engine model drives
        # the simulation), or they go back the moment the producer releases them.
        self.engine_frees = engine_frees
        self.now = 0.0
        self.handshake_ok = handshake_ok
        self.layers = layers
        # KV cache groups interleaved in each block list, `null` padding the positions
        # a sliding window left (kvpush.layout); -1: one group, every id a block.
        self.null = null
        self.producer = Producer(self.config, num_layers=layers, null_block=null)
        self.producer_hello = hello(
            "producer", self.mode, producer_blocks, "prefill", 0x100000, self.config, groups, null
        )
        self.producer_layout = layout(producer_blocks, 0x100000, groups, null)
        self.p_ledger = Ledger("producer", producer_blocks, null)
        self.kv_ready: set[str] = set()
        self.p_blocks: dict[str, list[int]] = {}  # tid -> its producer blocks, in order
        self.last_step: set[str] = set()  # tids whose last prompt step was reported
        self.chunks_sent: list[str] = []  # a WRITE of an earlier chunk's KV ended
        self.released: dict[str, str] = {}
        self.kept: dict[str, str] = {}  # the router's releases refused, and why
        self.consumers: dict[str, ConsumerSide] = {}
        for i in range(consumers):
            name = f"decode{i}"
            base = 0x900000 + i * 0x100000
            h = hello("consumer", self.mode, consumer_blocks, name, base, self.config, groups, null)
            machine = Consumer(self.config, h.layout_digest, null_block=null)
            self.consumers[name] = ConsumerSide(
                name, machine, h, layout(consumer_blocks, base, groups, null),
                Ledger(name, consumer_blocks, null),
            )  # fmt: skip
        self.network: deque[tuple[str, str, object]] = deque()  # (to, from, message)
        self.writes: dict[str, tuple[str, act.PostWrite]] = {}
        self.posted_at: dict[str, float] = {}
        self.notifs: deque[tuple[str, bytes]] = deque()
        self.counted: list[act.Counted] = []
        self.errors: list[str] = []
        self.partitioned = False  # while True, every message sent is lost
        self.half_closed: set[str] = set()  # consumers whose link only they saw break
        self.disconnected: list[str] = []  # consumers the producer dropped as silent
        self.armed: list[str] = []  # data-path calls ("post", "stage") to fail next
        # While True, a consumer's dial waits in `dialling` until complete_handshakes().
        self.slow_handshakes = False
        self.dialling: list[ConsumerSide] = []
        self.stale_reads: set[str] = set()  # READs that copied freed producer blocks
        # Each engine runs one machine; the other half of its Node stays idle.
        self.idle_producer = Producer(self.config, num_layers=layers)
        self.idle_consumer = Consumer(self.config, self.producer_hello.layout_digest)
        self.producer_interpreter = self._interpreter(_ProducerPorts(self))
        for side in self.consumers.values():
            side.interpreter = self._interpreter(_ConsumerPorts(self, side))

    @property
    def c(self) -> ConsumerSide:
        return next(iter(self.consumers.values()))

    # -- engine events ----------------------------------------------------------------

    def announce(self, tid: str, consumer: str | None = None) -> None:
        """A decode request for `tid` arrived; its blocks are not allocated yet."""
        side = self.consumers[consumer] if consumer else self.c
        self._run_consumer(side, side.machine.announce(tid, PRODUCER, self.now))

    def expect(self, tid: str, blocks: int = 4, consumer: str | None = None, skip: int = 0):
        side = self.consumers[consumer] if consumer else self.c
        ids = side.ledger.alloc(tid, blocks)
        side.expected[tid] = ids
        side.skipped[tid] = skip
        self._run_consumer(side, side.machine.expect(tid, [Source(PRODUCER)], ids, self.now, skip))
        return ids

    def ready(self, tid: str, blocks: int = 4, layers: int | None = None) -> list[int]:
        """The last step of `tid`'s prompt ran, up to `layers` layers (all by default):
        it holds `blocks` blocks in all."""
        # The last step's layer reports all name the blocks it ran with.
        ids = list(self.p_blocks[tid]) if tid in self.last_step else self._blocks(tid, blocks)
        self.last_step.add(tid)
        self._run_producer(self.producer.kv_ready(tid, ids, self.now, layers=layers))
        return ids

    def progress(self, tid: str, blocks: int, full: int) -> list[int]:
        """A step computed part of `tid`'s prompt (chunked prefill): it holds `blocks`
        blocks so far, the first `full` complete."""
        ids = self._blocks(tid, blocks)
        self._run_producer(self.producer.kv_progress(tid, ids, full, self.now))
        return ids

    def _blocks(self, tid: str, count: int) -> list[int]:
        """`tid`'s producer blocks, allocating more as its prompt grows."""
        if tid not in self.p_blocks:
            self.p_blocks[tid] = self.p_ledger.alloc(tid, count)
        elif count > len(self.p_blocks[tid]) and tid not in self.released:
            # (After its release the ledger has let them go; growth is not modelled.)
            self.p_blocks[tid] += self.p_ledger.alloc(tid, count - len(self.p_blocks[tid]))
        self.kv_ready.add(tid)
        return list(self.p_blocks[tid])

    def pending(self, tid: str, sequential: bool = False) -> None:
        self._run_producer(self.producer.kv_pending(tid, self.now, sequential))

    def abort_consumer(self, tid: str, consumer: str | None = None) -> None:
        side = self.consumers[consumer] if consumer else self.c
        self._run_consumer(side, side.machine.abort(tid, self.now))

    def abort_producer(self, tid: str) -> None:
        self._run_producer(self.producer.abort(tid, self.now))

    def router_release(self, tid: str) -> None:
        """The router says `tid`'s decode leg never reached decode's engine."""
        self._run_producer(self.producer.release_unclaimed(tid, self.now))

    # -- the world --------------------------------------------------------------------

    def deliver(self, count: int | None = None) -> int:
        """Deliver queued messages in order (all, or `count` of them)."""
        delivered = 0
        while self.network and (count is None or delivered < count):
            to, sender, message = self.network.popleft()
            delivered += 1
            if self.partitioned:
                continue
            if to == "producer":
                self._run_producer(self.producer.on_message(sender, message, self.now))
            else:
                side = self.consumers[to]
                self._run_consumer(side, side.machine.on_message(PRODUCER, message, self.now))
        return delivered

    def finish_writes(self, ok: bool = True) -> None:
        """Every posted WRITE completes (bytes land) or fails (nothing lands)."""
        for tid, (consumer, post) in list(self.writes.items()):
            del self.writes[tid]
            side = self.consumers[consumer]
            if not self.p_ledger.holds(tid, post.src_blocks):
                self.errors.append(f"WRITE {tid} read source blocks the producer had freed")
            if ok:
                for source, block in zip(post.src_blocks, post.dst_blocks, strict=True):
                    if side.ledger.owner.get(block) != tid:
                        owner = side.ledger.owner.get(block, "the free pool")
                        self.errors.append(f"WRITE {tid} landed in block {block} of {owner}")
                    for layer in range(*post.layers):
                        side.memory[(block, layer)] = (tid, source)
                if post.notif:
                    self.notifs.append((consumer, post.notif))
            result = self.producer.on_write_done(tid, consumer, ok, self.now, "" if ok else "boom")
            self._run_producer(result)

    def finish_reads(self, ok: bool = True) -> None:
        for side in self.consumers.values():
            for tid, post in list(side.reads.items()):
                del side.reads[tid]
                if ok and not self.p_ledger.holds(tid, post.remote_blocks):
                    # Harmless unless the consumer then trusts what it read.
                    self.stale_reads.add(tid)
                if ok:
                    for source, block in zip(post.remote_blocks, post.local_blocks, strict=True):
                        for layer in range(self.layers):
                            side.memory[(block, layer)] = (tid, source)
                self._run_consumer(side, side.machine.on_read_done(tid, PRODUCER, ok, self.now))

    def poll_notifs(self) -> None:
        while self.notifs:
            consumer, notif = self.notifs.popleft()
            side = self.consumers[consumer]
            self._run_consumer(side, side.machine.on_notif(PRODUCER, notif, self.now))

    def advance(self, seconds: float) -> None:
        """Let time pass, one heartbeat at a time, delivering what is sent meanwhile.

        A WRITE still in flight after write_grace_s is aborted, as the Node does.
        """
        target = self.now + seconds
        while self.now < target:
            self.now = min(target, self.now + 0.5)
            for tid in [
                t for t in self.writes if self.now - self.posted_at[t] >= self.config.write_grace_s
            ]:
                consumer, _ = self.writes.pop(tid)
                timed_out = self.producer.on_write_done(tid, consumer, False, self.now, "timed out")
                self._run_producer(timed_out)
            self._run_producer(self.producer.tick(self.now))
            for side in self.consumers.values():
                self._run_consumer(side, side.machine.tick(self.now))
            self.deliver()

    def kill_link(self, consumer: str | None = None) -> None:
        """The side channel between the producer and a consumer breaks; each end
        sees the other's close."""
        side = self.consumers[consumer] if consumer else self.c
        self.network = deque(m for m in self.network if side.name not in (m[0], m[1]))
        self._run_producer(self.producer.on_peer_lost(side.name, "closed", self.now))
        self._run_consumer(side, side.machine.on_peer_lost(PRODUCER, "closed", self.now, True))

    def half_close(self, consumer: str | None = None) -> None:
        """Only the consumer's end sees the link break (a local error, a middlebox):
        the producer still thinks it up, and hears nothing from the consumer again."""
        side = self.consumers[consumer] if consumer else self.c
        self.network = deque(m for m in self.network if side.name not in (m[0], m[1]))
        self.half_closed.add(side.name)
        self._run_consumer(side, side.machine.on_peer_lost(PRODUCER, "send failed", self.now))

    def strike(self, op: str) -> bool:
        """Whether this call of `op` fails: once per time it was armed."""
        if op in self.armed:
            self.armed.remove(op)
            return True
        return False

    def settle(self) -> None:
        """Run everything to quiescence: messages, writes, reads, notifications, timers."""
        for _ in range(200):
            self.deliver()
            self.finish_writes()
            self.finish_reads()
            self.poll_notifs()
            if not (self.network or self.writes or self.notifs or self._reads_pending()):
                self.advance(max(self.config.tombstone_s, 100) + 1)
                if not (self.network or self.writes or self.notifs or self._reads_pending()):
                    return
        raise AssertionError("the simulation did not settle")

    def _reads_pending(self) -> bool:
        return any(side.reads for side in self.consumers.values())

    # -- invariants -------------------------------------------------------------------

    def check(self) -> None:
        """After settle(): every block free exactly once, nothing waiting, no corruption."""
        problems = list(self.errors)
        problems += self.p_ledger.errors
        if self.p_ledger.owner:
            problems.append(f"producer still holds {sorted(set(self.p_ledger.owner.values()))}")
        missing = self.kv_ready - set(self.released)
        if missing:
            problems.append(f"producer never released {sorted(missing)}")
        if self.producer.holding():
            problems.append(f"producer machine still holds {self.producer.holding()}")
        for side in self.consumers.values():
            problems += side.ledger.errors
            if side.ledger.owner:
                problems.append(
                    f"{side.name} still holds {sorted(set(side.ledger.owner.values()))}"
                )
            ended = set(side.delivered) | set(side.failed)
            if set(side.expected) - ended:
                problems.append(f"{side.name} left waiting: {sorted(set(side.expected) - ended)}")
            if side.machine.waiting():
                problems.append(f"{side.name} machine still waits on {side.machine.waiting()}")
        assert not problems, "\n".join(problems)

    # -- action dispatch: the Node's own interpreter, with the simulation as its world ----

    def _run_producer(self, actions: list[act.Action]) -> None:
        self.producer_interpreter.run(actions)

    def _run_consumer(self, side: ConsumerSide, actions: list[act.Action]) -> None:
        assert side.interpreter is not None
        side.interpreter.run(actions)

    def _interpreter(self, ports: _ProducerPorts | _ConsumerPorts) -> Interpreter:
        machines = (self.producer, self.idle_consumer)
        if isinstance(ports, _ConsumerPorts):
            machines = (self.idle_producer, ports.side.machine)
        return Interpreter(*machines, ports, ports, ports.publish, _Recorder(self.counted),
                           clock=lambda: self.now, wall=lambda: 1.0)  # fmt: skip

    def _end(self, side: ConsumerSide, tid: str) -> None:
        if tid in side.delivered or tid in side.failed:
            self.errors.append(f"{tid} ended twice on {side.name}")
        pending = self.writes.get(tid)
        if pending and pending[0] == side.name:
            self.errors.append(f"{tid} ended on {side.name} while a WRITE into it is in flight")

    def complete_handshakes(self) -> None:
        """The dials slow_handshakes held back pair now, and later ones at once."""
        self.slow_handshakes = False
        while self.dialling:
            self._handshake(self.dialling.pop(0))

    def _handshake(self, side: ConsumerSide, problem: str | None = None) -> None:
        if self.slow_handshakes and not problem:
            self.dialling.append(side)
            return
        if not self.handshake_ok or problem:
            why = problem or "refused"
            self._run_consumer(side, side.machine.on_handshake_failed(PRODUCER, why, self.now))
            return
        if side.name in self.half_closed:
            # A new link: the producer's old one to this consumer is a different peer,
            # which falls silent; here, where both share a name, it ends first.
            self.half_closed.discard(side.name)
            self._run_producer(self.producer.on_peer_lost(side.name, "silent", self.now))
        self._run_producer(self.producer.on_ready(side.name, side.hello, side.layout, self.now))
        self._run_consumer(
            side,
            side.machine.on_ready(PRODUCER, self.producer_hello, self.producer_layout, self.now),
        )
