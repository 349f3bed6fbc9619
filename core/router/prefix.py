"""Which prompt prefixes each instance holds in its KV cache, approximately.

Two sources feed one index. An instance that publishes vLLM's KV-cache events
(kv_events.py) tells it each block it stores and drops; for any other, the router
records the blocks of each prompt it sends there (its own approximation, which
forgets the oldest first and knows nothing of vLLM's evictions).

A block is named by a chain hash of its tokens and its parent's name, computed
here from token ids (vLLM's own hashes are seeded per process, so they are only
mapped: an event's hash to the name made from its token ids). A prompt's cached
part on an instance is its longest run of leading blocks the instance holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

DEFAULT_BLOCK = 16  # tokens per block where an instance has not said
CAPACITY = 200_000  # blocks remembered per instance (the least recently used go first)
ROOT = 0


def chain(tokens: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The names of `tokens`' whole blocks, each from its parent's."""
    names = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        names.append(parent)
    return names


class Blocks:
    """One instance's blocks, by name, least recently used first."""

    def __init__(self, block_size: int = DEFAULT_BLOCK, capacity: int = CAPACITY) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.names: OrderedDict[int, None] = OrderedDict()
        self.published: dict[Any, int] = {}  # vLLM's hash -> our name (events only)
        self.from_events = False  # fed by KV events: the router records nothing itself

    def cached_tokens(self, tokens: Sequence[int], names: list[int] | None = None) -> int:
        """How many leading tokens of a prompt this instance holds."""
        held = 0
        for name in names if names is not None else chain(tokens, self.block_size):
            if name not in self.names:
                break
            self.names.move_to_end(name)
            held += 1
        return held * self.block_size

    def add(self, names: Iterable[int]) -> None:
        for name in names:
            self.names[name] = None
            self.names.move_to_end(name)
        while len(self.names) > self.capacity:
            self.names.popitem(last=False)

    # -- vLLM's KV-cache events ---------------------------------------------------

    def stored(self, hashes: list[Any], parent: Any, token_ids: list[int], block_size: int) -> None:
        """vLLM stored blocks `hashes`, of `token_ids`, after block `parent`."""
        self.from_events = True
        if block_size != self.block_size:
            self.block_size = block_size  # names of another size never match: start over
            self.clear()
        head = ROOT if parent is None else self.published.get(parent)
        if head is None:
            return  # its parent was never heard of (events missed): unnameable
        names = chain(token_ids, block_size, head)
        for vllm_hash, name in zip(hashes, names, strict=False):
            self.published[vllm_hash] = name
        self.add(names)

    def removed(self, hashes: list[Any]) -> None:
        for vllm_hash in hashes:
            name = self.published.pop(vllm_hash, None)
            if name is not None:
                self.names.pop(name, None)

    def clear(self) -> None:
        self.names.clear()
        self.published.clear()


class PrefixIndex:
    """Blocks by instance URL."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self.instances: dict[str, Blocks] = {}

    def of(self, url: str, block_size: int = 0) -> Blocks:
        blocks = self.instances.get(url)
        if blocks is None:
            blocks = Blocks(block_size or DEFAULT_BLOCK, self.capacity)
            self.instances[url] = blocks
        return blocks

    def cached_tokens(
        self, url: str, tokens: Sequence[int], block_size: int = 0,
        chains: dict[int, list[int]] | None = None,
    ) -> int:  # fmt: skip
        """How many leading tokens of a prompt `url` holds. `chains`: the prompt's
        block names by block size, kept by the caller so that asking every instance
        of one prompt hashes it once per block size."""
        blocks = self.of(url, block_size)
        if chains is None:
            return blocks.cached_tokens(tokens)
        names = chains.get(blocks.block_size)
        if names is None:
            names = chains[blocks.block_size] = chain(tokens, blocks.block_size)
        return blocks.cached_tokens(tokens, names)

    def sent(self, url: str, tokens: Sequence[int], block_size: int = 0) -> None:
        """A prompt went to `url`: it holds its blocks after (unless events say)."""
        blocks = self.of(url, block_size)
        if not blocks.from_events:
            blocks.add(chain(tokens, blocks.block_size))

    def forget(self, url: str) -> None:
        self.instances.pop(url, None)
