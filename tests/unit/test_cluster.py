"""The helper that runs deployments for the demo and the end-to-end tests leaves
nothing behind."""

from __future__ import annotations

from types import SimpleNamespace

import httpx

from kvpush.demo.cluster import Cluster, kvpush_transfer_config
from kvpush.vllm.config import ENV_INSECURE, ENV_SECRET


def test_routers_start_restart_and_stop_without_leaking(tmp_path):
    cluster = Cluster(tmp_path, tmp_path / "model")
    unreachable = SimpleNamespace(url="http://127.0.0.1:9", stop=lambda: None)
    cluster.servers = {"p": unreachable, "d": unreachable}
    first = cluster.start_router(["p"], ["d"], name="a")
    process_a, _ = cluster.routers["a"]
    second = cluster.start_router(["p"], ["d"], name="b", mode="pull")
    assert first != second
    assert httpx.get(second + "/metrics").status_code == 200
    restarted = cluster.start_router(["p"], ["d"], name="a")
    assert process_a.poll() is not None  # the old "a" is gone, not orphaned
    processes = [process for process, _ in cluster.routers.values()]
    assert len(processes) == 2 and restarted != first
    cluster.stop()
    assert all(process.poll() is not None for process in processes)
    assert cluster.routers == {}


def test_transfer_config_names_the_connector_and_validates_the_role():
    config = kvpush_transfer_config("kv_both", mode="pull", lease_s=5)
    assert config["kv_connector"] == "KVPushConnector"
    assert config["kv_connector_extra_config"] == {"mode": "pull", "lease_s": 5}
    try:
        kvpush_transfer_config("kv_prefill")
    except Exception as exc:
        assert "kv_role must be one of" in str(exc)
    else:
        raise AssertionError("an unknown role was accepted")


def test_ports_are_chosen_below_the_kernels_ephemeral_range_and_never_twice(monkeypatch):
    """Servers bind their ports long after they are chosen: a port the kernel may
    hand to another process's connection meanwhile would collide."""
    from kvpush.ports import ENV_PORTS, _ephemeral_range, free_port

    monkeypatch.delenv(ENV_PORTS, raising=False)
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(1024 <= p < low for p in ports)


def test_kvpush_ports_confines_the_choice_and_a_malformed_range_is_named(monkeypatch):
    """Two test workers on one host each take their own slice, so neither can pick a
    port the other picked and has not bound yet."""
    from kvpush.errors import KVPushError
    from kvpush.ports import ENV_PORTS, free_port

    monkeypatch.setenv(ENV_PORTS, "20000-20009")
    firsts = [free_port(span=2) for _ in range(3)]
    assert all(20000 <= p <= 20008 for p in firsts)  # p and p + 1 both in the range
    for bad in ("20000", "20010-20000", "abc-def", "80-90", "20000-70000"):
        monkeypatch.setenv(ENV_PORTS, bad)
        try:
            free_port()
        except KVPushError as exc:
            assert ENV_PORTS in str(exc) and repr(bad) in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")
    monkeypatch.setenv(ENV_PORTS, "20000-20001")
    try:
        free_port(span=3)
    except KVPushError as exc:
        assert "20000-20001" in str(exc)
    else:
        raise AssertionError("three ports were found in a range of two")


def test_each_deployment_has_its_own_secret_and_an_insecure_one_has_none(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_SECRET, "inherited-from-the-shell-0123456789")
    first, second = Cluster(tmp_path, tmp_path), Cluster(tmp_path, tmp_path)
    assert first.secret and second.secret and first.secret != second.secret
    env = first.add_server("p", "kv_producer", core=None).environment()
    assert env[ENV_SECRET] == first.secret
    bare = Cluster(tmp_path, tmp_path, insecure=True)
    env = bare.add_server("p", "kv_producer", core=None).environment()
    assert ENV_SECRET not in env and env[ENV_INSECURE] == "1"


def test_a_clusters_block_count_reaches_every_server_and_a_servers_own_count_wins(tmp_path):
    cluster = Cluster(tmp_path, tmp_path / "model", kv_blocks=1024)
    command = cluster.add_server("p", "kv_producer", core=0).command()
    assert command[command.index("--num-gpu-blocks-override") + 1] == "1024"
    own = cluster.add_server("d", "kv_consumer", core=1)
    own.spec.extra_args = ["--num-gpu-blocks-override", "12"]
    flags = own.command()
    # vLLM's parser keeps the last value given: the server's own, after the cluster's.
    assert flags.count("--num-gpu-blocks-override") == 2
    assert flags[-2:] == ["--num-gpu-blocks-override", "12"]
    plain = Cluster(tmp_path, tmp_path / "model").add_server("s", None, core=1).command()
    assert "--num-gpu-blocks-override" not in plain
