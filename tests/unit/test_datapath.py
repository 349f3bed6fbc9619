"""The Node's data path against a fake NIXL agent: batching, one consumer's WRITEs in
turn where they cross TCP, fences, failures, timeouts.

No NIXL, no threads, no sockets: each test runs in microseconds. The agent fake keeps
what a real agent would have done (posts, released handles, known peers), so a data
path that forgets to release a handle or drops a WRITE shows up here.
"""

from __future__ import annotations

import pytest

from kvpush.backend import DeviceKV
from kvpush.errors import BackendError, TransportError
from kvpush.layout import BlockRun, KVLayout
from kvpush.metrics import Metrics
from kvpush.node import write_order
from kvpush.node.datapath import DataPath
from kvpush.protocol.actions import PostRead, PostWrite
from kvpush.protocol.messages import split_notifs
from kvpush.regions import MemRegion
from kvpush.transport.agent import PreparedList, Transfer

BLOCK = 1024
BLOCKS = 8
LAYERS = 3


def _layout(base: int) -> KVLayout:
    regions = tuple(MemRegion(base + i * 0x10000, BLOCKS * BLOCK) for i in range(LAYERS))
    runs = tuple((BlockRun(r.addr, BLOCK, BLOCK, "KV"),) for r in regions)
    return KVLayout(regions, runs, BLOCKS, 16, "f32", "x")


class FakeAgent:
    """A NIXL agent that completes, fails or stalls transfers as the test says."""

    name = "me"

    def __init__(self) -> None:
        self.peers: set[str] = set()
        self.removed: list[str] = []
        self.posts: list[tuple[Transfer, bytes]] = []
        self.released: list[int] = []
        self.released_lists: list[str | None] = []  # the peer of each released table
        self.state: dict[int, object] = {}  # handle -> True (done), an exception, or stuck
        self.inbox: list[tuple[str, bytes]] = []
        self.refuse_posts = False
        self.finish_on_post = False
        self.refuse_prepare_for: str | None = None

    def metadata(self) -> bytes:
        return b"my-metadata"

    def add_peer(self, blob: bytes) -> str:
        name = blob.decode()
        self.peers.add(name)
        return name

    def remove_peer(self, peer: str) -> None:
        self.peers.discard(peer)
        self.removed.append(peer)

    def prepare(self, rows, mem_type: str, peer: str | None = None) -> PreparedList:
        if peer is not None and peer == self.refuse_prepare_for:
            raise TransportError("prep_xfer_dlist", "no such memory", peer)
        return PreparedList(object(), len(rows), mem_type, peer)

    def post(self, op, local, local_ids, remote, remote_ids, notif=b"", nbytes=0) -> Transfer:
        if self.refuse_posts:
            raise TransportError(op, "NIXL refused to post the transfer", remote.peer)
        transfer = Transfer(len(self.posts), op, remote.peer, nbytes, self.finish_on_post)
        self.posts.append((transfer, notif))
        return transfer

    def done(self, transfer: Transfer) -> bool:
        state = self.state.get(transfer.handle, False)
        if isinstance(state, Exception):
            raise state
        return bool(state)

    def release(self, transfer: Transfer) -> None:
        self.released.append(transfer.handle)

    def release_list(self, prepared: PreparedList) -> None:
        self.released_lists.append(prepared.peer)

    def notifs(self) -> list[tuple[str, bytes]]:
        batch, self.inbox = self.inbox, []
        return batch


class FakeBackends:
    """Records staging and fence waits; fails staging of the blocks it is told to."""

    def __init__(self) -> None:
        self.staged: list[tuple[list[int], str]] = []
        self.waited: list[object] = []
        self.bad_blocks: set[int] = set()
        self.bad_fences: set[object] = set()

    def stage(self, kv, block_ids, direction: str) -> None:
        if self.bad_blocks & set(block_ids):
            raise BackendError("the staging copy failed")
        self.staged.append((list(block_ids), direction))

    def wait_fence(self, kv, fence) -> None:
        self.waited.append(fence)
        if fence in self.bad_fences:
            raise BackendError("waiting for the fence failed")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def path():
    agent, backends, clock = FakeAgent(), FakeBackends(), Clock()
    kv = DeviceKV("host", "cpu", _layout(0x100000))
    data = DataPath(agent, kv, backends, Metrics(), write_grace_s=2.0, clock=clock)
    data.pair("decode:1", "decode-agent", _layout(0x900000), b"decode-agent", notifies=False)
    return data, agent, backends, clock


