"""KVPushConnector: vLLM's KVConnectorBase_V1 over the kvpush protocol.

vLLM builds it twice: role SCHEDULER in the engine-core process (SchedulerSide) and
role WORKER in every worker process (WorkerSide). This class only routes vLLM's
calls to the half that exists here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvpush.identities import PROMPT_CUT
from kvpush.vllm import hooks
from kvpush.vllm.compat import reads_no_external_kv, warn_known_defects
from kvpush.vllm.config import ConnectorConfig, load_secret
from kvpush.vllm.groups import leave_last_token, window_lost
from kvpush.vllm.metadata import KVPushHandshake, KVPushMetadata, KVPushWorkerMeta
from kvpush.vllm.scheduler import SchedulerSide
from kvpush.vllm.shape import EngineShape
from kvpush.vllm.stats import KVPushPromMetrics, KVPushStats
from kvpush.vllm.upstream_keys import check_buffer_device
from kvpush.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)
_log_handler_installed = False


def _show_kvpush_logs() -> None:
    """vLLM configures only its own logger; let kvpush's INFO lines reach the server log."""
    global _log_handler_installed
    kvpush_log = logging.getLogger("kvpush")
    if _log_handler_installed or kvpush_log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvpush] %(message)s"))
    kvpush_log.addHandler(handler)
    kvpush_log.setLevel(logging.INFO)
    kvpush_log.propagate = False
    _log_handler_installed = True


def _start_scheduler(
    config: ConnectorConfig,
    shape: EngineShape,
    vllm_config: Any,
    kv_cache_config: Any,
    secret: bytes,
) -> SchedulerSide:
    """The scheduler half, and the hooks it needs while vLLM builds its engine (vLLM's
    Scheduler is being built, in its engine: both are on the stack)."""
    warn_known_defects(vllm_config)
    if not shape.consumer_only and shape.windowed:
        hooks.keep_window_margin(kv_cache_config)
    if not shape.consumer_only and shape.states:
        hooks.allow_prompt_cut()
    scheduler = SchedulerSide(config, shape, secret=secret)
    scheduler.landings.attach(shape.pipeline_stages, shape.synchronous)
    hooks.ring_on_engine_inbox(scheduler.doorbell.inbox_ringer().ring)
    if config.park_workers:
        hooks.prepare_step_notify()
    hooks.bound_reader_spin(config.reader_spin_s, executor_side=True)
    hooks.bound_engine_spin(config.reader_spin_s)
    hooks.RECORD.log_attached("scheduler")
    return scheduler


def _start_worker(config: ConnectorConfig, shape: EngineShape, device_type: str) -> WorkerSide:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_world_group

    rank = get_tensor_model_parallel_rank()
    return WorkerSide(config, shape, rank, device_type, get_world_group().local_rank)


class KVPushConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _show_kvpush_logs()
        transfer = vllm_config.kv_transfer_config
        config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        secret = load_secret(config)  # no secret, no start (unless insecure): in every process
        from vllm.platforms import current_platform

        check_buffer_device(
            transfer.kv_buffer_device, current_platform.device_type, config.device_options
        )
        self._shape = EngineShape.read(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _start_scheduler(
                config, self._shape, vllm_config, kv_cache_config, secret
            )
        else:
            self._worker = _start_worker(config, self._shape, current_platform.device_type)

    # -- scheduler side ----------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        # Named (kvpush.vllm.transfers) by its whole prompt, as its decode leg is.
        self._sched().on_new_request(request)
        params = request.kv_transfer_params or {}
        if self._shape.states and params.get("do_remote_decode") and leave_last_token(request):
            self._sched().ledger.left_last_token(request.request_id)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        scheduler = self._sched()
        tokens, load_async = scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        if tokens and reads_no_external_kv(request):
            # vLLM computes the prompt itself (prompt logprobs), and says nothing.
            scheduler.computes_prompt_here(
                request,
                "prompt_logprobs",
                f"request {request.request_id} asks for prompt logprobs, for which vLLM "
                "computes the prompt itself and reads no transferred KV, whatever "
                "kv_load_failure_policy says; its transfer is released",
            )
            return 0, False
        return tokens, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._sched().request_finished(request, [block_ids])

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        scheduler = self._sched()
        block_size = self._vllm_config.cache_config.block_size
        lost = []
        if scheduler.ledger.produces(request.request_id):  # a decode's own are freed
            shape = self._shape
            lost = window_lost(
                block_ids, shape.windows, request.num_prompt_tokens, block_size, shape.states
            )
        if lost:
            # Only without the window margin (hooks.keep_window_margin): a block the
            # WRITE reads may be reused. Abandon what is not delivered yet, and say so.
            log.error(
                "kvpush: vLLM freed window blocks of KV cache groups %s that request %s's "
                "decode reads (no window margin): its transfer is abandoned unless delivered",
                lost,
                request.request_id,
            )
        keep, echo = scheduler.request_finished(request, block_ids, spoiled=bool(lost))
        if echo is not None and (request.kv_transfer_params or {}).get(PROMPT_CUT):
            echo[PROMPT_CUT] = True  # its one generated token is not the prompt's next
        return keep, echo

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        ranks = {rank: m for rank, m in metadata.items() if isinstance(m, KVPushHandshake)}
        self._sched().set_handshakes(ranks)

    # -- worker side -------------------------------------------------------------------

    def unregister_kv_caches(self) -> None:
        # vLLM (0.33 sleep, 0.34 also a layer-by-layer weight update) frees the KV
        # cache's memory after this, and backs it again before restore_kv_caches.
        self._work().unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._work().restore_kv_caches()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # What the scheduler hands out, to check the tensors against.
        block_size = self._vllm_config.cache_config.block_size
        num_blocks = getattr(self._kv_cache_config, "num_blocks", 0) or 0
        self._work().register_kv_caches(kv_caches, block_size, num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KVPushMetadata):
            self._work().bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Claims were made in bind_connector_metadata; the bytes arrive asynchronously.
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A request is scheduled only after its KV arrived whole: nothing to wait for.
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._work().save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._work().end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work().results(finished_req_ids)
        return KVConnectorTransferResults(sending, recving, failed)

    def build_connector_worker_meta(self) -> KVPushWorkerMeta | None:
        return self._work().worker_meta()

    def get_handshake_metadata(self) -> KVPushHandshake | None:
        return self._work().handshake()

    def get_kv_connector_stats(self) -> KVPushStats | None:
        if self._worker is not None:
            return self._worker.stats()
        counts = self._sched().stats()
        return KVPushStats(data=counts) if counts else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- class-level hooks ---------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPushStats:
        return KVPushStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVPushPromMetrics:
        return KVPushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # Sleep mode (vLLM 0.33 on) remaps the KV cache; peers keep the old registration.
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        # vLLM 0.34 asks how the KV cache is reached before it allocates it. kvpush
        # registers the device cache itself with NIXL (never through host buffers,
        # whatever kv_buffer_device says), and peers on the host map it through UCX
        # cuda_ipc: each segment must be one physical allocation, as NIXL's own
        # connector answers on devices it registers.
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-by-layer push runs Python after each layer, which a full CUDA graph
        # skips. Only a producer pushes: a pure consumer keeps its full graphs.
        if not ConnectorConfig.from_extra(extra_config).layerwise:
            return False
        return hooks.callers_kv_role(extra_config) != "kv_consumer"

    # -- helpers -------------------------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side KVPushConnector call on a worker instance")
        return self._scheduler

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side KVPushConnector call on a scheduler instance")
        return self._worker
