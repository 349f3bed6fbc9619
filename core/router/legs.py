"""The two legs of a disaggregated request, as plain functions of the client's body.

This is the contract of docs/routing.md, in code: the prefill leg computes the
prompt's KV and one token, never streams, and names the transfer; the decode leg
is the client's own request plus the transfer id and the producer's identity.
"""

from __future__ import annotations

import uuid
from typing import Any

from kvpush.identities import InstanceIdentity, decode_params


def new_transfer_id() -> str:
    """Fresh for every dispatch, retries included: a retry never gets old bytes."""
    return f"xfer-{uuid.uuid4().hex}"


# What only shapes generated text. A prefill leg keeps everything else of the
# client's body, because everything else may decide the prompt's tokens (model,
# prompt or messages, chat template options, tools, truncation, cache salt, ...) and
# prefill's tokens must be decode's. These go: prefill generates one token nobody
# reads, so they would only cost it work (n choices, logprobs, structured output),
# make a one-token request invalid (min_tokens > 1), or trip the engine (seeded
# sampling of several choices).
GENERATION_ONLY = frozenset(
    {
        "stream", "stream_options", "n", "best_of", "seed", "use_beam_search",
        "max_tokens", "max_completion_tokens", "min_tokens", "ignore_eos",
        "stop", "stop_token_ids", "include_stop_str_in_output", "bad_words",
        "logprobs", "top_logprobs", "prompt_logprobs", "echo",
        "return_token_ids", "return_tokens_as_token_ids", "skip_special_tokens",
        "spaces_between_special_tokens", "logit_bias", "allowed_token_ids",
        "logits_processors", "response_format", "structured_outputs", "guided_json",
        "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "guided_whitespace_pattern", "temperature", "top_p", "top_k", "min_p",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty",
    }
)  # fmt: skip


def prefill_leg(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The client's request cut to its prompt: one greedy token, never streamed."""
    leg = {k: v for k, v in body.items() if k not in GENERATION_ONLY}
    leg["max_tokens"] = 1
    leg["temperature"] = 0
    leg["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return leg


def decode_leg(
    body: dict[str, Any], transfer_id: str, identity: InstanceIdentity
) -> dict[str, Any]:
    """The client's request, told where its KV comes from."""
    leg = dict(body)
    leg["kv_transfer_params"] = decode_params(transfer_id, identity)
    return leg


def openai_error(message: str, kind: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