@pytest.fixture
def in_turn(path):
    """The path, its WRITEs to decode:1 oldest first (as over UCX's TCP lane)."""
    data = path[0]
    data.order = lambda machine: write_order.OldestFirst()
    data.pair("decode:1", "decode-agent", _layout(0x900000), b"decode-agent", notifies=False)
    return path


def _write(
    tid: str, blocks=(0, 1), layers=(0, LAYERS), notif: bytes | None = None, peer: str = "decode:1"
) -> PostWrite:
    return PostWrite(tid, peer, list(blocks), list(blocks), notif or tid.encode(), layers)


def _notifs(agent: FakeAgent) -> list[list[bytes]]:
    return [split_notifs(notif) for _, notif in agent.posts]


def test_writes_to_one_consumer_go_as_one_post_carrying_every_notification(path):
    data, agent, _, _ = path
    assert data.post_writes([_write("a"), _write("b", (2, 3))]) == []
    assert len(agent.posts) == 1
    transfer, notif = agent.posts[0]
    assert split_notifs(notif) == [b"a", b"b"]
    assert transfer.nbytes == 2 * 2 * LAYERS * BLOCK  # two transfers, two blocks each


def test_a_batch_over_the_cap_is_split_into_several_posts(path, monkeypatch):
    data, agent, _, _ = path
    monkeypatch.setattr(write_order, "MAX_WRITES_PER_POST", 2)
    data.post_writes([_write(t, (i,)) for i, t in enumerate("abcde")])
    assert _notifs(agent) == [[b"a", b"b"], [b"c", b"d"], [b"e"]]


def test_side_by_side_a_consumers_writes_go_as_they_are_handed_off(path):
    data, agent, _, _ = path
    data.post_writes([_write("a")])
    data.post_writes([_write("b", (2,))])
    assert _notifs(agent) == [[b"a"], [b"b"]] and data.counts()["writes_queued"] == 0


def test_in_turn_a_consumers_writes_go_one_transfer_at_a_time_oldest_transfer_first(in_turn):
    data, agent, _, _ = in_turn
    data.post_writes([_write("a")])
    data.post_writes([_write("b", (2,))])
    data.post_writes([_write("c", (3,))])
    assert _notifs(agent) == [[b"a"]]  # side by side, the three would share the link
    assert data.counts()["writes_queued"] == 2 and data.busy()
    agent.state[0] = True
    assert [s.transfer_id for s in data.progress()] == ["a"]
    # "a"'s next WRITE, handed off while its settling is handed back, goes before "b".
    assert data.post_writes([_write("a", layers=(1, LAYERS), notif=b"a2")]) == []
    assert data.post_queued() == []
    assert _notifs(agent) == [[b"a"], [b"a2"]]
    data.post_writes([_write("e", (5,)), _write("d", (4,))])  # one hand-off: one post
    for handle in (1, 2, 3, 4):
        agent.state[handle] = True
        data.progress()
        data.post_queued()
    assert _notifs(agent) == [[b"a"], [b"a2"], [b"b"], [b"c"], [b"e", b"d"]]
    assert data.counts()["writes_queued"] == 0 and not data.busy()


def test_in_turn_a_batch_over_the_cap_goes_in_several_posts_one_after_another(in_turn, monkeypatch):
    data, agent, _, _ = in_turn
    monkeypatch.setattr(write_order, "MAX_WRITES_PER_POST", 2)
    data.post_writes([_write(t, (i,)) for i, t in enumerate("abcde")])
    assert _notifs(agent) == [[b"a", b"b"]]
    agent.finish_on_post = True  # each post ends inside the call: the next goes at once
    agent.state[0] = True
    data.progress()
    data.post_queued()
    assert _notifs(agent) == [[b"a", b"b"], [b"c", b"d"], [b"e"]]


