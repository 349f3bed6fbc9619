"""A choice carried on by a request of its own, when decode's stream cannot carry it
(its first token diverged from prefill's, or its leg broke off): what that request
is sent, where it starts, and how its events read as the client's stream
(kvpush.router.first_token)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kvpush.router.legs import GENERATION_ONLY


def continuation_leg(
    body: dict[str, Any], prompt: list[int], had: list[int], chat: bool
) -> dict[str, Any]:
    """A choice's own request from the tokens the client has (`had`): its prompt plus
    those, the rest to generate, on the completions endpoint (it takes token ids)."""
    # The prompt is token ids now; what else the client sent besides generation
    # settings named the prompt's text, except the model, its cache salt (decode's
    # cached prompt blocks are salted with it) and its priority.
    kept = ("model", "cache_salt", "priority")
    leg = {k: v for k, v in body.items() if k in GENERATION_ONLY or k in kept}
    for key in ("n", "best_of", "echo", "prompt_logprobs", "max_completion_tokens",
                "logprobs", "top_logprobs", "response_format", "structured_outputs"):  # fmt: skip
        leg.pop(key, None)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(limit, int):
        leg["max_tokens"] = max(1, limit - len(had))
    if body.get("min_tokens"):
        leg["min_tokens"] = max(0, body["min_tokens"] - len(had))
    if chat and body.get("logprobs"):
        leg["logprobs"] = body.get("top_logprobs") or 0
    elif not chat and body.get("logprobs") is not None:
        leg["logprobs"] = body["logprobs"]
    leg.update(prompt=[*prompt, *had], stream=True, return_token_ids=True)
    leg["stream_options"] = {"include_usage": False}
    return leg


class Departed(Exception):
    """A continuation generated text other than what the client already has."""


TextOf = Callable[[list[int]], Awaitable[str]]
# Tokens looked at, from the last back, for where the client's text ends: text held
# back is at most the longest stop string or one character, a few tokens at most.
RESUME_SCAN = 64
# Prompt tokens detokenized before a continuation's, so that a tokenizer that drops
# a leading space (SentencePiece) reads them as the stream did, mid-sequence.
CONTEXT = 4


async def resume_point(had: list[int], sent: str, text_of: TextOf) -> tuple[int, str]:
    """The longest start of `had` whose text is a start of `sent` (the client's
    text), and the text the client has past it. Past RESUME_SCAN tokens it starts
    over from none: then the continuation must generate `sent` again."""
    for kept in range(len(had), max(len(had) - RESUME_SCAN, 0), -1):
        text = await text_of(had[:kept])
        if sent.startswith(text):
            return kept, sent[len(text) :]
    return 0, sent


def text_in_context(prompt: list[int], detokenize: TextOf) -> TextOf:
    """The text of generated ids as a stream after `prompt` shows it, from a
    detokenizer of whole sequences."""
    context = prompt[-CONTEXT:]
    before: list[str] = []

    async def text_of(ids: list[int]) -> str:
        if not ids:
            return ""
        if not before:
            before.append(await detokenize(context))
        whole = await detokenize([*context, *ids])
        return whole[len(before[0]) :] if whole.startswith(before[0]) else whole

    return text_of


def ids_of(event: dict[str, Any]) -> list[int]:
    choices = event.get("choices") or [{}]
    return list(choices[0].get("token_ids") or [])


def as_client_event(
    event: dict[str, Any], index: int, chat: bool, head: dict[str, Any], wants_ids: bool
) -> dict[str, Any] | None:
    """A completions event of a continuation as choice `index` in the client's
    stream, chat's shape or completions'."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    ids = ids_of(event)
    base = {**event, **head, "object": "chat.completion.chunk" if chat else "text_completion"}
    base.pop("usage", None)
    if chat:
        out = {"index": index, "delta": {"content": choice.get("text") or ""},
               "logprobs": _chat_logprobs(choice.get("logprobs")),
               "finish_reason": choice.get("finish_reason"),
               "token_ids": ids if wants_ids else None}  # fmt: skip
        if choice.get("finish_reason"):
            out["stop_reason"] = choice.get("stop_reason")
    else:
        out = {**choice, "index": index, "prompt_token_ids": None,
               "token_ids": ids if wants_ids else None}  # fmt: skip
    return {**base, "choices": [out]}


def _chat_logprobs(logprobs: Any) -> Any:
    """Completions-style logprobs as chat's: one entry per token."""
    if not isinstance(logprobs, dict):
        return None
    entries = []
    tops = logprobs.get("top_logprobs") or []
    for i, (token, value) in enumerate(
        zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [], strict=False)
    ):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        entries.append({
            "token": token, "logprob": value, "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top.items()
            ],
        })  # fmt: skip
    return {"content": entries}
