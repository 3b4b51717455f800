"""The core of kvxfer's vLLM KV connector (kvxfer.vllm), without vLLM.

kvxfer.vllm.KvxferConnector adapts vLLM's KVConnectorBase_V1 to the two
classes here, which take plain values (request ids, token counts, block
ids, kv_transfer_params dicts), so that tests drive them in vLLM's call
order with no vLLM installed (docs/VLLM.md).

Flow (1 prefill P, 1 decode D; their tensor-parallel sizes may differ):
  P scheduler  request_finished of a request with do_remote_decode: keeps its
               blocks, returns kv_transfer_params {do_remote_prefill,
               remote_request_id, remote_endpoints (hex address blob per TP
               rank), remote_num_tokens, remote_total_kv_heads}; its next
               metadata carries a SendSpec.
  P worker     posts one send per KV head it holds, to kvxfer.ANY_PEER,
               matched by the id of the head's global index (TpHeads):
               it goes to whichever decode asks (docs/TRANSPORT.md, "Sends to
               whichever peer asks").  Reports the request finished_sending
               once every head's send is final (COMPLETE, or ERROR: a decode
               that never came, after claim_timeout_ms, frees the blocks too).
  D scheduler  get_num_new_matched_tokens: (remote_num_tokens, True) for a
               request with do_remote_prefill; update_state_after_alloc
               records its local block ids; the next metadata carries a RecvSpec.
  D worker     posts one receive per KV head it holds, by the same ids, from
               the P rank holding that head (connected once per address), as
               vLLM's NixlConnector pairs TP 4 with TP 2, and reports the
               request finished_recving once every head is final; a failed
               one is also in failed_recving, and its blocks are load errors.
               A request D will not load (a local prefix hit, an abort before
               allocation, a load refused at the call) releases P: a cancelled
               one-token receive per head fails P's sends at once.

Layout: vLLM 0.33 gives each attention layer a view [num_blocks, kv_heads,
block_size, 2 * head_size] (K then V in the last dimension) with the strides
of its KV cache layout (vllm/v1/kv_cache_interface.py).  A kvxfer pool row is
kv_heads * head_dim contiguous elements, so each KV head is its own pool
(kv_heads 1): K of head h of block b, token t at data + (b * s0 + h * s1 +
t * s2) elements, V head_size elements after it.

Thread-safety: each object is used by one thread (vLLM's scheduler loop, or
one worker's model runner).
"""

import collections
import dataclasses
import hashlib
import logging
import re
import time

from . import core
from ._abi import ANY_PEER, Dtype, Stage

_log = logging.getLogger("kvxfer.vllm")

# KV dtypes kvxfer moves (vLLM's torch dtype names).
_DTYPES = {"bfloat16": Dtype.BF16, "float16": Dtype.FP16, "float32": Dtype.FP32}

# How long a prefill keeps a request's blocks for a decode that does not come
# (kvxfer's claim_timeout_ms): vLLM's MooncakeConnector waits 480 s
# (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT).
DEFAULT_CLAIM_TIMEOUT_MS = 480000


def request_id64(request_id, head, replica=0):
    """The kvxfer request id of global KV head `head` of vLLM request
    `request_id`, as prefill replica `replica` of that head sends it: the
    first 8 bytes of BLAKE2b over "<id>/<head>" (replica 0) or
    "<id>/<head>/r<replica>" (no other id and head give that text, as a
    head is digits), little-endian."""
    key = "%s/%d" % (request_id, head) if replica == 0 else "%s/%d/r%d" % (request_id, head,
                                                                           replica)
    d = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(d, "little")


class _TopologyError(ValueError):
    """The prefill's TP layout cannot serve any rank of this decode."""


