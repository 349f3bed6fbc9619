"""The soak's seeded request mix: what each request asks and how its client behaves.

Same seed, same requests, in the same order: a soak that found something can be run
again. Shares of each feature are fixed here (a soak is a regression check, not a
survey); the share of clients that disconnect is a setting.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from kvpush.demo.servers import MODEL_NAME

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

CHAT_SHARE = 0.3
STREAM_SHARE = 0.5
N2_SHARE = 0.2  # n=2 takes seeded sampling: vLLM refuses n > 1 with greedy
# Of one-choice streams: unseeded at vLLM's default temperature (1), the request most
# clients send. Not compared with a plain instance (no seed), but it must not fail.
SAMPLED_STREAM_SHARE = 0.3
LIST_SHARE = 0.1  # of completions: a list of two prompts
SHARED_PREFIX_SHARE = 0.25  # of single-prompt completions: one of a few long prefixes
AT_LIMIT_SHARE = 0.05  # prompts exactly as long as the context allows
MAX_TOKENS = 24
PREFIXES = 4
SPECIAL = 6  # the tiny model's special token ids, 0-5: never in a prompt
VOCAB = 2048
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "an", "el", "st")
# A chat word is at most a few tokens and the template adds a few: chat prompts stay
# below the context limit at up to this many words per token of context.
CHAT_WORDS_PER_TOKEN = 1 / 8


@dataclass(frozen=True)
class Shape:
    """One request of the mix: its endpoint and body, and how its client behaves."""

    index: int
    path: str
    body: dict[str, Any]
    prompt_lens: tuple[int, ...]  # tokens of each prompt (chat: words of the message)
    shared_prefix: bool
    disconnect_after_s: float | None  # the client goes away this long after sending

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def n(self) -> int:
        return int(self.body.get("n", 1))

    @property
    def deterministic(self) -> bool:
        """Greedy or seeded: a plain instance must answer it the same, token for token."""
        return self.body.get("temperature") == 0 or "seed" in self.body

    def describe(self) -> dict[str, Any]:
        """What the request was, for its JSON line (not its token ids)."""
        return {
            "endpoint": self.path, "stream": self.stream, "n": self.n,
            "prompts": len(self.prompt_lens), "prompt_lens": list(self.prompt_lens),
            "max_tokens": self.body["max_tokens"], "shared_prefix": self.shared_prefix,
            "deterministic": self.deterministic, "disconnect_after_s": self.disconnect_after_s,
        }  # fmt: skip


def mix(count: int, seed: int, max_model_len: int, disconnect_share: float) -> list[Shape]:
    """`count` requests drawn from `seed`; every prompt fits `max_model_len` with its
    output."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randint(128, max_model_len // 2)) for _ in range(PREFIXES)]
    return [_shape(rng, index, max_model_len, prefixes, disconnect_share) for index in range(count)]


def _shape(
    rng: random.Random,
    index: int,
    max_model_len: int,
    prefixes: list[list[int]],
    disconnect_share: float,
) -> Shape:
    max_tokens = rng.randint(1, MAX_TOKENS)
    room = max_model_len - max_tokens  # the longest prompt this request may have
    body: dict[str, Any] = {
        "model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": rng.random() < STREAM_SHARE,
    }  # fmt: skip
    if rng.random() < N2_SHARE:
        body.update(n=2, temperature=0.8, seed=rng.randrange(1 << 30))
    elif body["stream"] and rng.random() < SAMPLED_STREAM_SHARE:
        del body["temperature"]
    shared = False
    if rng.random() < CHAT_SHARE:
        path = CHAT
        words = _length(rng, max(1, int(room * CHAT_WORDS_PER_TOKEN)))
        body["messages"] = [{"role": "user", "content": _words(rng, words)}]
        lens: tuple[int, ...] = (words,)
    elif rng.random() < LIST_SHARE:
        path = COMPLETIONS
        prompts = [_tokens(rng, _length(rng, room)) for _ in range(2)]
        body["prompt"] = prompts
        lens = tuple(len(p) for p in prompts)
    else:
        path = COMPLETIONS
        shared = rng.random() < SHARED_PREFIX_SHARE
        if shared:
            prefix = rng.choice(prefixes)
            tokens = prefix + _tokens(rng, _length(rng, room - len(prefix)))
        else:
            tokens = _tokens(rng, _length(rng, room))
        body["prompt"] = tokens
        lens = (len(tokens),)
    disconnect = None
    if rng.random() < disconnect_share:
        disconnect = round(rng.uniform(0.05, 1.0), 3)
    return Shape(index, path, body, lens, shared, disconnect)


def _length(rng: random.Random, longest: int) -> int:
    """1 to `longest`, log-uniform (short and long prompts alike), and now and then
    exactly `longest`: the context limit."""
    if rng.random() < AT_LIMIT_SHARE:
        return longest
    return min(longest, max(1, round(math.exp(rng.uniform(0, math.log(longest))))))


def _tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(SPECIAL, VOCAB) for _ in range(length)]


def _words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choices(SYLLABLES, k=rng.randint(1, 3))) for _ in range(count))
