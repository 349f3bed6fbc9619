"""vLLM's KV cache groups, as kvpush moves them.

With vLLM's hybrid KV cache manager (kvpush is `SupportsHMA`), a model whose layers
attend differently gets one KV cache group per kind: full attention, sliding window.
The groups overlay the same memory (one layer of each shares each tensor), so a
block id names bytes in one group at a time, and the pair of ids at a block position
moves through every tensor (kvpush.layout). A transfer carries one list: position i's
id of each group in turn.

A group kvpush cannot move is refused at start, naming it: recurrent state (Mamba,
gated DeltaNet), chunked local attention, groups of another block size, groups
vLLM keeps out of transfers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpush.errors import ConfigError

# vLLM pads a block table's positions that a sliding window left with its null block,
# the first block its pool hands out (id 0), which no request ever holds.
NULL_BLOCK = 0


def transfer_groups(kv_cache_config: Any) -> int:
    """How many KV cache groups a transfer carries (1 without the hybrid manager).
    ConfigError names a group kvpush cannot move, a lone one too: a pure Mamba
    model has one group, of recurrent state."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    sizes = set()
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if not _attention_kv(spec):
            raise ConfigError(
                f"KV cache group {index} ({kind}, layers {group.layer_names[:3]}) is not "
                "attention KV: kvpush moves full-attention and sliding-window groups only "
                "(recurrent state such as Mamba's or gated DeltaNet's is not built)"
            )
        if len(groups) > 1 and not getattr(group, "enable_kv_transfer", True):
            raise ConfigError(
                f"KV cache group {index} ({kind}) is kept out of KV transfers by vLLM; "
                "kvpush cannot pair its block positions"
            )
        sizes.add(spec.block_size)
    if len(sizes) > 1:
        raise ConfigError(
            f"the KV cache groups have different block sizes {sorted(sizes)}: kvpush moves "
            "hybrid models whose groups share one block size"
        )
    return max(1, len(groups))


def _attention_kv(spec: Any) -> bool:
    """Full attention (MLA included) or a sliding window, alone or as the one kind of
    a group whose layers differ only in size."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return all(_attention_kv(inner) for inner in spec.kv_cache_specs.values())
    return isinstance(spec, FullAttentionSpec | SlidingWindowSpec)


def windows(kv_cache_config: Any) -> tuple[int, ...]:
    """Each KV cache group's sliding window in tokens (0: full attention)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return tuple(getattr(g.kv_cache_spec, "sliding_window", None) or 0 for g in groups)


def window_lost(
    groups: Sequence[Sequence[int]], windows: Sequence[int], prompt_len: int, block_size: int
) -> list[int]:
    """The groups in which vLLM freed a block a finished prefill leg's decode reads:
    decode recomputes the prompt's last token, whose window reaches back to token
    prompt_len - window, so from that token's block on none may be the null block."""
    lost = []
    for index, (blocks, window) in enumerate(zip(groups, windows, strict=False)):
        first = max(0, prompt_len - window) // block_size if window else 0
        if NULL_BLOCK in blocks[first:]:
            lost.append(index)
    return lost
