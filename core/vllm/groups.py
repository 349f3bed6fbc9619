"""vLLM's KV cache groups, as kvpush moves them.

With vLLM's hybrid KV cache manager (kvpush is `SupportsHMA`), a model whose layers
attend differently gets one KV cache group per kind: full attention, sliding window.
The groups overlay the same memory (one layer of each shares each tensor), so a
block id names bytes in one group at a time, and the pair of ids at a block position
moves through every tensor (kvpush.layout). A transfer carries one list: position i's
id of each group in turn.

A recurrent-state group (Mamba, gated DeltaNet) overlays the same memory: a block
of it is one request's whole state after some token, and only the last one a
request holds matters to decode (kvpush.engine.steps.state_positions). Its state
after the whole prompt would make decode, which recomputes the last prompt token,
apply that token twice, so a prefill leg of such a model computes all but the last
token (`leave_last_token`, through the `prompt_cut` hook), as upstream's connector
does.

A group kvpush cannot move is refused at start, naming it: a model of recurrent
state alone, speculative state slots, chunked local attention, groups of another
block size, groups vLLM keeps out of transfers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpush.errors import ConfigError
from kvpush.identities import PROMPT_CUT
from kvpush.vllm import hooks

# vLLM pads a block table's positions that a sliding window left with its null block,
# the first block its pool hands out (id 0), which no request ever holds.
NULL_BLOCK = 0


def transfer_groups(kv_cache_config: Any) -> int:
    """How many KV cache groups a transfer carries (1 without the hybrid manager).
    ConfigError names a group kvpush cannot move, a lone one too: a pure Mamba
    model has one group, of recurrent state."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    states = recurrent(kv_cache_config)
    sizes = set()
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if index in states:
            _check_state(index, group, len(states) == len(groups))
            continue
        if not _attention_kv(spec):
            raise ConfigError(
                f"KV cache group {index} ({kind}, layers {group.layer_names[:3]}) is not "
                "attention KV or recurrent state: kvpush moves full-attention, "
                "sliding-window and Mamba-style state groups only"
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


def recurrent(kv_cache_config: Any) -> tuple[int, ...]:
    """The KV cache groups that hold recurrent state (Mamba, gated DeltaNet)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return tuple(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec))


def state_layers(kv_cache_config: Any) -> frozenset[str]:
    """The layers of the recurrent-state groups."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return frozenset(name for i in recurrent(kv_cache_config) for name in groups[i].layer_names)


def _check_state(index: int, group: Any, alone: bool) -> None:
    spec = group.kv_cache_spec
    if alone:
        raise ConfigError(
            f"KV cache group {index} ({type(spec).__name__}) holds recurrent state, and no "
            "group holds attention KV: kvpush moves a model's state beside its attention "
            "KV, and a model of Mamba-style layers alone is not built"
        )
    if spec.num_speculative_blocks:
        raise ConfigError(
            f"KV cache group {index} keeps {spec.num_speculative_blocks} speculative state "
            "slots a request (speculative decoding): kvpush moves a request's one "
            "running state, and cannot tell it from those slots"
        )
    if getattr(spec, "tp_replicated", False):
        raise ConfigError(
            f"KV cache group {index} holds recurrent state every TP rank keeps whole: "
            "kvpush moves TP-sharded state (gated DeltaNet, Mamba) only"
        )


def leave_last_token(request: Any) -> bool:
    """Have a prefill leg of a recurrent-state model compute all but its prompt's last
    token (the decode leg computes that one from the state before it). Once a
    request: vLLM may hand it over again after a preemption. True if cut."""
    params = request.kv_transfer_params
    tokens = request.prompt_token_ids
    if params is None or params.get(PROMPT_CUT) or tokens is None or len(tokens) < 2:
        return False
    hooks.cut_last_prompt_token(request)
    params[PROMPT_CUT] = True
    return True


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
    groups: Sequence[Sequence[int]],
    windows: Sequence[int],
    prompt_len: int,
    block_size: int,
    states: Sequence[int] = (),
) -> list[int]:
    """The groups in which vLLM freed a block a finished prefill leg's decode reads:
    decode recomputes the prompt's last token, whose window reaches back to token
    prompt_len - window, so from that token's block on none may be the null block.
    Recurrent-state groups (`states`) hold null blocks by design and are not read."""
    lost = []
    for index, (blocks, window) in enumerate(zip(groups, windows, strict=False)):
        if index in states:
            continue
        first = max(0, prompt_len - window) // block_size if window else 0
        if NULL_BLOCK in blocks[first:]:
            lost.append(index)
    return lost
