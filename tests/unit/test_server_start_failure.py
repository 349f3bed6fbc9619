"""A vLLM server that fails to start names the engine's own exception last: CI shows
only the end of a failed run, and vLLM's last line there is a generic one."""

import subprocess

import pytest

from kvpush.demo.servers import ServerSpec, VllmServer, root_cause
from kvpush.errors import KVPushError
from kvpush.ports import free_port

ENGINE_LOG = """\
(EngineCore pid=11) ERROR EngineCore failed to start.
(EngineCore pid=11) Traceback (most recent call last):
(EngineCore pid=11)   File "core.py", line 9, in run_engine_core
(EngineCore pid=11) ValueError: No available memory for the cache blocks.
(APIServer pid=10) Traceback (most recent call last):
(APIServer pid=10)   File "utils.py", line 1431, in wait_for_engine_startup
(APIServer pid=10) RuntimeError: Engine core initialization failed. See root cause above.
"""


def test_the_engine_cores_exception_is_named_not_vllms_generic_line():
    cause = root_cause(ENGINE_LOG)
    assert cause.endswith("ValueError: No available memory for the cache blocks.")


def test_a_log_without_an_exception_says_so():
    assert "no exception" in root_cause("INFO starting\nKilled\n")


def test_a_server_that_never_answers_is_named_last(tmp_path):
    spec = ServerSpec("stuck_decode", tmp_path, free_port())
    server = VllmServer(spec, tmp_path)
    server.process = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        with pytest.raises(KVPushError) as failure:
            server.wait_healthy(timeout=1.5)
    finally:
        server.stop()
    last = str(failure.value).splitlines()[-1]
    assert last.startswith("stuck_decode: no answer on /health") and "still running" in last


def test_vllms_socket_directory_is_short_whatever_the_work_directory_and_goes_on_stop(
    tmp_path, monkeypatch
):
    """vLLM's ZeroMQ sockets are files in its TMPDIR, and a socket's path must fit in
    107 bytes: a deep work directory (pytest's under xdist) must not push them over."""
    workdir = tmp_path / ("deep" * 20)
    spec = ServerSpec("pull_prefill_other_kv", tmp_path, free_port())
    server = VllmServer(spec, workdir)
    # start() as it is, with a child that is not vLLM.
    monkeypatch.setattr(server, "command", lambda: ["sleep", "30"])
    server.start()
    try:
        scratch = server.environment()["TMPDIR"]
        assert len(scratch) + len("/ffffffff-ffff-ffff-ffff-ffffffffffff") < 107
        assert server.scratch.is_dir()
    finally:
        server.stop()
    assert not server.scratch.exists()


def test_the_servers_of_one_work_directory_share_vllms_cache_and_nothing_else(
    tmp_path, monkeypatch
):
    """vLLM inspects a model's class in a subprocess that imports vLLM again, unless
    its cache already holds the answer: every server but the first of a work
    directory finds it there (or of the run, where VLLM_CACHE_ROOT names one).
    Sockets and compiled kernels stay each server's own."""
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    one, other = (VllmServer(ServerSpec(name, tmp_path, free_port()), tmp_path / "work")
                  for name in ("prefill", "decode"))  # fmt: skip
    envs = [one.environment(), other.environment()]
    assert envs[0]["VLLM_CACHE_ROOT"] == envs[1]["VLLM_CACHE_ROOT"]
    assert (tmp_path / "work" / "vllm-cache").is_dir()
    for name in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert envs[0][name] != envs[1][name], name
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "run-cache"))
    assert one.environment()["VLLM_CACHE_ROOT"] == str(tmp_path / "run-cache")
