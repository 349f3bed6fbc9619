"""What vLLM's configuration says of the engine kvpush runs in, read once.

KVPushConnector reads it when vLLM builds the connector (`EngineShape.read`), and
hands the one record to whichever half runs in the process: the scheduler's
(kvpush.vllm.scheduler) and each worker's (kvpush.vllm.worker). Nothing here
changes while the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineShape:
    engine_id: str
    block_size: int = 0  # tokens per block, as the scheduler hands blocks out
    world: int = 1  # tensor-parallel ranks
    kv_role: str = "kv_both"
    dp_rank: int = 0  # data-parallel rank: its ports are offset by it
    data_parallel: bool = False  # one of several DP ranks
    # DP ranks step in lockstep (vLLM's MoE data parallel): none may sleep an empty step.
    lockstep: bool = False
    prefix_caching: bool = True
    recompute_on_failure: bool = False  # kv_load_failure_policy "recompute"
    model_name: str = ""  # the name clients ask for: both legs of a request carry it
    cpu_attention: bool = False  # the KV cache is vLLM CPU attention's (kvpush.vllm.worker)
    kv_heads: int = 0  # the model's KV heads, shared out over the TP ranks (0: one each)
    kv_groups: int = 1  # KV cache groups a transfer carries (kvpush.vllm.groups)
    windows: tuple[int, ...] = ()  # each group's sliding window in tokens (0: none)
    states: tuple[int, ...] = ()  # the recurrent-state groups
    state_layers: frozenset[str] = frozenset()  # their layers
    seeds_rewind: bool = False  # its generators rewind (kvpush.vllm.compat)
    pipeline_stages: int = 1
    synchronous: bool = False  # no async scheduling: a step's output is in before the next

    @property
    def consumer_only(self) -> bool:
        """kv_role kv_consumer: every request is a decode leg."""
        return self.kv_role == "kv_consumer"

    @property
    def block_pages(self) -> bool:
        """Whether a peer of another block size may take our blocks as pages of its own
        (not vLLM CPU attention's, whose rows inside a block are its kernels')."""
        return not self.cpu_attention

    @property
    def windowed(self) -> bool:
        return any(self.windows)

    @classmethod
    def read(cls, vllm_config: Any, kv_cache_config: Any) -> EngineShape:
        """From vLLM's configs; ConfigError names a KV cache group kvpush cannot move."""
        from vllm.platforms import current_platform

        from kvpush.vllm.compat import seeds_rewind
        from kvpush.vllm.groups import recurrent, state_layers, transfer_groups, windows

        transfer = vllm_config.kv_transfer_config
        parallel = vllm_config.parallel_config
        model = vllm_config.model_config
        engine_id = str(transfer.engine_id)
        # vLLM runs each DP rank of a dense model as an independent engine told it is
        # DP rank 0 of 1; data_parallel_index keeps the real rank, and the engine id
        # its "_dp<rank>" suffix.
        dp_rank = getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
        groups = transfer_groups(kv_cache_config)  # refuses a group it cannot move
        cached = kv_cache_config is not None
        return cls(
            engine_id=engine_id,
            block_size=vllm_config.cache_config.block_size,
            world=parallel.tensor_parallel_size,
            kv_role=transfer.kv_role,
            dp_rank=dp_rank,
            data_parallel=parallel.data_parallel_size > 1 or engine_id.endswith(f"_dp{dp_rank}"),
            lockstep=parallel.data_parallel_size > 1,
            prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
            recompute_on_failure=transfer.kv_load_failure_policy == "recompute",
            model_name=_served_name(model),
            cpu_attention=current_platform.device_type == "cpu" and not model.use_mla,
            # MLA's latent is one "head" every rank holds whole.
            kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
            kv_groups=groups,
            windows=windows(kv_cache_config) if cached else (),
            states=recurrent(kv_cache_config) if cached else (),
            state_layers=state_layers(kv_cache_config) if cached else frozenset(),
            seeds_rewind=seeds_rewind(),
            pipeline_stages=parallel.pipeline_parallel_size,
            synchronous=vllm_config.scheduler_config.async_scheduling is False,
        )


def _served_name(model_config: Any) -> str:
    name = getattr(model_config, "served_model_name", None) or ""
    return str(name[0] if isinstance(name, list | tuple) and name else name)
