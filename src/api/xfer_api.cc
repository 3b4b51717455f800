// The exported C API of communicators and transfers (include/kvxfer/kvxfer.h,
// section "Communicators and progressive transfers") over xfer::Engine.
#include "api/xfer_api.h"

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "codec/kv_desc.h"
#include "common/api_call.h"
#include "common/error.h"
#include "common/params.h"
#include "common/struct_abi.h"
#include "tiers/spectrum_impl.h"
#include "transport/bootstrap.h"
#include "transport/tcp_io.h"
#include "xfer/device.h"
#include "xfer/endpoint.h"
#include "xfer/engine.h"
#include "xfer/kv_pool.h"

struct kvxfer_comm {
  std::unique_ptr<kvxfer::xfer::Engine> engine;
  std::unique_ptr<kvxfer::xfer::Membership> membership;  // endpoints only
  ~kvxfer_comm() {
    // Tell the peers and stop reporting failed Links before the engine goes.
    if (membership) membership->stop();
    engine.reset();
    membership.reset();
  }
};

struct kvxfer_request {
  std::shared_ptr<kvxfer::xfer::Request> req;
};

struct kvxfer_kv_pool {
  std::unique_ptr<kvxfer::xfer::KvPool> pool;
};

namespace {

using kvxfer::set_error;
using kvxfer::transport::BootstrapRoot;
using kvxfer::transport::UniqueId;

// Listeners made by kvxfer_get_unique_id, waiting for rank 0's
// kvxfer_comm_init in this process; keyed by the id's bytes.
std::mutex g_roots_mu;
std::map<std::string, std::unique_ptr<BootstrapRoot>> g_roots;

std::string id_key(const kvxfer_unique_id_t& id) {
  return std::string(id.internal, sizeof(id.internal));
}

/**
 * A config's string field (NUL-terminated, at most 1 KiB), read without
 * trusting the pointer, so that a wild one is an error at the call and
 * never a crash: `*out` holds it, and `*ptr` points at `*out` (NULL stays NULL).
 */
kvxfer_result_t config_string(const char* p, const char* config, const char* field,
                              std::string* out, const char** ptr) {
  *ptr = nullptr;
  if (p == nullptr) return KVXFER_SUCCESS;
  KVXFER_REQUIRE(kvxfer::codec::read_string_checked(p, 1024, out),
                 "%s.%s (%p) is not a readable string of at most 1 KiB", config, field,
                 static_cast<const void*>(p));
  *ptr = out->c_str();
  return KVXFER_SUCCESS;
}

}  // namespace

static_assert(sizeof(kvxfer_unique_id_t) == sizeof(UniqueId), "unique id sizes differ");

