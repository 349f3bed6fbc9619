"""The worker half of KVPushConnector: one kvpush Node per worker rank.

It runs in each vLLM worker process. It describes the engine's KV cache through the
device backends (whatever device the engine runs on), starts the Node, and each
step turns the scheduler's metadata into Node calls: claims and aborts at once,
each layer's KV as the forward pass writes it, the rest when the step ends.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from kvpush.backend.plugins import Backends, get_backends
from kvpush.engine.outcomes import Outcomes
from kvpush.engine.steps import Produce, Progress
from kvpush.errors import ConfigError, KVPushError
from kvpush.layout import Shard, sources
from kvpush.node import Node, NodeConfig, Source
from kvpush.node.interpreter import Outcome
from kvpush.protocol.producer import DECODE_CANCELLED, ROUTER_RELEASED
from kvpush.vllm.config import KV_ROLES, ConnectorConfig, insecure, load_secret, rank_port
from kvpush.vllm.groups import NULL_BLOCK
from kvpush.vllm.hooks import RECORD, Parking, bound_reader_spin
from kvpush.vllm.metadata import KVPushHandshake, KVPushMetadata, KVPushWorkerMeta
from kvpush.vllm.shape import EngineShape
from kvpush.vllm.stats import KVPushStats, node_totals
from kvpush.vllm.wake import LandingNote, Ringer

log = logging.getLogger(__name__)

# Why a transfer ends while vLLM has let go of the KV cache's memory.
KV_CACHE_RELEASED = (
    "kv_cache_released: vLLM let go of the KV cache's memory (sleep, or a weight "
    "update short of memory); kvpush moves no KV until it is restored"
)
# vLLM (>= 0.32) hands every attention layer's cache with the logical shape
# [num_blocks, kv_heads, block_size, K and V packed]; strides say how it really lies.
VLLM_KV_DIMS = ("blocks", "heads", "tokens", "kvdim")
# vLLM's CPU attention does not keep a block's tokens in the rows its logical shape
# shows: it views each head's part as K for the block, then V, and its kernels order
# K inside that by their own tiling. Only a head's whole part of a block has a known
# meaning, so it is described as one opaque run a head: whole blocks and head slices
# (mixed TP) move, and a page of another block size is refused, not guessed at.
VLLM_CPU_DIMS = ("blocks", "heads", "cpu_attention")


def ask_for_amx_tiles() -> None:
    """Ask Linux for the AMX tile state where the CPU has it. vLLM's CPU attention runs
    AMX instructions there (bf16), and a process that has not asked dies of SIGILL on
    its first one. A decode instance whose first step attended over transferred KV had
    not asked: its first request killed the engine (vLLM 0.32.0, a Xeon with AMX)."""
    import torch  # the worker's, loaded already; kvpush itself does not need it

    if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        log.warning(
            "kvpush: this CPU has AMX but Linux refused this process its tile state; "
            "vLLM's bf16 CPU attention may die of SIGILL (serve with --dtype float32)"
        )


def as_head_parts(kv_caches: dict[str, Any]) -> dict[str, Any]:
    """vLLM CPU caches [blocks, heads, tokens, 2 * dim] as [blocks, heads, the rest]
    (a view: it raises rather than copy, should a cache not be laid out so)."""
    return {name: cache.view(*cache.shape[:2], -1) for name, cache in kv_caches.items()}


def one_view_each(
    kv_caches: dict[str, Any], state_layers: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """A hybrid model's KV cache groups overlay the same tensors, one layer of each
    group viewing each: keep one attention view of each tensor, since a pair of block
    ids of any group moves through every tensor (kvpush.vllm.groups). A recurrent
    layer's (`state_layers`) view of its state, or views (conv, then SSM state), must
    lie inside the blocks of such a view, or a block would not carry them."""
    kept: dict[int, tuple[str, Any]] = {}
    for name, cache in kv_caches.items():
        if name in state_layers:
            continue
        first = kept.setdefault(cache.data_ptr(), (name, cache))
        if first[1].shape != cache.shape or first[1].stride() != cache.stride():
            raise ConfigError(
                f"layers {first[0]} and {name} share KV cache memory in different shapes "
                f"({tuple(first[1].shape)} and {tuple(cache.shape)}): kvpush cannot move "
                "one block of both"
            )
    attention = [cache for _, cache in kept.values()]
    for name in state_layers & kv_caches.keys():
        views = kv_caches[name]
        for view in views if isinstance(views, list | tuple) else [views]:
            _check_state_view(name, view, attention)
    return {name: cache for name, cache in kept.values()}


def _check_state_view(name: str, view: Any, caches: list[Any]) -> None:
    """A state view's block b must lie inside block b of an attention view."""
    size = view.element_size()
    start, stride = view.data_ptr(), view.stride(0) * size
    for cache in caches:
        base, block = cache.data_ptr(), cache.stride(0) * cache.element_size()
        if block == stride and base <= start and start - base + view[0].numel() * size <= block:
            return
    raise ConfigError(
        f"the recurrent state of layer {name} does not lie inside the blocks of any "
        "attention layer's KV cache: kvpush moves blocks through the attention views only"
    )