def test_in_turn_a_write_that_waited_out_its_grace_in_the_queue_fails_unposted(in_turn):
    # The consumer's landing bound counts from the hand-off: a queued WRITE posted
    # later could land in blocks the consumer has given back.
    data, agent, _, clock = in_turn
    data.post_writes([_write("a")])
    clock.now += 1.0
    data.post_writes([_write("b", (2,))])
    clock.now += 1.5  # "a" is past its grace; "b" waited 1.5 s of its 2
    settled = data.progress()
    assert [(s.transfer_id, s.ok, s.may_land) for s in settled] == [("a", False, True)]
    assert data.post_queued() == []
    assert _notifs(agent) == [[b"a"], [b"b"]]
    clock.now += 0.6  # "b" was posted with what was left of its grace, not a new one
    assert [(s.transfer_id, s.may_land) for s in data.progress()] == [("b", True)]
    data.post_writes([_write("c", (3,))])
    data.post_writes([_write("d", (4,))])
    clock.now += 2.1
    agent.state[2] = True
    assert [s.transfer_id for s in data.progress()] == ["c"]
    [late] = data.post_queued()
    assert (late.transfer_id, late.ok, late.may_land) == ("d", False, False)
    assert "not posted" in late.detail
    assert _notifs(agent)[-1] == [b"c"] and data.counts()["writes_queued"] == 0


def test_in_turn_writes_to_different_consumers_do_not_wait_for_each_other(in_turn):
    data, agent, _, _ = in_turn
    data.pair("decode:2", "other-agent", _layout(0xA00000), b"other-agent", notifies=False)
    data.post_writes([_write("a")])
    data.post_writes([_write("b", peer="decode:2")])
    data.post_writes([_write("c", (3,))])
    assert [transfer.peer for transfer, _ in agent.posts] == ["decode-agent", "other-agent"]


def test_in_turn_writes_queued_for_a_consumer_whose_link_went_fail_as_gone(in_turn):
    data, agent, _, _ = in_turn
    data.post_writes([_write("a")])
    data.post_writes([_write("b", (2,))])
    data.unpair("decode:1")
    agent.state[0] = True
    assert [s.transfer_id for s in data.progress()] == ["a"]
    [gone] = data.post_queued()
    assert (gone.transfer_id, gone.ok) == ("b", False) and "session is gone" in gone.detail
    assert data.counts()["writes_queued"] == 0 and len(agent.posts) == 1


def test_a_write_whose_staging_fails_fails_alone(path):
    data, agent, backends, _ = path
    backends.bad_blocks = {5}
    settled = data.post_writes([_write("a"), _write("bad", (5,)), _write("c", (2,))])
    assert [(s.transfer_id, s.ok) for s in settled] == [("bad", False)]
    assert "staging copy failed" in settled[0].detail
    assert split_notifs(agent.posts[0][1]) == [b"a", b"c"]


def test_a_refused_post_fails_every_write_it_carried_and_leaves_nothing_in_flight(path):
    data, agent, _, _ = path
    agent.refuse_posts = True
    settled = data.post_writes([_write("a"), _write("b", (2,))])
    assert [(s.transfer_id, s.ok) for s in settled] == [("a", False), ("b", False)]
    assert "refused" in settled[0].detail
    assert not data.busy()


def test_a_write_to_a_peer_that_is_not_paired_says_the_session_is_gone(path):
    data, agent, _, _ = path
    write = PostWrite("a", "elsewhere:9", [0], [0], b"a", (0, LAYERS))
    [settled] = data.post_writes([write])
    assert not settled.ok and "session is gone" in settled.detail
    assert agent.posts == []


def test_a_write_that_completes_while_posting_settles_at_once_and_frees_its_handle(path):
    data, agent, _, _ = path
    agent.finish_on_post = True
    [settled] = data.post_writes([_write("a")])
    assert settled.ok and settled.nbytes == 2 * LAYERS * BLOCK
    assert agent.released == [0]
    assert not data.busy()


def test_progress_settles_done_and_failed_transfers_and_frees_their_handles(path):
    data, agent, _, _ = path
    data.post_writes([_write("a")])
    data.post_writes([_write("b", (2,))])
    assert data.progress() == []  # neither is done
    agent.state = {0: True, 1: TransportError("WRITE completion", "the transfer failed")}
    settled = {s.transfer_id: s for s in data.progress()}
    assert settled["a"].ok and not settled["b"].ok and not settled["b"].may_land
    assert agent.released == [0]  # a failed transfer's handle is NIXL's to drop
    assert not data.busy()


