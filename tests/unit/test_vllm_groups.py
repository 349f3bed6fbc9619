"""vLLM's KV cache groups as kvpush takes them: which it moves and which it refuses,
the sliding-window margin a producer keeps (checked against vLLM's own window
arithmetic), and one view of each tensor the groups overlay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

from kvpush.errors import ConfigError
from kvpush.identities import PROMPT_CUT
from kvpush.vllm import hooks
from kvpush.vllm.groups import (
    NULL_BLOCK,
    leave_last_token,
    recurrent,
    transfer_groups,
    window_lost,
    windows,
)
from kvpush.vllm.worker import one_view_each

BLOCK, WINDOW = 16, 64


def _full(block: int = BLOCK) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=8, dtype=torch.float32)


def _sliding(block: int = BLOCK) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=WINDOW
    )


def _config(*specs) -> SimpleNamespace:
    groups = [
        SimpleNamespace(kv_cache_spec=spec, layer_names=[f"layer.{i}"], enable_kv_transfer=True)
        for i, spec in enumerate(specs)
    ]
    return SimpleNamespace(kv_cache_groups=groups)


def test_full_and_sliding_window_groups_are_moved_together():
    assert transfer_groups(_config(_full())) == 1
    assert transfer_groups(_config(_full(), _sliding())) == 2
    assert transfer_groups(None) == 1
    assert windows(_config(_full(), _sliding())) == (0, WINDOW)
    assert windows(_config(_full())) == (0,)


def _mamba(**kw) -> MambaSpec:
    return MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,), **kw)


def test_recurrent_state_moves_beside_attention_kv_and_is_refused_alone_or_speculative():
    # In vLLM's "none" cache mode a state group's block spans the whole context: its
    # block size is not the attention groups', and need not be.
    config = _config(_full(), _mamba(), MambaSpec(block_size=4096, shapes=((4, 8),),
                                                  dtypes=(torch.float32,)))  # fmt: skip
    assert transfer_groups(config) == 3
    assert recurrent(config) == (1, 2)
    assert recurrent(_config(_full(), _sliding())) == ()
    with pytest.raises(ConfigError, match=r"group 0 \(MambaSpec\) holds recurrent state, and no"):
        transfer_groups(_config(_mamba()))  # a pure Mamba model
    with pytest.raises(ConfigError, match="group 1 keeps 2 speculative state slots"):
        transfer_groups(_config(_full(), _mamba(num_speculative_blocks=2)))
    with pytest.raises(ConfigError, match="group 1 holds recurrent state every TP rank keeps"):
        transfer_groups(_config(_full(), _mamba(tp_replicated=True)))


def test_a_state_groups_null_blocks_are_no_lost_window():
    """vLLM's "align" mode leaves a state group's earlier positions null by design."""
    full, state = [11, 12, 13], [0, 0, 23]
    assert window_lost([state, full], (0, 0), 40, BLOCK) == [0]  # were it read as KV
    assert window_lost([state, full], (0, 0), 40, BLOCK, states=(0,)) == []


class _Request:
    def __init__(self, tokens: list[int], params: dict | None) -> None:
        self.prompt_token_ids = list(tokens)
        self._all_token_ids = list(tokens)
        self.num_prompt_tokens = len(tokens)
        self.kv_transfer_params = params


def test_a_prefill_leg_of_a_recurrent_model_leaves_its_last_token_once():
    request = _Request([5, 6, 7], {"do_remote_decode": True})
    assert leave_last_token(request)
    assert (request.prompt_token_ids, request._all_token_ids) == ([5, 6], [5, 6])
    assert request.num_prompt_tokens == 2 and request.kv_transfer_params[PROMPT_CUT]
    assert not leave_last_token(request)  # again after a preemption: still two tokens
    assert request.prompt_token_ids == [5, 6]
    one = _Request([5], {"do_remote_decode": True})  # nothing would be left to compute
    assert not leave_last_token(one) and one.prompt_token_ids == [5]
    assert not leave_last_token(_Request([5, 6], None))


def test_groups_of_different_block_sizes_or_kept_out_of_transfers_are_refused():
    with pytest.raises(ConfigError, match=r"different block sizes \[16, 32\]"):
        transfer_groups(_config(_full(16), _sliding(32)))
    config = _config(_full(), _sliding())
    config.kv_cache_groups[1].enable_kv_transfer = False
    with pytest.raises(ConfigError, match="kept out of KV transfers"):
        transfer_groups(config)


class _Scheduler:
    """Stands where vLLM's Scheduler makes its connector: config set, no manager yet."""

    def __init__(self, kv_cache_config: SimpleNamespace, manager_first: bool = False) -> None:
        self.kv_cache_config = kv_cache_config
        if manager_first:
            self.kv_cache_manager = object()

    def make_connector(self) -> None:
        hooks.keep_window_margin(self.kv_cache_config)


def _skipped_blocks(spec: SlidingWindowSpec, computed: int) -> int:
    """Blocks vLLM's own window arithmetic frees once `computed` tokens have KV."""
    manager = SimpleNamespace(
        sliding_window=spec.sliding_window, extra_retained_tokens=spec.extra_retained_tokens
    )
    return SlidingWindowManager.get_num_skipped_tokens(manager, computed) // BLOCK