@dataclasses.dataclass(frozen=True)
class TpHeads:
    """The KV heads one tensor-parallel rank holds, as vLLM shards them
    (vllm/model_executor/layers/linear.py, QKVParallelLinear): with
    total >= tp_size, rank r holds heads [r * n, (r + 1) * n), n = total //
    tp_size; with total < tp_size each head has tp_size // total replicas,
    and rank r holds head r // replicas as replica r % replicas."""
    first: int  # its first global head
    count: int  # heads it holds
    replica: int  # which replica of them it holds (0 when not replicated)
    replicas: int  # replicas of each head in its TP group

    @staticmethod
    def of(total, tp_size, rank):
        """ValueError when vLLM could not shard `total` heads over tp_size ranks."""
        if total < 1 or tp_size < 1 or not 0 <= rank < tp_size:
            raise ValueError("%d KV heads over TP rank %d of %d" % (total, rank, tp_size))
        if total >= tp_size:
            if total % tp_size:
                raise ValueError("%d KV heads do not split over TP size %d" % (total, tp_size))
            n = total // tp_size
            return TpHeads(rank * n, n, 0, 1)
        if tp_size % total:
            raise ValueError("TP size %d is not a multiple of %d KV heads" % (tp_size, total))
        r = tp_size // total
        return TpHeads(rank // r, 1, rank % r, r)


def default_page_tokens(head_dim, element_size):
    """Tokens per kvxfer page of a one-head request: pages of at least 128
    KiB, in multiples of 256 tokens (1024 for 64 bf16 channels)."""
    return max(256, -(-(128 << 10) // (head_dim * element_size) // 256) * 256)


@dataclasses.dataclass
class SendSpec:
    """A prefill's finished request: tokens [0, num_tokens) in block_ids."""
    req_id: str
    block_ids: list
    num_tokens: int


@dataclasses.dataclass
class RecvSpec:
    """A decode's request to load: the prefill's tokens into block_ids."""
    req_id: str
    remote_request_id: str
    remote_endpoints: list  # hex address blobs, one per prefill TP rank
    block_ids: list
    num_tokens: int
    remote_total_kv_heads: int = 0  # the prefill model's KV heads; 0: unknown (the decode's)


@dataclasses.dataclass
class Metadata:
    """What one scheduler step tells the workers (pickled across processes)."""
    sends: list = dataclasses.field(default_factory=list)
    recvs: list = dataclasses.field(default_factory=list)
    cancels: list = dataclasses.field(default_factory=list)  # decode ids whose load was aborted
    releases: list = dataclasses.field(default_factory=list)  # RecvSpecs never loaded (0 blocks)


def _hex(text, what):
    try:
        return bytes.fromhex(text)
    except (TypeError, ValueError) as e:
        raise ValueError("%s is not hex digits: %s" % (what, e)) from None


def _blocks_for(num_tokens, block_size):
    return (num_tokens + block_size - 1) // block_size


# Bounds on what a decode takes from kv_transfer_params, which come from the
# client (vLLM's OpenAI server passes them through): a load connects to each
# endpoint and posts one receive per KV head on the model runner's thread, so
# a request may not make it post thousands.  Far above any vLLM deployment's
# TP size and KV-head count.
MAX_REMOTE_ENDPOINTS = 256
MAX_REMOTE_HEADS = 1024


def _int_field(params, key, lo, hi):
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("%s is %r, not an integer" % (key, v))
    if not lo <= v <= hi:
        raise ValueError("%s %d is outside [%d, %d]" % (key, v, lo, hi))
    return v


def check_load_params(params, prompt_tokens=None):
    """Checks the kv_transfer_params of a load (matched_tokens) and returns
    them normalised: remote_request_id a non-empty str, remote_endpoints a
    list of 1..MAX_REMOTE_ENDPOINTS hex strings, remote_num_tokens an int in
    [1, prompt_tokens] (the decode's prompt: the prefill sends at most its
    own), remote_total_kv_heads absent or an int in [0, MAX_REMOTE_HEADS].
    ValueError naming the field otherwise."""
    rid = params.get("remote_request_id")
    if not isinstance(rid, str) or not rid:
        raise ValueError("remote_request_id is %r, not a request id" % (rid,))
    eps = params.get("remote_endpoints")
    if not isinstance(eps, (list, tuple)) or not 1 <= len(eps) <= MAX_REMOTE_ENDPOINTS:
        raise ValueError("remote_endpoints is not a list of 1 to %d address blobs" %
                         MAX_REMOTE_ENDPOINTS)
    for i, e in enumerate(eps):
        if not isinstance(e, str):
            raise ValueError("remote_endpoints[%d] is %s, not hex digits" % (i, type(e).__name__))
        _hex(e, "remote_endpoints[%d]" % i)
    n = _int_field(params, "remote_num_tokens", 1,
                   2**31 - 1 if prompt_tokens is None else prompt_tokens)
    heads = 0
    if params.get("remote_total_kv_heads") is not None:
        heads = _int_field(params, "remote_total_kv_heads", 0, MAX_REMOTE_HEADS)
    return rid, list(eps), n, heads


class SchedulerCore:
    """The scheduler side: decides what loads and sends, builds Metadata."""

    def __init__(self, block_size, total_kv_heads=0):
        """total_kv_heads: the model's KV heads (all TP ranks), carried in
        kv_transfer_params so that a decode checks its model has as many;
        0 = not said."""
        self.block_size = int(block_size)
        self.total_kv_heads = int(total_kv_heads)
        self.endpoints = {}  # TP rank -> this instance's worker address (bytes)
        self._recvs, self._sends, self._cancels, self._releases = {}, [], [], []
        self._loading = set()  # decode requests whose RecvSpec went to the workers

    def set_endpoints(self, by_rank):
        """The workers' endpoint addresses (KvxferConnector's handshake
        metadata), by TP rank.  ValueError unless the ranks are 0..n-1 (vLLM
        offsets them with context parallelism, which kvxfer does not pair)."""
        ranks = sorted(int(r) for r in by_rank)
        if ranks != list(range(len(ranks))):
            raise ValueError("handshake metadata of ranks %s: kvxfer expects TP ranks 0..n-1 "
                             "(no context parallelism)" % ranks)
        self.endpoints = {int(r): bytes(a) for r, a in by_rank.items()}

    @staticmethod
    def _ours(params):
        return isinstance(params, dict) and bool(params.get("remote_endpoints"))

    def matched_tokens(self, params, num_computed, prompt_tokens=None):
        """get_num_new_matched_tokens: (tokens to load, load asynchronously).

        A request with do_remote_prefill loads all remote_num_tokens.  With a
        local prefix hit (num_computed > 0) it loads nothing and computes
        them (kvxfer sends a request's KV from token 0), and the prefill is
        released: its sends end at once, not at claim_timeout_ms.  Params
        that check_load_params refuses (prompt_tokens: the request's prompt
        length) load nothing either: the request is computed locally, with
        a warning, and the prefill is released when they name it."""
        if not self._ours(params) or not params.get("do_remote_prefill"):
            return 0, False
        try:
            rid, eps, n, heads = check_load_params(params, prompt_tokens)
        except ValueError as e:
            _log.warning("kvxfer: kv_transfer_params %s: computing the request locally", e)
            self._release(params)
            return 0, False
        params.update(remote_request_id=rid, remote_endpoints=eps, remote_num_tokens=n,
                      remote_total_kv_heads=heads)
        if num_computed > 0:
            self._release(params)
            return 0, False
        return n, True

    def _release(self, params):
        """Tells the prefill its KV will not be loaded (WorkerCore.start),
        when `params` name a request and its endpoints (check_load_params;
        an unusable head count counts as not said)."""
        params["do_remote_prefill"] = False
        for drop in ({}, {"remote_total_kv_heads": None}):
            try:
                rid, eps, _, heads = check_load_params(dict(params, remote_num_tokens=1, **drop))
            except ValueError:
                continue
            self._releases.append(RecvSpec("", rid, eps, [], 0, heads))
            return

    def after_alloc(self, req_id, params, block_ids, num_external):
        """update_state_after_alloc: records the local blocks of a load.  One
        vLLM gave no external tokens (it may cut a hit we reported, e.g. for
        prompt logprobs) releases the prefill."""
        if not self._ours(params) or not params.get("do_remote_prefill"):
            return
        if num_external <= 0:
            self._release(params)
            return
        n = params["remote_num_tokens"]
        self._recvs[req_id] = RecvSpec(req_id, params["remote_request_id"],
                                       list(params["remote_endpoints"]),
                                       list(block_ids[:_blocks_for(n, self.block_size)]), n,
                                       params.get("remote_total_kv_heads", 0))
        params["do_remote_prefill"] = False  # one load per request

    def build_meta(self):
        """build_connector_meta: what the workers do this step; resets."""
        meta = Metadata(self._sends, list(self._recvs.values()), self._cancels, self._releases)
        self._loading.update(self._recvs)
        self._recvs, self._sends, self._cancels, self._releases = {}, [], [], []
        return meta

    def finished_recving(self, req_ids):
        """update_connector_output: these loads ended (done or failed)."""
        self._loading.difference_update(req_ids)

    def request_finished(self, req_id, params, block_ids, num_tokens, finished_ok):
        """request_finished: (keep the blocks for a transfer, kv_transfer_params).

        A prefill request with do_remote_decode that finished normally keeps
        its blocks until its sends are final and returns what the decode
        needs.  A decode request aborted once its blocks were allocated has
        its load cancelled: the prefill is told (its send fails with
        ERR_CANCELLED and frees its blocks), and the worker reports the
        request finished_recving, not failed, so vLLM frees its blocks.  One
        aborted before allocation loads nothing and releases the prefill."""
        if params and params.get("do_remote_decode"):
            if not finished_ok or not self.endpoints or num_tokens <= 0:
                return False, None
            self._sends.append(SendSpec(req_id, list(block_ids[:_blocks_for(
                num_tokens, self.block_size)]), int(num_tokens)))
            out = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_request_id": req_id,
                "remote_endpoints": [self.endpoints[r].hex() for r in sorted(self.endpoints)],
                "remote_num_tokens": int(num_tokens),
            }
            if self.total_kv_heads > 0:
                out["remote_total_kv_heads"] = self.total_kv_heads
            return True, out
        if req_id in self._recvs or req_id in self._loading:
            self._cancels.append(req_id)  # a RecvSpec not sent yet goes, and is cancelled
        elif self._ours(params) and params.get("do_remote_prefill"):
            self._release(params)  # aborted before its blocks were allocated
        return False, None


@dataclasses.dataclass
class _Transfer:
    requests: list
    block_ids: list
    error: str = ""
    aborted: bool = False  # vLLM aborted the request: not a load error
    deadline: float = float("inf")  # loads: cancelled if not final by then
    addresses: list = dataclasses.field(default_factory=list)  # loads: the prefill endpoints


def layer_index(name):
    """The layer number in a vLLM layer name ("model.layers.12.self_attn.attn")."""
    m = re.search(r"\.(\d+)\.", "." + name + ".")
    if m is None:
        raise ValueError("layer name %r has no layer number" % name)
    return int(m.group(1))


class WorkerCore:
    """The worker side: one kvxfer Endpoint, the KV caches as pools, transfers.

    extra: kv_connector_extra_config.  Keys (all optional): "codec" ("bf16",
    the default and lossless; "int8", "lynx"), "bind_address", "port",
    "timeout_ms" (kvxfer's inactivity timeout), "claim_timeout_ms" (how long a
    prefill keeps blocks for a decode that does not come, default 480000),
    "secret" (64 hex digits shared by the deployment; default a random one
    carried in the address), "max_loads" (kvxfer receives posted at once, one
    per KV head of a request, default 48: kvxfer holds 64 requests per
    same-host peer, both directions (kShmMaxRequests in
    src/transport/ofi.h); the loads beyond wait here, in order),
    "page_tokens" (tokens per kvxfer page; default: pages of at least
    128 KiB, 1024 tokens for a head of 64 bf16 channels, as a request carries
    one head and kvxfer's cost per page is fixed), "rate_limit"
    (tc syntax, emulates a slower link: tests).
    tp_rank, tp_size: this worker's tensor-parallel rank and size.
    total_kv_heads: the model's KV heads over all ranks (0: this rank's
    heads x tp_size).  The prefill's TP size may differ (TpHeads): each KV
    head is its own request, and a decode rank loads each of its heads from
    the prefill rank holding it.  A load not final within claim_timeout_ms
    is cancelled and fails.
    """

    def __init__(self, extra, tp_rank=0, tp_size=1, total_kv_heads=0):
        extra = dict(extra or {})
        self.codec = str(extra.get("codec", "bf16"))
        if self.codec not in ("bf16", "int8", "lynx"):
            raise ValueError("kv_connector_extra_config codec %r: one of bf16, int8, lynx" %
                             self.codec)
        def setting(key, default, lo, hi):  # _int_field's check, named for the config
            v = extra.get(key, default)
            try:
                return _int_field({key: v}, key, lo, hi)
            except ValueError:
                raise ValueError("kv_connector_extra_config %s %r: an integer in [%d, %d]" %
                                 (key, v, lo, hi)) from None

        int32 = 2**31 - 1
        self.claim_timeout_ms = setting("claim_timeout_ms", DEFAULT_CLAIM_TIMEOUT_MS, 1, int32)
        self.tp_rank, self.tp_size = int(tp_rank), int(tp_size)
        self.total_kv_heads = int(total_kv_heads)
        self.heads = None  # TpHeads, from register()
        self.max_loads = setting("max_loads", 48, 1, int32)
        self.page_tokens = setting("page_tokens", 0, 0, 1 << 20)  # KVXFER_PAGE_TOKENS' range
        secret = extra.get("secret")
        if secret is not None:
            secret = _hex(secret, "kv_connector_extra_config secret")
            if len(secret) != core.ENDPOINT_SECRET_BYTES:
                raise ValueError("kv_connector_extra_config secret: %d hex digits, not %d" %
                                 (2 * core.ENDPOINT_SECRET_BYTES, 2 * len(secret)))
        for key in ("bind_address", "rate_limit"):
            if extra.get(key) is not None and not isinstance(extra[key], str):
                raise ValueError("kv_connector_extra_config %s %r: a string" % (key, extra[key]))
        try:
            self.ep = core.Endpoint(timeout_ms=setting("timeout_ms", 0, 0, int32),
                                    port=setting("port", 0, 0, 65535),
                                    bind_address=extra.get("bind_address"),
                                    rate_limit=extra.get("rate_limit"), secret=secret)
        except core.KvxferError as e:
            if e.code != core.Result.ERR_INVALID_ARGUMENT:
                raise  # a port taken, ...: not the config's fault
            # The library refused a value (an address or a rate it cannot parse).
            key = "rate_limit" if "rate_limit" in e.message else "bind_address"
            raise ValueError("kv_connector_extra_config %s %r: %s" %
                             (key, extra.get(key), e.message)) from e
        self.pools = []  # one KVPool per KV head
        self.num_layers = 0
        self._peers = {}  # prefill address -> peer index
        self._sending, self._recving = {}, {}
        self._waiting = collections.deque()  # RecvSpecs not posted yet (max_loads)
        self._released = []  # _release()'s receives until they end
        self._load_errors = set()
        # Addresses whose connect failed in this start() or finished() call
        # (_peer): once one has, the call connects to no new address.
        self._unreachable = set()

    @property
    def address(self):
        return self.ep.address

    def register(self, kv_caches):
        """register_kv_caches: {layer name: tensor [num_blocks, kv_heads,
        block_size, 2 * head_size]} (any strides with the last dimension
        contiguous), in host memory or on a CUDA device (a device pool: untested,
        docs/VLLM.md).  A tensor needs data_ptr(), shape, stride(),
        element_size() and dtype, as torch's, and device for a GPU one."""
        layers = sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0]))
        if not layers:
            raise ValueError("register_kv_caches: no KV cache layers")
        geo = None
        bases = []
        for name, t in layers:
            shape, stride = tuple(t.shape), tuple(t.stride())
            dtype = str(t.dtype).rsplit(".", 1)[-1]
            dev = getattr(t, "device", None)
            device = dev.index if getattr(dev, "type", "cpu") == "cuda" else -1
            g = (shape, stride, int(t.element_size()), dtype, device)
            if len(shape) != 4 or shape[3] % 2 or stride[3] != 1:
                raise ValueError("layer %s: shape %s strides %s; expected [num_blocks, kv_heads, "
                                 "block_size, 2 * head_size] with the last dimension contiguous" %
                                 (name, shape, stride))
            if dtype not in _DTYPES:
                raise ValueError("layer %s: dtype %s; kvxfer moves %s" %
                                 (name, dtype, ", ".join(_DTYPES)))
            if geo is not None and g != geo:
                raise ValueError("layer %s: shape, strides or dtype differ from layer %s" %
                                 (name, layers[0][0]))
            geo = g
            bases.append(int(t.data_ptr()))
        (nb, heads, bs, two_hd), (s0, s1, s2, _), es, dtype, device = geo
        total = self.total_kv_heads or heads * self.tp_size
        mine = TpHeads.of(total, self.tp_size, self.tp_rank)
        if mine.count != heads:
            raise ValueError("layer %s holds %d KV heads; TP rank %d of %d of a model with %d "
                             "holds %d" % (layers[0][0], heads, self.tp_rank, self.tp_size,
                                           total, mine.count))
        self.total_kv_heads, self.heads = total, mine
        hd = two_hd // 2
        if self.page_tokens <= 0:
            self.page_tokens = default_page_tokens(hd, es)
        self.num_layers = len(layers)
        self.pools = [
            core.KVPool([b + h * s1 * es for b in bases], [b + (h * s1 + hd) * es for b in bases],
                        num_blocks=nb, block_size=bs, kv_heads=1, head_dim=hd,
                        dtype=_DTYPES[dtype], row_stride=s2, block_stride=s0 * es,
                        device=device, keep=[t for _, t in layers]) for h in range(heads)
        ]

    def start(self, meta):
        """start_load_kv: posts the sends and loads of `meta`, then cancels
        the loads it names (posted first, so that the prefill hears of it)."""
        self._unreachable = set()
        for s in meta.sends:
            if s.req_id in self._sending:
                # vLLM's ids are unique; a second live request of one id
                # would report the first's blocks free while its sends
                # still read them.  The first keeps the id; this one sends
                # nothing, and its decode times out.
                _log.error("kvxfer: request %s is already sending; its second save_kv sends "
                          "nothing", s.req_id)
                continue
            t = self._sending[s.req_id] = _Transfer([], s.block_ids)
            if not self.pools:
                t.error = "no KV caches registered (register_kv_caches)"
                continue
            try:
                for h, pool in enumerate(self.pools):
                    rid = request_id64(s.req_id, self.heads.first + h, self.heads.replica)
                    t.requests.append(self.ep.send_blocks(
                        ANY_PEER, pool, s.block_ids, s.num_tokens, 0, 0, self.codec,
                        page_tokens=self.page_tokens, request_id=rid,
                        claim_timeout_ms=self.claim_timeout_ms))
            except core.KvxferError as e:  # finished() reports it sent: blocks freed
                self._give_up(t, str(e))
        deadline = time.monotonic() + self.claim_timeout_ms / 1000
        for r in meta.recvs:
            self._recving[r.req_id] = _Transfer([], r.block_ids, deadline=deadline)
            self._waiting.append(r)
        self._post_loads()
        for r in meta.releases:
            self._release(r)
        for req_id in meta.cancels:
            t = self._recving.get(req_id)
            if t is None:
                continue
            t.aborted = True
            queued = [r for r in self._waiting if r.req_id == req_id]
            for r in queued:  # not posted yet (max_loads): post it to cancel it
                self._waiting.remove(r)
                self._post(r, t)
            for q in t.requests:
                q.cancel()

    def _release(self, r, targets=None, bad=None):
        """A receive by the id of each head this rank would load, or
        release (_plan; or `targets`, [(local head, request id, prefill
        rank)]), of one token into block 0 (vLLM's null block),
        cancelled at once: it asks the prefill's send, which then fails on
        being refused (or on the descriptor mismatch), so the prefill frees
        its blocks.  Nothing is written: no page goes before a matched
        handshake.  When the prefill's topology cannot serve this decode at
        all (_TopologyError), TP rank 0 releases every head of every prefill
        rank, from the prefill's own layout.  An address whose connect fails
        (or is in `bad`) is not tried again in the call.  Best effort: an
        error only loses the early release (the prefill waits for
        claim_timeout_ms)."""
        t, bad = _Transfer([], []), self._unreachable if bad is None else bad
        if targets is None:
            try:
                loads, unasked = self._plan(r)
                targets = loads + [(0, rid, p) for rid, p in unasked]
            except _TopologyError:
                targets = self._all_sends(r) if self.tp_rank == 0 else []
            except ValueError:
                return
        for j, rid, p in targets:
            try:
                t.requests.append(self.ep.recv_blocks(self._peer(r, p, t, bad), self.pools[j],
                                                      [0], 1, request_id=rid))
            except (core.KvxferError, ValueError):
                pass
        for q in t.requests:
            q.cancel()
        if t.requests:
            self._released.append(t)

    def _all_sends(self, r):
        """[(0, request id, prefill rank)] of every send of load `r`'s
        prefill, from its remote_total_kv_heads and TP size; [] when they
        do not say."""
        try:
            out = []
            for p in range(len(r.remote_endpoints)):
                h = TpHeads.of(r.remote_total_kv_heads, len(r.remote_endpoints), p)
                out += [(0, request_id64(r.remote_request_id, h.first + j, h.replica), p)
                        for j in range(h.count)]
            return out
        except ValueError:
            return []

    def _plan(self, r):
        """Where load `r` comes from: ([(local head, request id, prefill
        rank)] to receive, [(request id, prefill rank)] to release: prefill
        replicas of its heads that no decode rank asks for, which the
        decode's replica 0 of each head releases).  Decode replica k of a
        head loads the prefill's replica k.  _TopologyError when the
        prefill's topology cannot serve any decode rank, ValueError when it
        cannot serve this one."""
        if not self.pools:
            raise ValueError("no KV caches registered (register_kv_caches)")
        ptp, total = len(r.remote_endpoints), self.total_kv_heads
        if r.remote_total_kv_heads and r.remote_total_kv_heads != total:
            raise _TopologyError("the prefill's model has %d KV heads and this decode's %d" %
                                 (r.remote_total_kv_heads, total))
        try:
            src = TpHeads.of(total, ptp, 0)
        except ValueError as e:
            raise _TopologyError(str(e)) from None
        mine = self.heads
        if mine.replica >= src.replicas:
            raise ValueError("this decode rank holds replica %d of KV head %d (TP %d, %d KV heads) "
                             "and the prefill (TP %d) holds %d: kvxfer sends each replica once" %
                             (mine.replica, mine.first, self.tp_size, total, ptp, src.replicas))
        loads, unasked = [], []
        for j in range(mine.count):
            g = mine.first + j
            if src.replicas == 1:
                loads.append((j, request_id64(r.remote_request_id, g), g // src.count))
                continue
            loads.append((j, request_id64(r.remote_request_id, g, mine.replica),
                          g * src.replicas + mine.replica))
            if mine.replica == 0:
                for k in range(mine.replicas, src.replicas):
                    unasked.append((request_id64(r.remote_request_id, g, k), g * src.replicas + k))
        return loads, unasked

    def _peer(self, r, rank, t, bad):
        """The kvxfer peer of prefill TP rank `rank` of load `r`
        (connected once per address), noted in t.addresses.  Once a connect
        has failed in this start() or finished() call (`bad`, the call's
        _unreachable, not empty) no new address is connected: prefill ranks
        that do not answer cost the model runner one timeout per call, not
        one per rank or per load; a sibling rank not yet connected then
        keeps its blocks until its claim_timeout_ms.  A failed connect adds
        its address to `bad`."""
        address = _hex(r.remote_endpoints[rank], "kv_transfer_params remote_endpoints")
        if address in bad or (bad and address not in self._peers):
            raise ValueError("prefill TP rank %d could not be reached" % rank)
        if address not in self._peers:
            try:
                self._peers[address] = self.ep.connect(address)
            except core.KvxferError:
                bad.add(address)
                raise
        t.addresses.append(address)
        return self._peers[address]

    @staticmethod
    def _give_up(t, why):
        t.error = t.error or why
        for q in t.requests:
            q.cancel()

    def _post(self, r, t):
        """Posts load `r`'s receives into `t`, one per KV head, each from
        the prefill rank holding it, and releases the prefill replicas no
        decode rank asks for.  When that fails (a bad block id, an
        unreachable prefill, a topology that cannot serve), the load fails
        and, if it can, the prefill is released (_release)."""
        bad = self._unreachable  # connects that failed in this call: no new ones
        try:
            loads, unasked = self._plan(r)
            for j, rid, p in loads:
                t.requests.append(self.ep.recv_blocks(self._peer(r, p, t, bad), self.pools[j],
                                                      r.block_ids, r.num_tokens, request_id=rid))
        except (core.KvxferError, ValueError) as e:  # reported by finished()
            for a in t.addresses:
                self._peers.pop(a, None)  # the next load connects afresh
            self._give_up(t, str(e))
            if self.pools:
                self._release(r, bad=bad)
            return
        if unasked:
            self._release(r, [(0, rid, p) for rid, p in unasked], bad)

    def _post_loads(self):
        """Posts waiting loads, in order, while max_loads allows."""
        posted = sum(len(t.requests) for t in self._recving.values())
        while self._waiting and posted + len(self.pools) <= max(self.max_loads, len(self.pools)):
            r = self._waiting.popleft()
            t = self._recving.get(r.req_id)
            if t is None or t.error:  # ended while it waited (finished)
                continue
            self._post(r, t)
            posted += len(t.requests)

    @staticmethod
    def _settled(t):
        """None while a request of `t` is in flight or waits to be posted;
        else its first error ("" if none)."""
        if any(not r.done for r in t.requests) or (not t.requests and not t.error):
            return None
        err = t.error
        for r in t.requests:
            if r.stage == Stage.ERROR and not err:
                try:
                    r.test()
                except core.KvxferError as e:
                    err = str(e)
            r.free()
        return err

    def finished(self):
        """get_finished: (finished sending, finished receiving, failed
        receiving), request ids, each reported once."""
        sent, received, failed = set(), set(), set()
        self._unreachable = set()
        now = time.monotonic()
        for req_id, t in self._recving.items():  # outlived the prefill's claim timeout
            if now > t.deadline and not t.error:
                self._give_up(t, "no load within claim_timeout_ms (%d ms)" %
                              self.claim_timeout_ms)
                if not t.requests:  # still waiting for max_loads: never posted
                    self._waiting = collections.deque(r for r in self._waiting
                                                       if r.req_id != req_id)
        self._released = [t for t in self._released if self._settled(t) is None]
        for table, out in ((self._sending, sent), (self._recving, received)):
            for req_id in list(table):
                err = self._settled(table[req_id])
                if err is None:
                    continue
                out.add(req_id)
                if err and table is self._recving and not table[req_id].aborted:
                    failed.add(req_id)
                    self._load_errors.update(table[req_id].block_ids)
                    for a in table[req_id].addresses:
                        self._peers.pop(a, None)  # reconnect next time
                del table[req_id]
        self._post_loads()
        return sent, received, failed

    def layers_ready(self, req_id):
        """How many leading layers of load `req_id` are COMPLETE in every KV
        head (per-layer readiness; vLLM runs a request only once finished()
        reported it, so wait_for_layer_load needs none).  0 while it waits
        to be posted; raises KvxferError if a head failed."""
        t = self._recving.get(req_id)
        if t is None or not t.requests:
            return 0
        n = self.num_layers
        for r in t.requests:
            k = 0
            while k < n and r.test_layer(k) == Stage.COMPLETE:
                k += 1
            n = min(n, k)
        return n

    def load_errors(self):
        """get_block_ids_with_load_errors: block ids of failed loads since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self):
        """Cancels what is in flight (the peers are told), destroys the
        endpoint, frees the requests and the pools.  Idempotent."""
        transfers = list(self._sending.values()) + list(self._recving.values()) + self._released
        for t in transfers:
            for r in t.requests:
                r.cancel()
        self.ep.destroy()  # every request is final after it
        for t in transfers:
            for r in t.requests:
                r.free()
        self._sending, self._recving, self._released = {}, {}, []
        for p in self.pools:
            p.close()
        self.pools = []