def test_a_transfer_past_its_grace_is_aborted_and_may_still_land(path):
    data, agent, _, clock = path
    data.post_writes([_write("a")])
    clock.now += 1.9
    assert data.progress() == []
    clock.now += 0.2
    [settled] = data.progress()
    assert (settled.ok, settled.may_land, settled.detail) == (False, True, "timed out")
    assert agent.released == [0]  # releasing an unfinished transfer aborts it


def test_a_write_waits_on_each_fence_it_reads_in_layer_order_and_only_once(path):
    data, _, backends, _ = path
    assert data.add_fence("a", 1, "f1") is True
    assert data.add_fence("a", 2, "f2") is False
    data.add_fence("a", 3, "f3")
    data.post_writes([_write("a", layers=(0, 2))])
    assert backends.waited == ["f1", "f2"]
    data.post_writes([_write("a", layers=(2, 3))])
    assert backends.waited == ["f1", "f2", "f3"]


def test_a_write_whose_fence_wait_failed_waits_on_it_again_when_retried(path):
    # Without the second wait the retry would send KV the engine has not written yet.
    data, agent, backends, _ = path
    data.add_fence("a", LAYERS, "f")
    backends.bad_fences = {"f"}
    [settled] = data.post_writes([_write("a")])
    assert not settled.ok and "fence failed" in settled.detail
    assert agent.posts == []
    backends.bad_fences = set()
    data.post_writes([_write("a")])
    assert backends.waited == ["f", "f"]
    assert len(agent.posts) == 1


def test_a_read_is_posted_to_its_producer_and_settles_as_a_read(path):
    data, agent, _, _ = path
    data.post_read(PostRead("r", "decode:1", [0, 1], [4, 5]))
    agent.state = {0: True}
    [settled] = data.progress()
    assert (settled.op, settled.transfer_id, settled.ok) == ("READ", "r", True)


def test_exposing_blocks_for_a_read_waits_on_every_fence_then_stages_to_host(path):
    data, _, backends, _ = path
    data.add_fence("a", 1, "f1")
    data.add_fence("a", LAYERS, "f3")
    data.expose("a", [3])
    assert backends.waited == ["f1", "f3"]
    assert backends.staged == [([3], "to_host")]


def test_landed_kv_is_staged_to_the_device_and_counted_from_our_layout(path):
    data, _, backends, _ = path
    data.expect("t", [1, 2, 3])
    assert data.landed("t") == 3 * LAYERS * BLOCK
    assert backends.staged == [([1, 2, 3], "to_device")]
    assert data.landed("t") == 0  # a second delivery stages nothing


def test_a_write_that_failed_outright_reconnects_its_peer_before_the_next_post(path):
    data, agent, _, _ = path
    data.post_writes([_write("a"), _write("b", (2,))])
    data.post_writes([_write("c", (3,))])
    agent.state[0] = TransportError("WRITE completion", "remote disconnected")
    assert [s.ok for s in data.progress()] == [False, False]
    data.post_writes([_write("d", (4,))])  # "c" still uses the old endpoint: kept
    assert agent.removed == [] and len(agent.posts) == 3
    agent.state = {1: True, 2: True}
    data.progress()
    data.post_writes([_write("a")])  # the retry: a fresh endpoint first
    assert agent.removed == ["decode-agent"] and "decode-agent" in agent.peers
    assert agent.released_lists == ["decode-agent"]  # the old table, prepared anew
    assert data.routes["decode:1"].prepared.peer == "decode-agent"
    data.post_writes([_write("b", (2,))])
    assert agent.removed == ["decode-agent"]  # once per failure, not per post


def test_a_refused_post_reconnects_and_a_timed_out_write_does_not(path):
    data, agent, _, clock = path
    data.post_writes([_write("a")])
    clock.now += 2.1  # past its grace: it may still land, the endpoint is not blamed
    data.progress()
    data.post_writes([_write("b", (2,))])
    assert agent.removed == []
    agent.refuse_posts = True
    data.post_writes([_write("c", (3,))])
    agent.refuse_posts = False
    clock.now += 2.1
    data.progress()  # "b" times out: the peer's table is free to go
    data.post_writes([_write("c", (3,))])
    assert agent.removed == ["decode-agent"]


