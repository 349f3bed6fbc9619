"""The two legs the router cuts from a client's body."""

from __future__ import annotations

from kvpush.identities import InstanceIdentity
from kvpush.router.legs import decode_leg, prefill_leg


def test_prefill_leg_keeps_what_decides_the_prompt_and_drops_what_shapes_the_answer():
    body = {
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False}, "add_special_tokens": False,
        "tools": [{"type": "function", "function": {"name": "f"}}], "cache_salt": "s",
        "truncate_prompt_tokens": 100,
        "n": 2, "seed": 7, "min_tokens": 4, "max_completion_tokens": 50, "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 3,
        "stop": ["x"], "temperature": 0.9, "response_format": {"type": "json_object"},
        "best_of": 3, "echo": True, "prompt_logprobs": 1,
    }  # fmt: skip
    leg = prefill_leg(body, "xfer-1")
    assert leg == {
        "model": "m", "messages": body["messages"],
        "chat_template_kwargs": {"enable_thinking": False}, "add_special_tokens": False,
        "tools": body["tools"], "cache_salt": "s", "truncate_prompt_tokens": 100,
        "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "xfer-1"},
    }  # fmt: skip
    assert body["n"] == 2 and body["stream"]  # the client's body is left alone


def test_decode_leg_is_the_clients_request_told_where_its_kv_comes_from():
    body = {"model": "m", "prompt": [[1, 2], [3]], "n": 2, "seed": 7, "min_tokens": 4}
    identity = InstanceIdentity(engine_id="e", epoch="x", transfer_mode="push", tp_size=1,
                                addresses=["h:1"])  # fmt: skip
    leg = decode_leg(body, "xfer-1", identity)
    assert {k: v for k, v in leg.items() if k != "kv_transfer_params"} == body
    assert leg["kv_transfer_params"]["transfer_id"] == "xfer-1"
    assert leg["kv_transfer_params"]["remote_addresses"] == ["h:1"]