namespace kvxfer::api {

kvxfer_result_t comm_init(kvxfer_comm_t* comm, int nranks, kvxfer_unique_id_t id, int rank,
                          const kvxfer_comm_config_t* config,
                          std::shared_ptr<xfer::TestHooks> hooks) {
  return kvxfer::api_call("kvxfer_comm_init", [&] {
    KVXFER_REQUIRE(comm != nullptr, "comm is NULL");
    *comm = nullptr;
    KVXFER_REQUIRE(nranks >= 2 && nranks <= kvxfer::transport::kBootstrapMaxRanks,
                   "nranks %d outside [2, %d]", nranks, kvxfer::transport::kBootstrapMaxRanks);
    KVXFER_REQUIRE(rank >= 0 && rank < nranks, "rank %d outside [0, %d)", rank, nranks);
    kvxfer_comm_config_t cfg = KVXFER_COMM_CONFIG_INITIALIZER;
    if (config != nullptr) KVXFER_CHECK(kvxfer::read_struct(config, &cfg));
    std::string bind_text, rate_text;
    KVXFER_CHECK(config_string(cfg.bind_address, "kvxfer_comm_config_t", "bind_address", &bind_text,
                               &cfg.bind_address));
    KVXFER_CHECK(config_string(cfg.rate_limit, "kvxfer_comm_config_t", "rate_limit", &rate_text,
                               &cfg.rate_limit));
    KVXFER_REQUIRE(cfg.timeout_ms >= 0, "timeout_ms %d is negative", cfg.timeout_ms);
    const int timeout =
        cfg.timeout_ms > 0 ? cfg.timeout_ms : static_cast<int>(kvxfer::params::TimeoutMs());
    const std::string bind =
        cfg.bind_address != nullptr ? cfg.bind_address : kvxfer::params::BindAddr();
    KVXFER_CHECK(kvxfer::transport::tcp::check_bind_host(
        bind.c_str(),
        cfg.bind_address != nullptr ? "kvxfer_comm_config_t.bind_address" : "KVXFER_BIND_ADDR"));
    UniqueId uid;
    std::memcpy(&uid, id.internal, sizeof(uid));
    const char* defect = kvxfer::transport::unique_id_defect(uid);
    KVXFER_REQUIRE(defect == nullptr,
                   "the unique id is malformed (%s): pass the bytes kvxfer_get_unique_id "
                   "filled, unchanged",
                   defect);
    std::unique_ptr<BootstrapRoot> root;
    if (rank == 0) {
      std::lock_guard<std::mutex> lk(g_roots_mu);
      auto it = g_roots.find(id_key(id));
      KVXFER_REQUIRE(it != g_roots.end(),
                     "rank 0 must be the process that called kvxfer_get_unique_id for this id "
                     "(and may use it once)");
      root = std::move(it->second);
      g_roots.erase(it);
    }
    std::unique_ptr<kvxfer::xfer::Engine> e;
    KVXFER_CHECK(kvxfer::xfer::Engine::create(uid, std::move(root), rank, nranks, timeout, bind,
                                              cfg.rate_limit, &e, std::move(hooks)));
    *comm = new kvxfer_comm{std::move(e), nullptr};
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t endpoint_create(kvxfer_comm_t* ep, const kvxfer_endpoint_config_t* config,
                                std::shared_ptr<xfer::TestHooks> hooks) {
  return kvxfer::api_call("kvxfer_endpoint_create", [&] {
    KVXFER_REQUIRE(ep != nullptr, "ep is NULL");
    *ep = nullptr;
    kvxfer_endpoint_config_t cfg = KVXFER_ENDPOINT_CONFIG_INITIALIZER;
    if (config != nullptr) KVXFER_CHECK(kvxfer::read_struct(config, &cfg));
    std::string bind_text, rate_text;
    KVXFER_CHECK(config_string(cfg.bind_address, "kvxfer_endpoint_config_t", "bind_address",
                               &bind_text, &cfg.bind_address));
    KVXFER_CHECK(config_string(cfg.rate_limit, "kvxfer_endpoint_config_t", "rate_limit", &rate_text,
                               &cfg.rate_limit));
    KVXFER_REQUIRE(cfg.timeout_ms >= 0, "timeout_ms %d is negative", cfg.timeout_ms);
    KVXFER_REQUIRE(cfg.port >= 0 && cfg.port <= 65535, "port %d outside 0..65535", cfg.port);
    xfer::Membership::Config mc;
    mc.timeout_ms =
        cfg.timeout_ms > 0 ? cfg.timeout_ms : static_cast<int>(kvxfer::params::TimeoutMs());
    // Membership::create's listener refuses a host that does not resolve, or a wildcard.
    mc.host = cfg.bind_address != nullptr ? cfg.bind_address : kvxfer::params::BindAddr();
    mc.port = static_cast<uint16_t>(cfg.port);
    if (cfg.secret != nullptr) {
      mc.has_secret = true;
      KVXFER_REQUIRE(kvxfer::codec::copy_in_checked(cfg.secret, mc.secret.size(), mc.secret.data()),
                     "kvxfer_endpoint_config_t.secret (%p) is not %zu readable bytes",
                     static_cast<const void*>(cfg.secret), mc.secret.size());
    }
    mc.hooks = hooks;
    auto c = std::make_unique<kvxfer_comm>();
    KVXFER_CHECK(xfer::Engine::create_open(mc.timeout_ms, mc.host, cfg.rate_limit, &c->engine,
                                           std::move(hooks)));
    KVXFER_CHECK(xfer::Membership::create(c->engine.get(), mc, &c->membership));
    *ep = c.release();
    return KVXFER_SUCCESS;
  });
}

}  // namespace kvxfer::api

extern "C" {

kvxfer_result_t kvxfer_get_unique_id(kvxfer_unique_id_t* id) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(id != nullptr, "id is NULL");
    UniqueId uid{};
    std::unique_ptr<BootstrapRoot> root;
    KVXFER_CHECK(
        kvxfer::transport::create_unique_id(kvxfer::params::BootstrapAddr().c_str(), &uid, &root));
    std::memcpy(id->internal, &uid, sizeof(uid));
    std::lock_guard<std::mutex> lk(g_roots_mu);
    g_roots[id_key(*id)] = std::move(root);
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_comm_init(kvxfer_comm_t* comm, int nranks, kvxfer_unique_id_t id, int rank,
                                 const kvxfer_comm_config_t* config) {
  kvxfer::reset_outputs(comm);
  return kvxfer::api::comm_init(comm, nranks, id, rank, config, nullptr);
}

kvxfer_result_t kvxfer_comm_abort(kvxfer_comm_t comm) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(comm != nullptr, "comm is NULL");
    comm->engine->abort("kvxfer_comm_abort");
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_comm_destroy(kvxfer_comm_t comm) {
  return kvxfer::api_call(__func__, [&] {
    delete comm;  // Engine::~Engine aborts, joins and closes
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_endpoint_create(kvxfer_comm_t* ep, const kvxfer_endpoint_config_t* config) {
  kvxfer::reset_outputs(ep);
  return kvxfer::api::endpoint_create(ep, config, nullptr);
}

kvxfer_result_t kvxfer_endpoint_address(kvxfer_comm_t ep, void* buf, size_t* len) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(ep != nullptr && buf != nullptr && len != nullptr, "ep, buf or len is NULL");
    KVXFER_REQUIRE(ep->membership != nullptr,
                   "not an endpoint (a communicator of kvxfer_comm_init has no address)");
    const std::vector<uint8_t>& a = ep->membership->address();
    if (*len < a.size()) {
      const size_t cap = *len;
      *len = a.size();
      return set_error(KVXFER_ERR_BUFFER_TOO_SMALL, "the address is %zu bytes; buf holds %zu",
                       a.size(), cap);
    }
    std::memcpy(buf, a.data(), a.size());
    *len = a.size();
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_endpoint_connect(kvxfer_comm_t ep, const void* address, size_t len,
                                        int* peer) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(ep != nullptr && address != nullptr && peer != nullptr,
                   "ep, address or peer is NULL");
    KVXFER_REQUIRE(ep->membership != nullptr,
                   "not an endpoint (a communicator of kvxfer_comm_init has fixed peers)");
    return ep->membership->connect(address, len, peer);
  });
}

kvxfer_result_t kvxfer_endpoint_disconnect(kvxfer_comm_t ep, int peer) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(ep != nullptr, "ep is NULL");
    KVXFER_REQUIRE(ep->membership != nullptr,
                   "not an endpoint (a communicator of kvxfer_comm_init has fixed peers)");
    return ep->membership->disconnect(peer);
  });
}

kvxfer_result_t kvxfer_comm_count(kvxfer_comm_t comm, int* nranks) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(comm != nullptr && nranks != nullptr, "comm or nranks is NULL");
    *nranks = comm->engine->nranks();
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_comm_user_rank(kvxfer_comm_t comm, int* rank) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(comm != nullptr && rank != nullptr, "comm or rank is NULL");
    *rank = comm->engine->rank();
    return KVXFER_SUCCESS;
  });
}

