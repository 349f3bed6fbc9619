"""The NIXL agent wrapper: the only module in kvpush that imports nixl.

Thread model: an agent belongs to the thread that created it, and every call checks
that. With NIXL's default (no) thread sync, one thread posting transfers while another
polled notifications lost most notifications on this machine; one owner thread
cannot lose any, and costs no locking.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush.errors import KVPushError, MetadataError, PeerLostError, RegionError, TransportError
from kvpush.regions import MemRegion, merge_regions

LOCAL = "NIXL_INIT_AGENT"
OPS = ("WRITE", "READ")


def _nixl_api() -> Any:
    """nixl's Python API, through the meta package or a CUDA-flavoured wheel directly.

    `pip install --no-deps nixl-cu13` works without torch but lacks the `nixl` meta
    package, so both spellings are tried. The meta package picks the wheel matching
    torch's CUDA version, but to learn it imports torch (seconds); a process that has
    not imported torch moves host memory only, which either wheel does, so it goes
    straight to the wheel.
    """
    wheels = ("nixl_cu13._api", "nixl_cu12._api")
    order = ("nixl._api", *wheels) if "torch" in sys.modules else (*wheels, "nixl._api")
    for module in order:
        try:
            api = __import__(module, fromlist=["nixl_agent"])
        except ImportError:
            continue
        _quiet_nixl_logging()
        return api
    raise TransportError("import", "the nixl package is not installed (pip install nixl==1.5.1)")


def _quiet_nixl_logging() -> None:
    """NIXL logs INFO lines to stdout, where kvpush's commands print their results.

    Move them to stderr, and down to warnings unless NIXL_LOG_LEVEL asks otherwise.
    """
    nixl_logger = logging.getLogger("nixl")
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


WRITE_ORDERS = ("auto", "oldest_first", "side_by_side")  # kvpush.node.write_order


@dataclass(frozen=True)
class AgentConfig:
    """How the NIXL agent is built.

    Defaults follow measurements on a 2-core host over UCX (docs/benchmarks.md):
    NIXL's progress thread spins a core and adds tens of milliseconds per
    notification, so it is off and the owner thread drives progress. UCX error
    handling "none" is the faster of the two there, and a dead peer is still
    reported within milliseconds.
    """

    backends: tuple[str, ...] = ("UCX",)
    ucx_error_handling: str = "none"
    # In what order one consumer's WRITEs are posted (kvpush.node.write_order).
    write_order: str = "auto"
    ucx_workers: int = 1
    progress_thread: bool = False
    backend_params: dict[str, dict[str, str]] = field(default_factory=dict)

    def params_for(self, backend: str) -> dict[str, str]:
        params = dict(self.backend_params.get(backend, {}))
        if backend == "UCX":
            params.setdefault("ucx_error_handling_mode", self.ucx_error_handling)
            params.setdefault("num_workers", str(self.ucx_workers))
        return params


@dataclass(frozen=True)
class PreparedList:
    """A NIXL-prepared descriptor list; transfers address its rows by index."""

    handle: Any
    rows: int
    mem_type: str
    peer: str | None


@dataclass
class Transfer:
    """A posted transfer; poll it with NixlAgent.check until done."""

    handle: Any
    op: str
    peer: str
    nbytes: int
    finished: bool = False  # completed inside the posting call (shared memory does)


def _fail(op: str, exc: BaseException, peer: str | None = None) -> TransportError:
    """Translate a NIXL exception into a kvpush error naming the operation and peer."""
    kind = type(exc).__name__
    detail = f"{kind}: {exc}" if str(exc) else kind
    if kind == "nixlRemoteDisconnectError":
        return PeerLostError(op, f"the peer disconnected ({detail})", peer)
    return TransportError(op, detail, peer)


class NixlAgent:
    """A NIXL agent plus the bookkeeping kvpush needs: registrations, peers, lists."""

    def __init__(self, name: str, config: AgentConfig | None = None) -> None:
        self.config = config or AgentConfig()
        api = _nixl_api()
        self._owner = threading.get_ident()
        nixl_config = api.nixl_agent_config(
            enable_prog_thread=self.config.progress_thread,
            enable_listen_thread=False,
            backends=[],
        )
        try:
            self._agent = api.nixl_agent(name, nixl_config)
        except Exception as exc:
            raise _fail("agent creation", exc) from exc
        self.name = name
        available = self._agent.get_plugin_list()
        for backend in self.config.backends:
            if backend not in available:
                raise TransportError(
                    "backend creation", f"NIXL has no {backend!r} plugin; available: {available}"
                )
            try:
                self._agent.create_backend(backend, self.config.params_for(backend))
            except Exception as exc:
                raise _fail(f"creating backend {backend}", exc) from exc
        self._registered: list[tuple[Any, list[MemRegion]]] = []
        self._lists: list[PreparedList] = []
        self._peers: set[str] = set()
        self._closed = False

    # -- ownership -------------------------------------------------------------------

    def _check(self, op: str) -> None:
        if self._closed:
            raise TransportError(op, "the agent is closed")
        if threading.get_ident() != self._owner:
            raise KVPushError(
                f"NIXL {op} called from thread {threading.current_thread().name!r}; this agent "
                "belongs to another thread (call it through the owner loop)"
            )

    # -- memory ----------------------------------------------------------------------

    def register(self, regions: Sequence[MemRegion]) -> list[MemRegion]:
        """Register regions (each byte once); returns what was registered."""
        self._check("register")
        if not regions:
            raise RegionError("nothing to register: the region list is empty")
        merged = merge_regions(list(regions))
        by_type: dict[str, list[MemRegion]] = {}
        for region in merged:
            by_type.setdefault(region.mem_type, []).append(region)
        for mem_type, group in by_type.items():
            try:
                descs = self._agent.register_memory(
                    [r.as_reg_tuple() for r in group], mem_type, list(self.config.backends)
                )
            except Exception as exc:
                raise _fail(f"register_memory({mem_type}, {len(group)} regions)", exc) from exc
            self._registered.append((descs, group))
        return merged

    def _deregister_all(self) -> None:
        # Only after every prepared list is released: NIXL crashes (SIGSEGV, seen with
        # 1.5.1) posting from a list whose memory was deregistered under it.
        self._check("deregister")
        while self._registered:
            descs, _ = self._registered.pop()
            try:
                self._agent.deregister_memory(descs, list(self.config.backends))
            except Exception as exc:
                raise _fail("deregister_memory", exc) from exc

    def prepare(self, rows: np.ndarray, mem_type: str, peer: str | None = None) -> PreparedList:
        """Prepare an N x 3 (addr, bytes, device) table, local or of `peer`'s memory."""
        self._check("prep_xfer_dlist")
        if rows.ndim != 2 or rows.shape[1] != 3 or rows.shape[0] == 0:
            raise RegionError(f"descriptor table must be a non-empty N x 3 array, got {rows.shape}")
        if peer is not None and peer not in self._peers:
            raise TransportError("prep_xfer_dlist", "unknown peer: exchange metadata first", peer)
        table = np.ascontiguousarray(rows, dtype=np.uint64)
        try:
            handle = self._agent.prep_xfer_dlist(peer or LOCAL, table, mem_type)
        except Exception as exc:
            raise _fail("prep_xfer_dlist", exc, peer) from exc
        prepared = PreparedList(handle, int(table.shape[0]), mem_type, peer)
        self._lists.append(prepared)
        return prepared

    def release_list(self, prepared: PreparedList) -> None:
        self._check("release_dlist_handle")
        if prepared in self._lists:
            self._lists.remove(prepared)
            self._agent.release_dlist_handle(prepared.handle)

    # -- transfers -------------------------------------------------------------------

    def post(
        self,
        op: str,
        local: PreparedList,
        local_ids: np.ndarray,
        remote: PreparedList,
        remote_ids: np.ndarray,
        notif: bytes = b"",
        nbytes: int = 0,
    ) -> Transfer:
        """Make and start a WRITE (local -> remote) or READ (remote -> local) of the given rows."""
        transfer = self.make_transfer(op, local, local_ids, remote, remote_ids, notif, nbytes)
        transfer.finished = self.start(transfer)
        return transfer

    def make_transfer(
        self,
        op: str,
        local: PreparedList,
        local_ids: np.ndarray,
        remote: PreparedList,
        remote_ids: np.ndarray,
        notif: bytes = b"",
        nbytes: int = 0,
    ) -> Transfer:
        """Build a transfer request from prepared rows, without starting it."""
        self._check(op)
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        if remote.peer is None:
            raise TransportError(op, "the remote list was not prepared for a peer")
        local_ids = _checked_ids("local", local_ids, local.rows)
        remote_ids = _checked_ids("remote", remote_ids, remote.rows)
        if len(local_ids) != len(remote_ids):
            raise RegionError(
                f"{op}: {len(local_ids)} local descriptors but {len(remote_ids)} remote ones"
            )
        try:
            handle = self._agent.make_prepped_xfer(
                op, local.handle, local_ids, remote.handle, remote_ids, notif
            )
        except Exception as exc:
            raise _fail(op, exc, remote.peer) from exc
        return Transfer(handle, op, remote.peer, nbytes)

    def start(self, transfer: Transfer) -> bool:
        """Post a made transfer; True if it already completed inside the call."""
        self._check(transfer.op)
        try:
            state = self._agent.transfer(transfer.handle)
        except Exception as exc:
            self._release_quietly(transfer)
            raise _fail(transfer.op, exc, transfer.peer) from exc
        if state == "ERR":
            self._release_quietly(transfer)
            raise TransportError(transfer.op, "NIXL refused to post the transfer", transfer.peer)
        return state == "DONE"

    def done(self, transfer: Transfer) -> bool:
        """True once the transfer completed; raises TransportError if it failed.

        A failed transfer's handle is released here: nothing more can be done with it.
        """
        self._check("check_xfer_state")
        try:
            state = self._agent.check_xfer_state(transfer.handle)
        except Exception as exc:
            self._release_quietly(transfer)
            raise _fail(f"{transfer.op} completion", exc, transfer.peer) from exc
        if state == "ERR":
            self._release_quietly(transfer)
            raise TransportError(f"{transfer.op} completion", "the transfer failed", transfer.peer)
        return state == "DONE"

    def _release_quietly(self, transfer: Transfer) -> None:
        # The error that brought us here is the one worth reporting.
        with contextlib.suppress(Exception):
            self._agent.release_xfer_handle(transfer.handle)

    def release(self, transfer: Transfer) -> None:
        self._check("release_xfer_handle")
        try:
            self._agent.release_xfer_handle(transfer.handle)
        except Exception as exc:
            raise _fail(f"releasing {transfer.op}", exc, transfer.peer) from exc

    # -- notifications ---------------------------------------------------------------

    def notifs(self) -> list[tuple[str, bytes]]:
        """Notifications that arrived since the last call, as (peer, message)."""
        self._check("get_new_notifs")
        try:
            batch = self._agent.get_new_notifs()
        except Exception as exc:
            raise _fail("get_new_notifs", exc) from exc
        return [(_text(peer), msg) for peer, msgs in batch.items() for msg in msgs]

    # -- peers -----------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's add_peer. Call after registering memory."""
        self._check("get_agent_metadata")
        return self._agent.get_agent_metadata()

    def add_peer(self, blob: bytes) -> str:
        """Load a peer's metadata; returns its agent name."""
        self._check("add_remote_agent")
        if not isinstance(blob, bytes | bytearray) or not blob:
            raise MetadataError("add_remote_agent", "agent metadata must be non-empty bytes")
        try:
            name = _text(self._agent.add_remote_agent(bytes(blob)))
        except Exception as exc:
            kind = type(exc).__name__
            raise MetadataError(
                "add_remote_agent", f"malformed or incompatible agent metadata ({kind})"
            ) from exc
        self._peers.add(name)
        return name

    def remove_peer(self, peer: str) -> None:
        self._check("remove_remote_agent")
        if peer in self._peers:
            self._peers.discard(peer)
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as exc:
                raise _fail("remove_remote_agent", exc, peer) from exc

    @property
    def peers(self) -> set[str]:
        return set(self._peers)

    def close(self) -> None:
        """Forget peers and registrations; safe to call twice."""
        if self._closed:
            return
        self._check("close")
        # Best effort: a dead peer or a half-torn-down agent must not stop the rest.
        for prepared in list(self._lists):
            with contextlib.suppress(Exception):
                self.release_list(prepared)
        for peer in list(self._peers):
            with contextlib.suppress(TransportError):
                self.remove_peer(peer)
        with contextlib.suppress(TransportError):
            self._deregister_all()
        self._closed = True


def _text(name: str | bytes) -> str:
    # add_remote_agent answers bytes while get_new_notifs keys are str.
    return name.decode() if isinstance(name, bytes) else name


def _checked_ids(side: str, ids: np.ndarray | Sequence[int], rows: int) -> np.ndarray:
    """The ids as NIXL wants them (int32), after checking each names a prepared row."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise RegionError(f"{side} descriptor ids must be a non-empty flat list of integers")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= rows:
        raise RegionError(
            f"{side} descriptor ids span [{low}, {high}] but the prepared list has {rows} rows"
        )
    return np.ascontiguousarray(ids, dtype=np.int32)