def test_a_producer_keeps_the_window_block_decode_reads_for_the_prompts_last_token():
    config = _config(_full(), _sliding())
    # N - W is the last token of block 0: vLLM frees it when the prefill leg ends,
    # yet decode, recomputing token N - 1, attends from N - W on.
    prompt = WINDOW + BLOCK - 1
    needed = (prompt - WINDOW) // BLOCK
    assert _skipped_blocks(config.kv_cache_groups[1].kv_cache_spec, prompt) > needed
    _Scheduler(config).make_connector()
    sliding = config.kv_cache_groups[1].kv_cache_spec
    assert sliding.extra_retained_tokens == 1
    assert _skipped_blocks(sliding, prompt) == needed  # kept, and only that one more
    assert config.kv_cache_groups[0].kv_cache_spec == _full()  # full attention untouched


def _finished_table(spec: SlidingWindowSpec, prompt: int) -> list[int]:
    """A finished prefill's sliding-group block table as vLLM hands it over: the
    blocks its window arithmetic freed are the null block."""
    blocks = list(range(1, -(-prompt // BLOCK) + 1))
    freed = _skipped_blocks(spec, prompt)
    return [NULL_BLOCK] * freed + blocks[freed:]


@pytest.mark.parametrize("prompt", range(WINDOW - 2, WINDOW + 3 * BLOCK + 2))
def test_a_freed_window_block_is_caught_at_finish_without_the_margin_and_never_with_it(prompt):
    config = _config(_full(), _sliding())
    full = list(range(100, 100 + -(-prompt // BLOCK)))
    bare = [full, _finished_table(config.kv_cache_groups[1].kv_cache_spec, prompt)]
    boundary = prompt >= WINDOW and (prompt - WINDOW + 1) % BLOCK == 0
    assert window_lost(bare, windows(config), prompt, BLOCK) == ([1] if boundary else [])
    _Scheduler(config).make_connector()
    kept = [full, _finished_table(config.kv_cache_groups[1].kv_cache_spec, prompt)]
    assert window_lost(kept, windows(config), prompt, BLOCK) == []


def test_the_margin_refuses_to_start_where_it_cannot_attach(monkeypatch):
    with pytest.raises(ConfigError, match="not built after the connector"):
        _Scheduler(_config(_full(), _sliding()), manager_first=True).make_connector()
    monkeypatch.setenv(hooks.OFF_ENV, "window_margin")
    with pytest.raises(ConfigError, match="--disable-hybrid-kv-cache-manager"):
        _Scheduler(_config(_full(), _sliding())).make_connector()


def test_one_view_of_each_tensor_the_groups_overlay():
    shared, other = torch.zeros(8, 2, 16, 8), torch.zeros(8, 2, 16, 8)
    views = {"full.0": shared, "sliding.0": shared.view(8, 2, 16, 8), "full.1": other}
    assert list(one_view_each(views)) == ["full.0", "full.1"]
    with pytest.raises(ConfigError, match="share KV cache memory in different shapes"):
        one_view_each({"a": shared, "b": shared.view(8, 2, 128)})


def _state_views(raw: torch.Tensor, page: int) -> list[torch.Tensor]:
    """As vLLM views a Mamba layer's pages of a shared raw buffer: conv state, then
    SSM state, each block `page` elements apart."""
    blocks = raw.numel() // page
    conv = torch.as_strided(raw, (blocks, 3, 4), (page, 4, 1))
    ssm = torch.as_strided(raw, (blocks, 2, 8), (page, 8, 1), storage_offset=12)
    return [conv, ssm]


def test_a_recurrent_layers_state_must_lie_inside_the_attention_blocks():
    raw = torch.zeros(8 * 64)
    attention = raw.view(8, 2, 4, 8)  # a block of 64 elements
    views = {"attn.3": attention, "gdn.0": _state_views(raw, 64), "gdn.1": _state_views(raw, 64)}
    states = frozenset({"gdn.0", "gdn.1"})
    assert list(one_view_each(views, states)) == ["attn.3"]
    # vLLM's CPU build hands a state layer's page as one tensor of bytes.
    as_bytes = torch.as_strided(raw.view(torch.uint8), (8, 1, 1, 112), (256, 112, 112, 1))
    assert list(one_view_each({"attn.3": attention, "gdn.0": as_bytes}, states)) == ["attn.3"]
    with pytest.raises(ConfigError, match="share KV cache memory in different shapes"):
        one_view_each({"attn.3": attention, "gdn.0": as_bytes})  # not named a state layer
    other = torch.zeros(8 * 64)
    with pytest.raises(ConfigError, match=r"state of layer gdn\.0 does not lie inside"):
        one_view_each({"attn.3": attention, "gdn.0": _state_views(other, 64)}, states)
    small = torch.zeros(16 * 32)  # blocks of 32, state pages 64 apart
    with pytest.raises(ConfigError, match=r"state of layer gdn\.0 does not lie inside"):
        one_view_each({"attn.3": small.view(16, 2, 2, 8), "gdn.0": _state_views(small, 64)}, states)