// post and post_blocks run in the entry points' api_call, which emptied
// *request first (reset_outputs).
static kvxfer_result_t post(bool is_send, kvxfer_comm_t comm, int peer, const kvxfer_kv_desc_t* kv,
                            const kvxfer_codec_config_t* codec,
                            const kvxfer_request_config_t* config, kvxfer_request_t* request,
                            const kvxfer::xfer::SpectrumArgs* spectrum = nullptr,
                            void* cuda_stream = nullptr) {
  KVXFER_REQUIRE(comm != nullptr && request != nullptr, "comm or request is NULL");
  // The caller's structs made whole (common/struct_abi.h: older, smaller ones
  // take the defaults for the fields they lack); the engine reads the copies.
  kvxfer_kv_desc_t kv_whole;
  if (kv != nullptr) KVXFER_CHECK(kvxfer::codec::read_kv_desc(kv, "", &kv_whole));
  kvxfer_codec_config_t codec_whole;
  if (codec != nullptr) KVXFER_CHECK(kvxfer::read_struct(codec, &codec_whole));
  auto* h = new kvxfer_request;
  const kvxfer_result_t rc = comm->engine->post(is_send, peer, kv != nullptr ? &kv_whole : nullptr,
                                                codec != nullptr ? &codec_whole : nullptr, config,
                                                h, &h->req, spectrum, cuda_stream);
  if (rc < 0) {
    delete h;
    return rc;
  }
  *request = h;
  return KVXFER_SUCCESS;
}