def check_blocks_match(
    tensor_tokens: int, tensor_blocks: int, block_size: int, blocks: int
) -> None:
    """Refuse a KV cache whose blocks are not the scheduler's: block ids would then
    name other tokens than vLLM means, and kvpush would move the wrong KV."""
    if block_size and tensor_tokens != block_size:
        raise ConfigError(
            f"the KV cache tensors hold {tensor_tokens} tokens per block, but vLLM's "
            f"scheduler hands out blocks of {block_size} tokens (a kernel block size "
            "that differs from the KV cache manager's, as in hybrid models): kvpush "
            "cannot map block ids onto this cache"
        )
    if blocks and tensor_blocks < blocks:
        raise ConfigError(
            f"the KV cache tensors hold {tensor_blocks} blocks, but vLLM's scheduler "
            f"hands out ids up to {blocks - 1}: kvpush cannot map block ids onto this cache"
        )


def check_heads(inner: str, shard: Shard) -> None:
    """Refuse a KV cache whose blocks do not hold the heads vLLM's sharding gives this
    rank: kvpush would move other heads than the peer expects."""
    first = inner.split(",")[0]
    if first.startswith("heads:") and int(first[len("heads:") :]) != shard.count:
        raise ConfigError(
            f"the KV cache blocks of TP rank {shard.rank} of {shard.world} hold "
            f"{first[len('heads:') :]} KV heads, but the model's {shard.heads} shard to "
            f"{shard.count} a rank: kvpush cannot tell which heads it holds"
        )


class WorkerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        shape: EngineShape,
        rank: int,
        device_type: str,
        local_rank: int = 0,
        backends: Backends | None = None,
    ) -> None:
        self.config = config
        self.shape = shape
        self.groups = shape.kv_groups  # KV cache groups a transfer carries (kvpush.vllm.groups)
        self.role = KV_ROLES[shape.kv_role]
        self.rank, self.world = rank, shape.world
        # The model's KV heads, of which this rank's blocks hold its share (0: one each).
        self.shard = Shard(rank, shape.world, shape.kv_heads or shape.world)
        self.device_type = device_type
        self.backends = backends or get_backends()
        # Before the engine allocates anything: some runtimes read their environment once.
        self.backends.prepare_process(device_type, local_rank, config.device_options)
        self.node: Node | None = None
        self._layer_index: dict[str, int] = {}
        self._produces: list[Produce] = []
        self._progress: list[Progress] = []
        self._outcomes = Outcomes()
        self._stats = KVPushStats()
        self._samples_seen = 0
        self._counted: dict[str, float] = {}  # node counters already reported
        self._ringer = Ringer()  # wakes a scheduler waiting for an outcome
        self._doorbell_key = ""  # the scheduler's, for landing notes (kvpush.vllm.wake)
        self._parking = Parking(None)
        self._noted = KVPushWorkerMeta()  # for the scheduler's spans, until the next step
        self._states_told: dict[str, int] = {}  # the state counts last sent the scheduler
        self._kv_caches: dict[str, Any] = {}  # vLLM's, as registered
        self._blocks = (0, 0)  # (block size, blocks) the scheduler hands out
        self._released = False  # vLLM let go of the KV cache's memory (unregister_kv_caches)
        self._port = 0  # the side channel's, kept across a release

    # -- set-up ---------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: dict[str, Any], block_size: int = 0, num_blocks: int = 0
    ) -> None:
        """Describe and register the engine's KV cache; `block_size` and `num_blocks`
        are what vLLM's scheduler hands out (0: unknown, not checked)."""
        self.backends.init_runtime(self.device_type)
        if self.shape.cpu_attention:
            ask_for_amx_tiles()
        if self.config.park_workers:
            self._parking = Parking.find()  # vLLM's worker loop is on the stack now
        else:
            RECORD.missed("park_workers", "park_workers is false")
        bound_reader_spin(self.config.reader_spin_s, executor_side=False)
        self._noted.hooks[self.rank] = RECORD.snapshot()
        if self.rank == 0:
            RECORD.log_attached("worker")
        self._kv_caches, self._blocks = kv_caches, (block_size, num_blocks)
        self._start_node(rank_port(self.config.port, self.shape.dp_rank * self.world + self.rank))

    def _start_node(self, port: int) -> None:
        """A node over the KV cache as it lies now, registered with NIXL, in a boot of its
        own (a new epoch: peers holding an earlier boot's registration drop it)."""
        block_size, num_blocks = self._blocks
        kv_caches, options = self._kv_caches, self.config.device_options
        if self.groups > 1:
            kv_caches = one_view_each(kv_caches, self.shape.state_layers)
        if self.shape.cpu_attention:
            tokens = next(iter(kv_caches.values())).shape[2]
            kv_caches, dims = as_head_parts(kv_caches), VLLM_CPU_DIMS
            options = {**options, "tokens_per_block": tokens}
        else:
            dims = VLLM_KV_DIMS
        kv = self.backends.describe(kv_caches, dims, options)
        check_blocks_match(kv.layout.tokens_per_block, kv.layout.num_blocks, block_size, num_blocks)
        check_heads(kv.layout.inner, self.shard)
        kv.layout = msgspec.structs.replace(
            kv.layout,
            shard=self.shard,
            groups=self.groups,
            states=len(self.shape.states),
            null_block=NULL_BLOCK,
        )
        node_config = NodeConfig(
            engine_id=self.shape.engine_id,
            role=self.role,
            rank=self.rank,
            world=self.world,
            host=self.config.host,
            port=port,
            listen=self.config.listen,
            protocol=self.config.protocol,
            agent=self.config.agent,
            secret=load_secret(self.config),
            insecure=insecure(self.config),
            nixl_backends=self.config.nixl_backends,
        )
        self.node = Node(node_config, kv, self.backends, on_outcome=self._ring).start()
        self._layer_index = {name: i for i, name in enumerate(kv.layout.layer_names)}
        where = self.node.address if self.role != "consumer" else "(dials out)"
        log.info(
            "kvpush: rank %d %s on %s (%s path), %d layers x %d blocks of %d tokens "
            "(the scheduler's: %s of %s), KV cache groups: %d, side channel %s",
            self.rank, self.role, kv.device, kv.path, len(kv.layout.layers),
            kv.layout.num_blocks, kv.layout.tokens_per_block, num_blocks or "?",
            block_size or "?", self.groups, where,
        )  # fmt: skip

    # -- the KV cache's memory let go and back (vLLM's sleep, weight updates) ------------

    def unregister_kv_caches(self) -> None:
        """vLLM frees the KV cache's memory next. Every transfer ends now: a claim fails,
        held KV is let go, and the node closes (peers see its connections drop at once)
        and deregisters the memory from NIXL, so no peer writes into or reads from it.
        Until restore_kv_caches a step's transfers are refused, naming why."""
        if self.node is None or self._released:
            return
        for outcome in self.node.take_results():
            self._account(outcome)
        self._end_transfers(self.node)
        node, self.node = self.node, None
        self._port = node.listener.port if node.listener is not None else 0
        node.close()
        # The next node counts from zero: what this one counted is reported now.
        self._take_counts(node)
        self._counted, self._samples_seen = {}, 0
        self._released = True
        for request_id in self._outcomes.end_all():
            self._noted.failed.setdefault(request_id, KV_CACHE_RELEASED)
        log.info("kvpush: rank %d let go of the KV cache's memory at vLLM's word", self.rank)

    def _end_transfers(self, node: Node) -> None:
        """Abort every transfer in flight and wait until each has ended, as the
        protocol ends one: once no peer can write into or read from its blocks (a
        producer's CancelAck, a posted WRITE settled, or the silence rule's bound).

        Closing the side channel alone is not enough: a producer that has not read
        our close yet may post a WRITE into a claim, and some transports (UCX through
        shared memory or TCP) still land it after NIXL deregistered the memory."""
        for request_id in self._outcomes.loading():
            self._noted.failed.setdefault(request_id, KV_CACHE_RELEASED)
        for transfer_id in self._outcomes.in_flight():
            node.abort(transfer_id)
        bound = self.config.protocol.silence_s + self.config.protocol.write_grace_s
        deadline = time.monotonic() + bound
        while self._outcomes.in_flight() and time.monotonic() < deadline:
            for outcome in node.wait_results(0.1):
                self._account(outcome)
        left = self._outcomes.in_flight()
        if left:
            log.warning(
                "kvpush: rank %d lets go of the KV cache's memory with %d transfer(s) "
                "not ended after %.0f s (a peer may still touch it): %s",
                self.rank, len(left), bound, sorted(left),
            )  # fmt: skip

    def restore_kv_caches(self) -> None:
        """vLLM backed the KV cache with memory again (at the same addresses, or new ones
        in the same tensors): register it afresh in a new boot, on the same port, and
        tell the scheduler the new identity; peers re-learn it before their next transfer."""
        if not self._released:
            return
        self._start_node(self._port)
        self._released = False
        handshake = self.handshake()
        if handshake is not None:
            self._noted.handshakes[self.rank] = handshake

    def _ring(self, outcome: Outcome) -> None:
        """The node has an outcome (its loop thread): wake the scheduler, telling it
        which transfer landed here, so it may run the request before a step says so."""
        if outcome.kind != "delivered" or not self._doorbell_key:
            self._ringer.ring()
            return
        note = LandingNote(self.rank, outcome.transfer_id, outcome.wall, outcome.ready_wall)
        self._ringer.ring(note.encode(self._doorbell_key))

    def handshake(self) -> KVPushHandshake | None:
        if self.node is None:
            return None
        address = self.node.address if self.role != "consumer" else ""
        agent = self.node.agent.name if self.node.agent else ""
        return KVPushHandshake(self.rank, self.world, address, self.node.config.epoch, agent)

    # -- per step ---------------------------------------------------------------------

    def bind(self, meta: KVPushMetadata) -> None:
        """The step's metadata arrived (before the forward pass): act on it now."""
        if self._released:
            self._refuse(meta)
            return
        node = self._node()
        self._ringer.port, self._doorbell_key = meta.doorbell, meta.doorbell_key
        if meta.park:
            self._parking.park()
        else:
            self._parking.unpark()
        for pending in meta.pending:
            node.kv_pending(pending.transfer_id, pending.sequential)
        for announce in meta.announces:
            for source in self._sources(announce.producers, announce.epochs):
                node.announce(
                    announce.transfer_id, source.peer, announce.engine, source.epoch,
                    announce.network,
                )  # fmt: skip
        for expect in meta.expects:
            self._outcomes.receiving(expect.request_id, expect.transfer_id)
            node.expect(
                expect.transfer_id,
                self._sources(expect.producers, expect.epochs),
                expect.block_ids,
                expect.skip_blocks,
                expect.engine,
                network=expect.network,
            )
        for tid in meta.aborts:
            node.abort(tid)
        for tid in meta.releases:
            node.release_unclaimed(tid)
        for request_id, why in meta.rejects:
            log.error("kvpush: failing the KV load of %s: %s", request_id, why)
            self._outcomes.rejected(request_id)
        self._produces = list(meta.produces)
        self._progress = list(meta.progress)
        for sent in (*self._produces, *self._progress):
            self._outcomes.sending(sent.request_id, sent.transfer_id)

    def _refuse(self, meta: KVPushMetadata) -> None:
        """A step while the KV cache's memory is let go: no transfer starts; each request
        hears at once, as of any ended transfer (a load failed, blocks free again)."""
        self._parking.unpark()
        for expect in meta.expects:
            self._outcomes.rejected(expect.request_id)
            self._noted.failed.setdefault(expect.request_id, KV_CACHE_RELEASED)
        for request_id, why in meta.rejects:
            log.error("kvpush: failing the KV load of %s: %s", request_id, why)
            self._outcomes.rejected(request_id)
        for sent in (*meta.produces, *meta.progress):
            self._outcomes.sending(sent.request_id, sent.transfer_id)
            self._outcomes.let_go(sent.transfer_id)

    def save_layer(self, layer_name: str) -> None:
        """One layer of this step's KV is written: push it to whoever registered."""
        # Each tensor holds a layer of every KV cache group: one layer's pass does
        # not complete it, so hybrid models push at the step's end.
        if not (self._produces and self.config.layerwise) or self.groups > 1:
            return
        index = self._layer_index.get(layer_name)
        if index is None:
            return
        node = self._node()
        fence = self.backends.fence(node.kv, layer_name)
        batch = [(p.transfer_id, p.block_ids) for p in self._produces]
        node.kv_ready_many(batch, fence, layers=index + 1)

    def end_step(self) -> None:
        """The forward pass is over: every layer of this step's KV exists."""
        if not (self._produces or self._progress):
            return
        node = self._node()
        fence = self.backends.fence(node.kv, None)
        if self._progress:
            chunks = [(p.transfer_id, p.block_ids, p.full_blocks) for p in self._progress]
            node.kv_progress_many(chunks, fence)
        if self._produces:
            batch = [(p.transfer_id, p.block_ids) for p in self._produces]
            node.kv_ready_many(batch, fence, ready_wall=time.time())
        self._produces, self._progress = [], []

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) request ids."""
        self._outcomes.engine_finished(finished_req_ids)
        if self.node is not None:
            for outcome in self.node.take_results():
                self._account(outcome)
        return self._outcomes.take()

    def _account(self, outcome: Any) -> None:
        tid = outcome.transfer_id
        if outcome.kind == "chunk_sent":
            request_id = self._outcomes.sender(tid)
            if request_id is not None:
                self._noted.chunk_sent.setdefault(request_id, outcome.wall)
            return
        if outcome.kind == "released":
            if self._outcomes.let_go(tid) is not None:
                self._stats.data["released"] += 1
                self._stats.data["bytes"] += outcome.nbytes  # sent, on a producer
            if outcome.reason == "orphaned":
                log.warning(
                    "kvpush: released the KV of %s: no decode announced it within "
                    "orphan_grace_s of the answer (does the orchestrator forward "
                    "kv_transfer_params to decode?)", tid,
                )  # fmt: skip
                self._stats.count("orphaned", "no_decode_announced")
            elif outcome.reason == DECODE_CANCELLED:
                # Not a warning: n > 1's other choices and decode's own cache hits say so too.
                self._stats.count("orphaned", DECODE_CANCELLED)
            elif outcome.reason == ROUTER_RELEASED:
                log.debug("kvpush: released the KV of %s: its decode leg never reached decode", tid)
                self._stats.count("orphaned", ROUTER_RELEASED)
                self._noted.releases[tid] = {self.rank: "released"}
            return
        if outcome.kind == "release_refused":
            self._noted.releases[tid] = {self.rank: outcome.reason}
            return
        request_id = self._outcomes.received(tid, ok=outcome.kind == "delivered")
        if request_id is None:
            log.warning("kvpush: outcome for unknown transfer %s: %s", tid, outcome)
            return
        if outcome.kind == "delivered":
            self._noted.landed[request_id] = outcome.wall
            if outcome.ready_wall:
                self._noted.kv_ready[request_id] = outcome.ready_wall
            self._stats.data["delivered"] += 1
            self._stats.data["bytes"] += outcome.nbytes
        else:
            log.warning(
                "kvpush: transfer %s for %s failed (%s) %s",
                tid, request_id, outcome.reason, outcome.detail,
            )  # fmt: skip
            self._noted.failed.setdefault(request_id, outcome.said())
            self._stats.data["failed"] += 1

    def worker_meta(self) -> KVPushWorkerMeta | None:
        if self.node is not None:
            states = {
                f"{machine}.{state}": count
                for machine, counts in self.node.state_counts.items()
                for state, count in counts.items()
            }
            if states != self._states_told:
                self._noted.states[self.rank] = self._states_told = states
        if self._noted.is_empty():
            return None
        noted, self._noted = self._noted, KVPushWorkerMeta()
        return noted

    def stats(self) -> KVPushStats | None:
        if self.node is not None:
            self._take_counts(self.node)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVPushStats()
        return stats

    def _take_counts(self, node: Node) -> None:
        """What `node` counted since the last call, into the stats vLLM collects next
        (the Node keeps totals; vLLM's counters take increments)."""
        metrics = node.metrics
        fresh, self._samples_seen = metrics.samples_since(
            "done_to_ready_seconds", self._samples_seen
        )
        self._stats.data["done_to_ready_s"] += fresh
        for key, total in node_totals(metrics).items():
            self._stats.data[key] += int(total - self._counted.get(key, 0))
            self._counted[key] = total

    def shutdown(self) -> None:
        self._ringer.close()
        if self.node is not None:
            try:
                self.node.close()
            except KVPushError as exc:
                log.warning("kvpush: closing the node: %s", exc)
            self.node = None

    def _sources(self, producers: tuple[str, ...], epochs: tuple[str, ...]) -> list[Source]:
        """The producer ranks this rank takes its KV heads from (its own rank when the
        TP sizes are equal), each with its boot ("": any) and how many consumer ranks
        it fills (kvpush.layout.sources)."""
        boots = epochs if len(epochs) == len(producers) else ("",) * len(producers)
        return [
            Source(producers[rank], boots[rank], parts)
            for rank, parts in sources(self.shard, len(producers))
        ]

    def _node(self) -> Node:
        if self.node is None:
            raise KVPushError("register_kv_caches has not run yet: no kvpush node")
        return self.node
