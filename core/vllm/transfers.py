"""One transfer per engine request, named alike on both sides without talking.

A router mints one transfer id per client request, but one client request can
become several engine requests that all carry it: a list of prompts (one engine
request per prompt) and `n > 1` (one per choice). Engine request ids are made up by
each server on its own, so they cannot pair the two sides. What both sides do see
alike is the transfer id, each engine request's prompt, and the order in which the
engine requests of one client request arrive. So the engine transfer id is

    <router's transfer id>/<digest of the prompt>.<k>

where k counts earlier engine requests of the same client request with the same
prompt: 0 for the only one, 1.. for siblings (`n > 1`, or a prompt listed twice).

An orchestrator that retries a prefill leg under the same request id makes prefill
count the retry as one more sibling (k = 1), while its decode leg, a single
request, would count 0. So prefill's echo names the engine transfer id it used
(`remote_transfer_id`), and a decode leg carrying the echo takes k from it.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvpush.protocol.messages import MAX_TRANSFER_ID

# Siblings arrive within one add_request burst: a few thousand client requests of
# memory is far more than enough, and bounds it.
_MEMORY = 16384


def prompt_digest(token_ids: Sequence[int], extra: Sequence[str] = ()) -> str:
    """A short digest of what determines a prompt's KV: its tokens, media and LoRA
    adapter (`extra`)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(array("q", token_ids).tobytes())
    for item in extra:
        h.update(b"\0" + item.encode())
    return h.hexdigest()


def engine_transfer_id(base: str, digest: str, occurrence: int) -> str:
    derived = f"{base}/{digest}.{occurrence}"
    if len(derived) <= MAX_TRANSFER_ID:
        return derived
    # A very long router id: keep it unique, not readable.
    short = hashlib.blake2b(base.encode(), digest_size=16).hexdigest()
    return f"{short}/{digest}.{occurrence}"


class EngineTransfers:
    """Assigns each engine request its engine transfer id, in arrival order."""

    def __init__(self, memory: int = _MEMORY, model: str = "") -> None:
        self._memory = memory
        # The served model name: a prefill and a decode serving different models
        # (two fine-tunes of one architecture share a KV layout) derive different ids.
        self._model = model
        self._counts: OrderedDict[tuple[str, str], list[str]] = OrderedDict()
        self._of: dict[str, tuple[str, str | None]] = {}

    def assign(self, request: Any, base: str, named: Any = None) -> tuple[str, str | None]:
        """(engine transfer id, request id of its sibling 0 or None) for `request`;
        the same however often it is asked. `named`: the engine transfer id a
        prefill echo names (a decode leg's `remote_transfer_id`); the first request
        of this prompt takes its k when it is this prompt's."""
        known = self._of.get(request.request_id)
        if known is not None:
            return known
        extra = [*_digested(request), f"model:{self._model}"] if self._model else _digested(request)
        digest = prompt_digest(request.prompt_token_ids or (), extra)
        key = (base, digest)
        seen = self._counts.setdefault(key, [])
        self._counts.move_to_end(key)
        while len(self._counts) > self._memory:
            self._counts.popitem(last=False)
        occurrence = len(seen)
        if not seen:
            occurrence = _named_occurrence(named, engine_transfer_id(base, digest, 0))
        leader = seen[0] if seen else None
        seen.append(request.request_id)
        assigned = (engine_transfer_id(base, digest, occurrence), leader)
        self._of[request.request_id] = assigned
        return assigned

    def forget(self, request_id: str) -> None:
        """The request is finished; siblings still to arrive keep their numbering."""
        self._of.pop(request_id, None)


# How vLLM's API server names engine requests (entrypoints/openai, v1/engine):
#   completions  cmpl-<id>-<prompt index>-<8 random hex>
#   chat         chatcmpl-<id>[_<input index>]-<8 random hex>
# and a choice of n > 1 gets `<choice index>_` in front.
_CHOICE = re.compile(r"^\d+_")
_RANDOM = re.compile(r"-[0-9a-f]{8}$")
_INDEX = {"cmpl-": re.compile(r"-\d+$"), "chatcmpl-": re.compile(r"_\d+$")}


def api_kind(request_id: str) -> str:
    """The endpoint prefix of a request id vLLM's API server made ("cmpl-",
    "chatcmpl-"), or "" for an id in another shape."""
    return next((prefix for prefix in _INDEX if request_id.startswith(prefix)), "")


def api_request_id(engine_request_id: str) -> str:
    """The id of the API request an engine request came from: alike for every prompt
    of a list and every choice of `n`, so all of them can share one transfer id.
    An id in another shape is its own API request."""
    rid = _RANDOM.sub("", _CHOICE.sub("", engine_request_id))
    for prefix, index in _INDEX.items():
        if rid.startswith(prefix):
            return index.sub("", rid)
    return rid


def _named_occurrence(named: Any, first: str) -> int:
    """k of `named` when it is the same transfer as `first` (k = 0) but for k; else 0."""
    stem = first.removesuffix("0")
    if isinstance(named, str) and named.startswith(stem) and named[len(stem) :].isdigit():
        return min(int(named[len(stem) :]), 1 << 20)
    return 0


def _digested(request: Any) -> list[str]:
    """What besides its tokens decides a prompt's KV: a multimodal prompt's inputs
    (placeholder tokens alone do not tell two images apart) and the LoRA adapter
    (two adapters compute different KV from the same tokens)."""
    features = getattr(request, "mm_features", None) or ()
    extra = [str(getattr(f, "identifier", "")) for f in features]
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extra.append(f"lora:{getattr(lora, 'lora_name', '')}")  # ids differ by server
    return extra