kvxfer_result_t kvxfer_send(kvxfer_comm_t comm, int peer, const kvxfer_kv_desc_t* kv,
                            const kvxfer_codec_config_t* codec,
                            const kvxfer_request_config_t* config, kvxfer_request_t* request) {
  kvxfer::reset_outputs(request);
  return kvxfer::api_call(__func__,
                          [&] { return post(true, comm, peer, kv, codec, config, request); });
}

kvxfer_result_t kvxfer_send_on_stream(kvxfer_comm_t comm, int peer, const kvxfer_kv_desc_t* kv,
                                      const kvxfer_codec_config_t* codec,
                                      const kvxfer_request_config_t* config, void* stream,
                                      kvxfer_request_t* request) {
  kvxfer::reset_outputs(request);
  return kvxfer::api_call(__func__, [&] {
    return post(true, comm, peer, kv, codec, config, request, nullptr, stream);
  });
}

kvxfer_result_t kvxfer_send_spectrum(kvxfer_comm_t comm, int peer, const kvxfer_kv_desc_t* kv,
                                     const kvxfer_codec_config_t* codec,
                                     const kvxfer_spectrum_config_t* policy,
                                     const float* importance, const kvxfer_request_config_t* config,
                                     kvxfer_request_t* request) {
  kvxfer::reset_outputs(request);
  return kvxfer::api_call(__func__, [&] {
    kvxfer_codec_config_t cc;
    KVXFER_CHECK(kvxfer::spectrum::send_codec_config(codec, &cc));
    const kvxfer::xfer::SpectrumArgs sa{policy, importance};
    return post(true, comm, peer, kv, &cc, config, request, &sa);
  });
}

kvxfer_result_t kvxfer_request_get_tiers(kvxfer_request_t request, uint8_t* tiers,
                                         int64_t num_tokens) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(request != nullptr, "request is NULL");
    return kvxfer::xfer::request_tiers(*request->req, tiers, num_tokens);
  });
}

