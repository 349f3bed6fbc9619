"""A streaming client's first token, taken from the prefill leg.

The prefill leg samples one token anyway. Given the client's sampling parameters and
the decode leg's seed, it is the token decode samples first, so the router streams
it as soon as prefill answers, and from decode's stream relays the rest: the client's
first token no longer waits for the hand-off and decode's first step.

Decode's own first token is checked against prefill's, per choice. From the same KV,
seed and parameters they can still differ where the two engines' logits do in their
last bits at a near tie (never seen here on the CPU build, but not ruled out). The
client already holds prefill's token, so such a choice is not taken from decode's
stream: it continues from a request of its own (kvpush.router.continuation), from
the first text the client does not have (decode's prefix cache holds the prompt's
KV by then).

Prefill's token is streamed only as vLLM would have streamed it after one token:
text that may begin a stop string is held back (`released`).

Everything here is a function of JSON: what each leg is sent, the client's opening
events, and `DecodeEdit`, which takes decode's events and says what the client gets.
The shells, the router (first_token_relay.py) and Ray (kvpush.ray_stream), do the
I/O. What it does not serve this way is relayed as before, and `not_served` names
why: `n` > 1, beam search, `echo`, prompt logprobs, tools (a tool parser would read
the first token differently streamed than whole), structured output (a continuation
would start its grammar over), media (a continuation of token ids would lose them),
unseeded sampling where an engine cannot take a seed it was not sent (below), and an
answer not shaped as expected.

Both legs must sample alike, so a sampled request needs one seed on both. A seed the
client did not send is one the router would mint, and vLLM gives a seeded request a
generator of its own, which it rewinds in every step that computes a chunk of that
request's prompt. A CPU generator cannot rewind: the engine core raises and dies,
failing every request in flight. So a minted seed goes only to instances whose
identity says their generators rewind (`seeds_rewind`: vLLM on CUDA); elsewhere an
unseeded sampled stream gets decode's own first token.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpush.identities import PROMPT_CUT
from kvpush.router.continuation import (
    Departed,
    TextOf,
    as_client_event,
    ids_of,
    resume_point,
)

# Fields of the client's body that keep a request on the relay-only path.
NOT_SERVED = ("use_beam_search", "echo", "prompt_logprobs", "tools")
# Structured output: a choice continued from the tokens the client has (a diverged
# first token, a decode that broke off) would start its grammar over at the
# continuation's first token, so it could leave the schema. Relayed instead.
GRAMMARS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
            "guided_grammar")  # fmt: skip


def not_served(body: dict[str, Any], seeds_rewind: bool = False) -> str | None:
    """Why a request's first token cannot come from its prefill leg (a metric's
    label), or None where it can. `seeds_rewind`: both engines can take a seed the
    client did not send (see the module's docstring)."""
    if not body.get("stream"):
        return "not_streamed"
    for key in NOT_SERVED:
        if body.get(key):
            return key
    response_format = body.get("response_format")
    text_only = not isinstance(response_format, dict) or (
        response_format.get("type", "text") == "text"
    )
    if any(body.get(key) for key in GRAMMARS) or not text_only:
        return "structured_output"
    # n > 1 makes several engine requests of one prompt: on decode, the siblings of
    # the first read its KV from the prefix cache; a prefill leg of n would compute
    # KV for each, which no decode request claims.
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n"
    if _has_media(body):
        return "media"
    if needs_seed(body) and not seeds_rewind:
        return "unseeded_sampling"
    return None


def serves(body: dict[str, Any], seeds_rewind: bool = False) -> bool:
    """Whether a request's first token can come from its prefill leg."""
    return not_served(body, seeds_rewind) is None


def needs_seed(body: dict[str, Any]) -> bool:
    """Whether both legs would sample alike only with a seed minted for them: a
    sampled request (vLLM's default temperature is 1) that names none."""
    return body.get("seed") is None and not greedy(body)


def greedy(body: dict[str, Any]) -> bool:
    temperature = body.get("temperature")
    return isinstance(temperature, (int, float)) and temperature < _GREEDY_BELOW


_GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature


def _has_media(body: dict[str, Any]) -> bool:
    """Chat content parts other than text, or a completions prompt given as
    embeddings: what a continuation of token ids would drop."""
    if body.get("prompt_embeds") is not None or body.get("multi_modal_data"):
        return True
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type", "text") not in ("text", "input_text")
            for part in content
        ):
            return True
    return False


