"""kvxfer as a vLLM KV connector (vLLM 0.33.0, V1 connector API), loaded by

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"codec": "bf16"}}'

on the prefill and the decode instance alike (docs/VLLM.md).  The logic is
kvxfer.vllm_core's (no vLLM there); this module maps vLLM's objects to it.
Importing it imports vLLM.
"""

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

from . import vllm_core

_FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class KvxferConnectorMetadata(KVConnectorMetadata, vllm_core.Metadata):
    """vllm_core.Metadata as vLLM's metadata type (pickled to the workers)."""


class KvxferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's kvxfer endpoint address, for its scheduler's kv_transfer_params."""

    def __init__(self, address):
        self.address = bytes(address)


def _tp():
    """(rank, size) of this worker's tensor-parallel group."""
    from vllm.distributed import parallel_state as ps
    try:
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    except AssertionError:  # no tensor-parallel group: a lone worker
        return 0, 1


class KvxferConnector(KVConnectorBase_V1):
    """One per role: the scheduler's (SchedulerCore) and each worker's
    (WorkerCore, with its kvxfer Endpoint).  Loads are asynchronous: a
    request waits in WAITING_FOR_REMOTE_KVS until its whole KV is COMPLETE,
    so wait_for_layer_load has nothing to wait for.  Prefills send when a
    request finishes (save_kv_layer and wait_for_save do nothing)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        heads = vllm_config.model_config.get_total_num_kv_heads()
        self._sched = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = vllm_core.SchedulerCore(vllm_config.cache_config.block_size, heads)
        else:
            rank, size = _tp()
            self._worker = vllm_core.WorkerCore(extra, tp_rank=rank, tp_size=size,
                                                total_kv_heads=heads)

    # ---- scheduler side ----------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._sched.matched_tokens(request.kv_transfer_params, num_computed_tokens,
                                          request.num_prompt_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._sched.after_alloc(request.request_id, request.kv_transfer_params,
                                blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        m = self._sched.build_meta()
        return KvxferConnectorMetadata(**{f.name: getattr(m, f.name)
                                          for f in dataclasses.fields(m)})

    def update_connector_output(self, connector_output):
        self._sched.finished_recving(connector_output.finished_recving or ())

    def request_finished(self, request, block_ids):
        n = min(len(request.prompt_token_ids or ()), request.num_computed_tokens)
        return self._sched.request_finished(request.request_id, request.kv_transfer_params,
                                            list(block_ids), n, request.status in _FINISHED_OK)

    def set_xfer_handshake_metadata(self, metadata):
        self._sched.set_endpoints({r: m.address for r, m in metadata.items()})

    # ---- worker side -------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        self._worker.register(kv_caches)

    def get_handshake_metadata(self):
        return KvxferHandshakeMetadata(self._worker.address)

    def start_load_kv(self, forward_context, **kwargs):
        self._worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None

    def get_transfer_results(self, finished_req_ids):
        sent, received, failed = self._worker.finished()
        return KVConnectorTransferResults(sent, received, failed)

    def get_finished(self, finished_req_ids):
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self):
        return self._worker.load_errors()

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