kvxfer_result_t kvxfer_kv_pool_register(const kvxfer_kv_pool_desc_t* desc, kvxfer_kv_pool_t* pool) {
  kvxfer::reset_outputs(pool);
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(pool != nullptr, "pool is NULL");
    auto h = std::make_unique<kvxfer_kv_pool>();
    KVXFER_CHECK(kvxfer::xfer::KvPool::create(desc, &h->pool));
    *pool = h.release();
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_kv_pool_deregister(kvxfer_kv_pool_t pool) {
  return kvxfer::api_call(__func__, [&] {
    if (pool == nullptr) return KVXFER_SUCCESS;
    const int64_t n = pool->pool->in_flight();
    if (n > 0)
      return set_error(KVXFER_ERR_INVALID_USAGE,
                       "%lld request(s) on the pool have not reached COMPLETE or ERROR: wait for "
                       "them or cancel them first",
                       static_cast<long long>(n));
    delete pool;
    return KVXFER_SUCCESS;
  });
}

static kvxfer_result_t post_blocks(bool is_send, kvxfer_comm_t comm, int peer,
                                   kvxfer_kv_pool_t pool, const kvxfer_kv_blocks_t* blocks,
                                   const kvxfer_codec_config_t* codec,
                                   const kvxfer_request_config_t* config,
                                   kvxfer_request_t* request) {
  KVXFER_REQUIRE(comm != nullptr && request != nullptr && pool != nullptr,
                 "comm, pool or request is NULL");
  std::vector<void*> k, v;
  kvxfer_kv_desc_t kv;
  KVXFER_CHECK(pool->pool->describe(blocks, !is_send, &k, &v, &kv));
  kvxfer_codec_config_t codec_whole;  // made whole, as in post()
  if (codec != nullptr) KVXFER_CHECK(kvxfer::read_struct(codec, &codec_whole));
  auto* h = new kvxfer_request;
  const kvxfer_result_t rc =
      comm->engine->post(is_send, peer, &kv, codec != nullptr ? &codec_whole : nullptr, config, h,
                         &h->req, nullptr, nullptr, /*memory_checked=*/true);
  if (rc < 0) {
    delete h;
    return rc;
  }
  pool->pool->track(h->req);
  *request = h;
  return KVXFER_SUCCESS;
}

kvxfer_result_t kvxfer_send_blocks(kvxfer_comm_t comm, int peer, kvxfer_kv_pool_t pool,
                                   const kvxfer_kv_blocks_t* blocks,
                                   const kvxfer_codec_config_t* codec,
                                   const kvxfer_request_config_t* config,
                                   kvxfer_request_t* request) {
  kvxfer::reset_outputs(request);
  return kvxfer::api_call(__func__, [&] {
    return post_blocks(true, comm, peer, pool, blocks, codec, config, request);
  });
}

kvxfer_result_t kvxfer_recv_blocks(kvxfer_comm_t comm, int peer, kvxfer_kv_pool_t pool,
                                   const kvxfer_kv_blocks_t* blocks,
                                   const kvxfer_request_config_t* config,
                                   kvxfer_request_t* request) {
  kvxfer::reset_outputs(request);
  return kvxfer::api_call(__func__, [&] {
    return post_blocks(false, comm, peer, pool, blocks, nullptr, config, request);
  });
}

kvxfer_result_t kvxfer_send_layer_ready(kvxfer_request_t request, int32_t layer) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(request != nullptr, "request is NULL");
    return kvxfer::xfer::request_layer_ready(*request->req, layer);
  });
}

kvxfer_result_t kvxfer_recv(kvxfer_comm_t comm, int peer, const kvxfer_kv_desc_t* kv,
                            const kvxfer_request_config_t* config, kvxfer_request_t* request) {
  kvxfer::reset_outputs(request);
  return kvxfer::api_call(__func__,
                          [&] { return post(false, comm, peer, kv, nullptr, config, request); });
}

kvxfer_result_t kvxfer_test(kvxfer_request_t request, kvxfer_stage_t* stage) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(request != nullptr, "request is NULL");
    return kvxfer::xfer::request_test(*request->req, -1, stage);
  });
}

kvxfer_result_t kvxfer_wait(kvxfer_request_t request, kvxfer_stage_t stage, int timeout_ms) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(request != nullptr, "request is NULL");
    return kvxfer::xfer::request_wait(*request->req, -1, kvxfer::c_enum_value(stage), timeout_ms);
  });
}