def with_seed(body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """The body both legs are built from: the client's seed, or for a sampled request
    without one a seed minted here so that both legs sample alike (returned, for the
    trace). A client's null seed is no seed. Only for engines whose generators
    rewind (`not_served`)."""
    if not needs_seed(body):
        return body, None
    seed = secrets.randbelow(2**31)
    return {**body, "seed": seed}, seed


def prefill_leg(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The client's request for one token, not streamed: every field that shapes the
    first token kept (sampling, seed, logprobs, n, stops, bias, grammar)."""
    leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    leg.pop("max_completion_tokens", None)
    leg["max_tokens"] = 1
    if leg.get("min_tokens"):
        leg["min_tokens"] = 1  # still no end of sequence as the first token
    leg["return_token_ids"] = True
    leg["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return leg


def one_token_limit(body: dict[str, Any]) -> bool:
    """Whether the client asked for one token only: then prefill's is the answer."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return limit == 1


def released(text: str, body: dict[str, Any], finished: bool) -> str:
    """What vLLM streams of an answer's `text` so far: a stream that may still end in
    a stop string (and leaves it out) holds back its last characters, as many as the
    longest stop string has less one; a finished one nothing."""
    stops = body.get("stop")
    stops = [stops] if isinstance(stops, str) else [s for s in stops or [] if isinstance(s, str)]
    if finished or not stops or body.get("include_stop_str_in_output"):
        return text
    held = max(len(s) for s in stops) - 1
    return text[: max(len(text) - held, 0)]


@dataclass
class First:
    """One choice's first token as prefill sampled it, and the part of its text that
    a plain instance would have streamed by then (`shown`)."""

    token: int
    text: str
    prompt: list[int]
    finished: bool  # the choice ends at its first token (a stop, or max_tokens 1)
    shown: str = ""


@dataclass
class Opening:
    """What the client is sent before decode says anything, and what it was told."""

    events: list[dict[str, Any]]
    firsts: dict[int, First]
    prompt_tokens: int


def opening(answer: dict[str, Any], body: dict[str, Any], chat: bool) -> Opening | None:
    """The client's first events from prefill's whole answer, as vLLM would have
    streamed them; None where the answer is not what this path can stand on."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        return None
    if (answer.get("kv_transfer_params") or {}).get(PROMPT_CUT):
        return None  # prefill stopped before the prompt's last token: no first token
    wants_ids = bool(body.get("return_token_ids"))
    head = {
        "id": answer.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": answer.get("created"),
        "model": answer.get("model"),
    }
    roles, tokens, firsts = [], [], {}
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        first = _first(choice, answer, body, chat)
        if first is None:
            return None
        index = choice.get("index", 0)
        firsts[index] = first
        finish = choice.get("finish_reason") if first.finished else None
        stop = choice.get("stop_reason") if first.finished else None
        ids = [first.token] if wants_ids else None
        text = first.shown
        if chat:
            role = {"index": index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}  # fmt: skip
            prompt_ids = first.prompt if wants_ids else None
            roles.append({**head, "choices": [role], "prompt_token_ids": prompt_ids,
                          "prompt_text": None})  # fmt: skip
            delta = {"index": index, "delta": {"content": text},
                     "logprobs": choice.get("logprobs"), "finish_reason": finish,
                     "token_ids": ids}  # fmt: skip
            if first.finished:
                delta["stop_reason"] = stop
            tokens.append({**head, "choices": [delta]})
        else:
            tokens.append({**head, "choices": [{
                "index": index, "text": text, "logprobs": choice.get("logprobs"),
                "finish_reason": finish, "stop_reason": stop,
                "prompt_token_ids": first.prompt if wants_ids else None, "token_ids": ids,
            }]})  # fmt: skip
    usage = answer.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens")
    if not isinstance(prompt_tokens, int):
        return None
    return Opening(roles + tokens, firsts, prompt_tokens)


def _first(choice: Any, answer: dict[str, Any], body: dict[str, Any], chat: bool) -> First | None:
    if not isinstance(choice, dict):
        return None
    ids = choice.get("token_ids")
    if not (isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], int)):
        return None
    if chat:
        message = choice.get("message") or {}
        said = {k for k, v in message.items() if v and k not in ("role", "content")}
        if said:  # tool calls, reasoning: what a parser made of the token, not text
            return None
        text, prompt = message.get("content") or "", answer.get("prompt_token_ids")
    else:
        text, prompt = choice.get("text") or "", choice.get("prompt_token_ids")
    if not isinstance(prompt, list):
        return None
    finished = choice.get("finish_reason") == "stop" or one_token_limit(body)
    return First(ids[0], text, prompt, finished, released(text, body, finished))


def decode_leg(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as decode gets it here: token ids on, to check against
    prefill's and to count (the client sees them only if it asked)."""
    return {**body, "return_token_ids": True}


def as_asked(body: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Decode's events without the token ids its leg asked for and the client did
    not: vLLM then sends them as null."""

    def edit(event: dict[str, Any]) -> dict[str, Any]:
        if body.get("return_token_ids"):
            return event
        event = {**event}
        if event.get("prompt_token_ids") is not None:
            event["prompt_token_ids"] = None
        choices = event.get("choices")
        if isinstance(choices, list):
            event["choices"] = [_unasked(c) for c in choices]
        return event

    return edit


def _unasked(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice
    return {k: None if k in ("token_ids", "prompt_token_ids") and v is not None else v
            for k, v in choice.items()}  # fmt: skip


@dataclass
class _Choice:
    first: First
    owed: str  # text the client has that the stream it now reads has not yet repeated
    had: list[int]  # the token ids generated for the client, held-back text's included
    sent: str  # the text the client has
    given: int = 1  # token ids (and logprobs) the client has been given
    checked: bool = False  # decode's first token seen and equal
    ended: bool = False  # decode said it finished
    elsewhere: bool = False  # continued by a request of its own
    skip: int = 0  # a continuation's first tokens that the client was given already


@dataclass(frozen=True)
class Send:
    """Write this event to the client."""

    event: dict[str, Any]


@dataclass(frozen=True)
class Continue:
    """Choice `index` diverged from what the client has: carry it on in a request
    of its own (`resume`, `continued`)."""

    index: int


@dataclass(frozen=True)
class Stop:
    """Read decode's stream no further: it sent an `error` event, or (None) no
    choice is left for it to serve, so closing it stops decode generating."""

    error: dict[str, Any] | None = None


Action = Send | Continue | Stop


@dataclass
class DecodeEdit:
    """Decode's stream as the client gets it after the opening. `feed` takes one of
    decode's events and returns what the shell does with it; `resume` and
    `continued` carry a choice on in a request of its own; `ending` is what the
    client gets after the last event.

    It finishes when every choice has ended or gone elsewhere (`unfinished` is
    empty) or `feed` said Stop; a stream that ends before that leaves `unfinished`
    choices to continue."""

    opening: Opening
    chat: bool
    wants_ids: bool
    usage_asked: bool = False
    choices: dict[int, _Choice] = field(init=False)
    closing: dict[str, Any] | None = field(init=False, default=None)  # decode's usage event

    def __post_init__(self) -> None:
        self.choices = {
            i: _Choice(f, f.shown, [f.token], f.shown, ended=f.finished)
            for i, f in self.opening.firsts.items()
        }
        first = self.opening.events[0]
        self.head = {k: first[k] for k in ("id", "created") if k in first}

    @classmethod
    def start(cls, answer: dict[str, Any], body: dict[str, Any], chat: bool) -> DecodeEdit | None:
        """The edit for a client's `body`, opened by prefill's whole `answer`; None
        where that answer is not what this path can stand on (relay decode's stream
        through `as_asked` instead)."""
        first = opening(answer, body, chat)
        if first is None:
            return None
        usage_asked = bool((body.get("stream_options") or {}).get("include_usage"))
        return cls(first, chat, bool(body.get("return_token_ids")), usage_asked)

    def feed(self, event: dict[str, Any]) -> list[Action]:
        """One of decode's events: the choices to continue elsewhere, then the event
        to send, then Stop where decode's stream should be read no further."""
        if "error" in event:
            return [Stop(event)]
        out, diverged = self.edit(event)
        actions: list[Action] = [Continue(i) for i in diverged]
        if out is not None:
            actions.append(Send(out))
        if diverged and not self.unfinished():
            actions.append(Stop())
        return actions

    def ending(self) -> list[dict[str, Any]]:
        """The events after the last token: the usage, if the client asked for it."""
        return [self.usage()] if self.usage_asked else []

    def edit(self, event: dict[str, Any]) -> tuple[dict[str, Any] | None, list[int]]:
        if "error" in event or not isinstance(event.get("choices"), list):
            return event, []
        if not event["choices"] and event.get("usage"):
            self.closing = event  # sent last, counted again: see usage()
            return None, []
        event = {**event, **self.head}
        if not self.wants_ids and "prompt_token_ids" in event:
            event["prompt_token_ids"] = None
        kept, diverged = [], []
        for choice in event["choices"]:
            state = self.choices.get(choice.get("index", 0)) if isinstance(choice, dict) else None
            if state is None or state.ended or state.elsewhere:
                continue  # not a choice the client was opened with, or one it has whole
            edited = self._edit_choice(state, choice)  # parsed for us alone: edited in place
            if edited is _DIVERGED:
                state.elsewhere = True
                diverged.append(choice.get("index", 0))
            elif edited is not None:
                kept.append(edited)
        if not kept and not event.get("usage"):
            return None, diverged
        return {**event, "choices": kept}, diverged

    def _edit_choice(self, state: _Choice, choice: dict[str, Any]) -> Any:
        ids = choice.get("token_ids") or []
        logprobs = choice.get("logprobs")
        if ids and not state.checked:
            if ids[0] != state.first.token:
                return _DIVERGED
            state.checked = True
            ids = ids[1:]
            logprobs = _drop(logprobs, self.chat, 1)
        text = _unowed(state, self._text(choice))
        if text is _DIVERGED:
            return _DIVERGED
        if self.chat:
            delta = {k: v for k, v in (choice.get("delta") or {}).items() if k != "role"}
            delta["content"] = text
            choice["delta"] = delta
            said = any(v for k, v in delta.items() if k != "content")
        else:
            choice["text"] = text
            if not self.wants_ids:
                choice["prompt_token_ids"] = None
            said = False
        choice["logprobs"] = logprobs
        choice["token_ids"] = ids if self.wants_ids else None
        state.had += ids
        state.given += len(ids)
        state.sent += text
        state.ended = bool(choice.get("finish_reason"))
        if not (text or ids or said or state.ended):
            return None
        return choice

    def _text(self, choice: dict[str, Any]) -> str:
        if self.chat:
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""

    def unfinished(self) -> list[int]:
        """The choices neither ended nor continued elsewhere: what a decode leg that
        broke off leaves to continue."""
        return [i for i, c in self.choices.items() if not (c.ended or c.elsewhere)]

    async def resume(self, index: int, text_of: TextOf) -> list[int]:
        """Choice `index`, to be continued by a request of its own: the tokens that
        request starts after. Those are the longest start of what was generated whose
        text the client has whole, so that text a stream held back (a possible stop
        string, a character split over tokens) is generated again, not skipped."""
        state = self.choices[index]
        state.elsewhere = True
        kept, state.owed = await resume_point(state.had, state.sent, text_of)
        state.had = state.had[:kept]
        state.skip = state.given - kept
        return state.had

    def continued(self, index: int, event: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation's completions event as choice `index` of the client's
        stream (what it counts toward usage noted). Raises Departed where its text
        leaves what the client has already."""
        state = self.choices[index]
        ids = ids_of(event)
        event = self._unrepeated(state, event)
        out = as_client_event(event, index, self.chat, self.head, self.wants_ids)
        if out is None:
            return None
        choice = out["choices"][0]
        text = _unowed(state, self._text(choice))
        if text is _DIVERGED:
            raise Departed(f"choice {index}'s continuation departed from the text the "
                           "client has")  # fmt: skip
        if self.chat:
            choice["delta"] = {**choice["delta"], "content": text}
        else:
            choice["text"] = text
        state.had += ids
        state.given += len(ids_of(event))
        state.sent += text
        state.ended = state.ended or bool(choice.get("finish_reason"))
        return out

    def _unrepeated(self, state: _Choice, event: dict[str, Any]) -> dict[str, Any]:
        """A continuation's event without the token ids and logprobs of tokens the
        client was given already (generated again, their text held back before)."""
        if not state.skip:
            return event
        choices = event.get("choices")
        if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
            return event
        choice = choices[0]
        ids = list(choice.get("token_ids") or [])
        drop = min(state.skip, len(ids))
        state.skip -= drop
        choice = {**choice, "token_ids": ids[drop:],
                  "logprobs": _drop(choice.get("logprobs"), False, drop)}  # fmt: skip
        return {**event, "choices": [choice, *choices[1:]]}

    def usage(self) -> dict[str, Any]:
        """The closing usage event: decode's, or one made here if decode sent none,
        counting the tokens the client got (continuations' included, decode's
        discarded ones not)."""
        head = self.opening.events[0]
        event = self.closing or {
            **{k: head[k] for k in ("id", "object", "created", "model") if k in head},
            "choices": [],
            "usage": {"prompt_tokens": self.opening.prompt_tokens},
        }
        completion = sum(len(c.had) for c in self.choices.values())
        usage = {**event["usage"], "completion_tokens": completion}
        usage["total_tokens"] = usage.get("prompt_tokens", self.opening.prompt_tokens) + completion
        return {**event, **self.head, "usage": usage}


_DIVERGED = object()


def _unowed(state: _Choice, text: str) -> Any:
    """`text` less what the client has already (`state.owed`), or _DIVERGED where
    the two disagree."""
    if not state.owed:
        return text
    if text.startswith(state.owed):
        text, state.owed = text[len(state.owed) :], ""
        return text
    if state.owed.startswith(text):
        state.owed = state.owed[len(text) :]
        return ""
    return _DIVERGED


def _drop(logprobs: Any, chat: bool, count: int) -> Any:
    """Logprobs without their first `count` tokens' entries."""
    if not isinstance(logprobs, dict) or not count:
        return logprobs
    if chat:
        return {**logprobs, "content": (logprobs.get("content") or [])[count:]}
    return {k: v[count:] if isinstance(v, list) else v for k, v in logprobs.items()}