def test_a_reconnect_that_fails_fails_the_writes_and_is_tried_again(path):
    data, agent, _, _ = path
    agent.refuse_posts = True
    data.post_writes([_write("a")])
    agent.refuse_posts = False
    agent.refuse_prepare_for = "decode-agent"
    [settled] = data.post_writes([_write("a")])
    assert not settled.ok and "reconnecting" in settled.detail and len(agent.posts) == 0
    agent.refuse_prepare_for = None
    assert data.post_writes([_write("a")]) == [] and len(agent.posts) == 1


def test_a_read_that_failed_outright_reconnects_its_producer_before_the_next_read(path):
    # Pull mode's READs cross the UCX endpoint a cut link can kill, as push's WRITEs
    # do: without a fresh one, every later READ from that producer fails the same way.
    data, agent, _, _ = path
    data.post_read(PostRead("r", "decode:1", [0, 1], [4, 5]))
    agent.state[0] = TransportError("READ completion", "remote disconnected")
    [settled] = data.progress()
    assert (settled.op, settled.ok) == ("READ", False) and agent.removed == []
    assert data.post_read(PostRead("s", "decode:1", [2], [6])) == []
    assert agent.removed == ["decode-agent"] and "decode-agent" in agent.peers
    assert agent.released_lists == ["decode-agent"]  # the old table, prepared anew
    assert data.routes["decode:1"].prepared.peer == "decode-agent"
    assert len(agent.posts) == 2
    agent.state[1] = True
    data.progress()
    data.post_read(PostRead("t", "decode:1", [3], [7]))
    assert agent.removed == ["decode-agent"]  # once per failure, not per READ


def test_a_refused_read_reconnects_and_a_reconnect_that_fails_fails_the_read(path):
    data, agent, _, _ = path
    agent.refuse_posts = True
    [refused] = data.post_read(PostRead("r", "decode:1", [0], [4]))
    assert not refused.ok and agent.removed == []
    agent.refuse_posts = False
    agent.refuse_prepare_for = "decode-agent"
    [settled] = data.post_read(PostRead("r", "decode:1", [0], [4]))
    assert not settled.ok and "reconnecting to the producer's" in settled.detail
    assert agent.posts == []
    agent.refuse_prepare_for = None
    assert data.post_read(PostRead("r", "decode:1", [0], [4])) == [] and len(agent.posts) == 1


def test_a_nixl_peer_is_kept_while_a_transfer_to_it_is_in_flight_and_dropped_after(path):
    data, agent, _, _ = path
    data.post_writes([_write("a")])
    data.unpair("decode:1")
    assert agent.removed == [] and agent.released_lists == []
    data.pair("decode:2", "other-agent", _layout(0xA00000), b"other-agent", notifies=False)
    data.unpair("decode:2")
    assert agent.removed == ["other-agent"] and agent.released_lists == ["other-agent"]
    (transfer, _), *_ = agent.posts
    agent.state[transfer.handle] = True  # the WRITE to the gone peer ends
    assert [s.ok for s in data.progress()] == [True]
    assert agent.removed == ["other-agent", "decode-agent"]
    assert agent.released_lists == ["other-agent", "decode-agent"]


def test_a_nixl_peer_shared_by_two_links_stays_until_both_are_gone(path):
    data, agent, _, _ = path
    data.pair("c7", "decode-agent", _layout(0x900000), b"decode-agent", notifies=False)
    data.unpair("decode:1")
    assert agent.removed == [] and agent.released_lists == ["decode-agent"]
    data.unpair("c7")
    assert agent.removed == ["decode-agent"]
    assert agent.released_lists == ["decode-agent", "decode-agent"]  # each link's table


def test_a_peer_whose_table_cannot_be_prepared_is_dropped_from_nixl(path):
    data, agent, _, _ = path
    agent.refuse_prepare_for = "broken-agent"
    with pytest.raises(TransportError):
        data.pair("p:1", "broken-agent", _layout(0xB00000), b"broken-agent", notifies=True)
    assert "broken-agent" not in agent.peers and "p:1" not in data.routes


def test_notifications_only_count_from_peers_we_dialled(path):
    data, agent, _, _ = path
    data.pair("prefill:7", "prefill-agent", _layout(0xC00000), b"prefill-agent", notifies=True)
    agent.inbox = [("prefill-agent", b"t1"), ("stranger", b"t2")]
    assert data.notifs() == [("prefill:7", b"t1")]
    assert data.metrics.counter("rejected_notifs", why="unknown_agent") == 1