kvxfer_result_t kvxfer_request_wait_on_stream(kvxfer_request_t request, kvxfer_stage_t stage,
                                              void* stream) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(request != nullptr, "request is NULL");
    KVXFER_REQUIRE(stage == KVXFER_STAGE_ANCHOR_READY || stage == KVXFER_STAGE_COMPLETE,
                   "stage %d: a stream can wait for ANCHOR_READY or COMPLETE",
                   static_cast<int>(stage));
    kvxfer::xfer::DeviceCodec* dc = kvxfer::xfer::device_codec();
    if (dc == nullptr)
      return set_error(KVXFER_ERR_UNSUPPORTED, "this build of kvxfer has no CUDA support");
    // The host function owns its reference to the request: freeing the
    // handle before the stream gets there is safe.
    struct Wait {
      std::shared_ptr<kvxfer::xfer::Request> req;
      int32_t stage;
    };
    auto* w = new Wait{request->req, kvxfer::c_enum_value(stage)};
    const kvxfer_result_t rc = dc->enqueue_host_func(
        stream,
        [](void* p) {
          std::unique_ptr<Wait> w(static_cast<Wait*>(p));
          // Ends at the stage or at a final stage: a request always ends
          // (the transport's timeout, cancel, abort, destroy).
          kvxfer::xfer::request_wait(*w->req, -1, w->stage, -1);
        },
        w);
    if (rc != KVXFER_SUCCESS) delete w;
    return rc;
  });
}

kvxfer_result_t kvxfer_test_layer(kvxfer_request_t request, int32_t layer, kvxfer_stage_t* stage) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(request != nullptr, "request is NULL");
    KVXFER_REQUIRE(layer >= 0, "layer %d is negative", layer);
    return kvxfer::xfer::request_test(*request->req, layer, stage);
  });
}

kvxfer_result_t kvxfer_wait_layer(kvxfer_request_t request, int32_t layer, kvxfer_stage_t stage,
                                  int timeout_ms) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(request != nullptr, "request is NULL");
    KVXFER_REQUIRE(layer >= 0, "layer %d is negative", layer);
    return kvxfer::xfer::request_wait(*request->req, layer, kvxfer::c_enum_value(stage),
                                      timeout_ms);
  });
}

kvxfer_result_t kvxfer_request_get_info(kvxfer_request_t request, kvxfer_request_info_t* info) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(request != nullptr, "request is NULL");
    return kvxfer::xfer::request_info(*request->req, info);
  });
}

kvxfer_result_t kvxfer_request_get_arrivals(kvxfer_request_t request, kvxfer_arrival_t* out,
                                            size_t capacity, size_t* count) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(request != nullptr && count != nullptr, "request or count is NULL");
    KVXFER_REQUIRE(out != nullptr || capacity == 0, "out is NULL with capacity %zu", capacity);
    const kvxfer::xfer::Request& r = *request->req;
    std::lock_guard<std::mutex> lk(r.mu);
    *count = r.arrivals.size();
    for (size_t i = 0; i < capacity && i < r.arrivals.size(); ++i) {
      const auto& a = r.arrivals[i];
      out[i] = kvxfer_arrival_t{a.t_ns, a.traffic_class, a.layer, a.bytes};
    }
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_request_cancel(kvxfer_request_t request) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(request != nullptr, "request is NULL");
    return kvxfer::xfer::request_cancel(request->req);
  });
}

kvxfer_result_t kvxfer_request_free(kvxfer_request_t request) {
  return kvxfer::api_call(__func__, [&] {
    if (request == nullptr) return KVXFER_SUCCESS;
    if (!kvxfer::xfer::request_wait_final_callbacks(*request->req))
      return set_error(KVXFER_ERR_INVALID_USAGE,
                       "the request is still in flight: wait for COMPLETE or ERROR, cancel it "
                       "(kvxfer_request_cancel), or abort the communicator, before freeing it");
    delete request;
    return KVXFER_SUCCESS;
  });
}

}  // extern "C"
