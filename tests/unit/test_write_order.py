"""Which order a consumer's WRITEs take: OldestFirst exactly where UCX carries them
over TCP, judged from UCX_TLS, the two machines and this one's RDMA devices."""

from __future__ import annotations

import pytest

from kvpush.errors import KVPushError
from kvpush.node import write_order
from kvpush.node.write_order import OldestFirst, SideBySide, choose, tcp_lane, ucx_allows

SHM, RDMA, TCP = write_order.SHARED_MEMORY, write_order.RDMA, write_order.TCP


@pytest.mark.parametrize(
    ("tls", "shm", "rdma", "tcp"),
    [
        ("", True, True, True),  # unset: UCX picks from all
        ("all", True, True, True),
        ("tcp,self", False, False, True),
        ("tcp", False, False, True),
        ("sm,self", True, False, False),
        ("rocm_ipc,self", True, False, False),  # an accelerator's IPC: one machine
        ("rocm_ipc,tcp", True, False, True),
        ("rc,tcp", False, True, True),
        ("rc_mlx5:aux,self", False, True, False),
        ("^shm", False, True, True),  # the family's alias drops all of it
        ("^cma", True, True, True),  # posix shared memory is still there
        ("^ib,shm", False, False, True),
        ("^tcp", True, True, False),
    ],
)
def test_ucx_tls_is_read_as_ucx_reads_it(tls, shm, rdma, tcp):
    assert (ucx_allows(SHM, tls), ucx_allows(RDMA, tls), ucx_allows(TCP, tls)) == (shm, rdma, tcp)


@pytest.mark.parametrize(
    ("ours", "theirs", "tls", "rdma", "over_tcp"),
    [
        ("m1", "m1", "", False, False),  # one machine: shared memory
        ("m1", "m1", "tcp,self", False, True),  # two namespaces, UCX held to TCP
        ("m1", "m2", "", False, True),  # two machines, no RDMA device: TCP
        ("m1", "m2", "", True, False),  # two machines over RDMA
        ("m1", "m2", "tcp,self", True, True),  # RDMA there, UCX told not to use it
        ("m1", "m2", "rc,self", False, False),  # no TCP allowed: whatever it is, not TCP
        ("m1", "", "tcp,self", False, False),  # a peer that does not say where it runs
    ],
)
def test_the_tcp_lane_is_where_no_shared_memory_or_rdma_reaches_the_peer(
    ours, theirs, tls, rdma, over_tcp
):
    assert tcp_lane(ours, theirs, tls, rdma) is over_tcp


def test_auto_chooses_in_turn_only_over_tcp_and_only_under_ucx(monkeypatch):
    monkeypatch.setattr(write_order, "rdma_here", lambda: False)
    tcp_only = {"UCX_TLS": "tcp,self"}
    assert type(choose("auto", "m1", "m1", ucx=True, environ=tcp_only)) is OldestFirst
    assert type(choose("auto", "m1", "m1", ucx=True, environ={})) is SideBySide
    assert (
        type(choose("auto", "m1", "m2", ucx=False, environ={})) is SideBySide
    )  # not UCX: no guess
    assert type(choose("side_by_side", "m1", "m2", ucx=True, environ=tcp_only)) is SideBySide
    assert type(choose("oldest_first", "m1", "m1", ucx=False, environ={})) is OldestFirst
    with pytest.raises(KVPushError, match="write_order must be one of"):
        choose("fifo", "m1", "m1", ucx=True, environ={})
