// The NCCL backend (include/kvxfer/kvxfer_nccl.h, docs/NCCL.md).
//
// Without a GPU: the argument checks (config, ops, the C API) and the shared
// library's exports run everywhere.  With a GPU: a single-rank communicator
// sends to itself (a send op and a recv op in one call, so every phase is one
// NCCL group holding both sides), and the receiver's device blocks are
// compared byte for byte with the CPU codec (codec::encode_page +
// decode_page, REFERENCE path) applied to a host copy of the same KV: at
// ANCHOR_READY against the anchor-only decode, at COMPLETE against the full
// decode.  Padding and rows outside the KV are compared too (nothing else
// written).  Two ranks, two GPUs and real traffic classes are not tested
// here (docs/NCCL.md, "What is untested").
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "codec/page.h"
#include "common/error.h"
#include "kvxfer/kvxfer_nccl.h"
#include "nccl_backend/nccl_backend.h"
#include "xfer/protocol.h"

namespace kvxfer {
namespace {

bool gpu_available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = cudaGetErrorString(e);
    cudaGetLastError();
    return false;
  }
  if (n == 0) {
    *why = "cudaGetDeviceCount found 0 devices";
    return false;
  }
  return true;
}
#define REQUIRE_GPU()                                                             \
  do {                                                                            \
    std::string why_;                                                             \
    if (!gpu_available(&why_)) GTEST_SKIP() << "no usable CUDA device: " << why_; \
  } while (0)

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call
#define NCCL_OK(call) ASSERT_EQ((call), ncclSuccess) << #call

bool contains(const std::string& s, const char* what) { return s.find(what) != std::string::npos; }

// ---------------------------------------------------------------------------
// A paged KV (every layer's K and V) on the host, mirrored on the device.
// ---------------------------------------------------------------------------
struct PagedKV {
  int32_t L, heads, dim, H;
  int64_t T, stride, nb;
  int32_t bs;
  kvxfer_dtype_t dt;
  size_t es;
  std::vector<std::vector<uint8_t>> host[2];  // [kind][l * nb + b]
  std::vector<void*> hptr[2], dptr[2];

  PagedKV(int32_t layers, int32_t kv_heads, int32_t head_dim, int64_t tokens, int32_t block,
          int64_t pad, kvxfer_dtype_t dtype)
      : L(layers),
        heads(kv_heads),
        dim(head_dim),
        H(kv_heads * head_dim),
        T(tokens),
        stride(H + pad),
        nb((tokens + block - 1) / block + 1),
        bs(block),
        dt(dtype),
        es(codec::dtype_size(dtype)) {
    for (int k = 0; k < 2; ++k)
      for (int64_t i = 0; i < L * nb; ++i) {
        host[k].emplace_back(static_cast<size_t>(bs * stride) * es, 0xA5);
        hptr[k].push_back(host[k].back().data());
      }
  }
  PagedKV(const PagedKV&) = delete;
  PagedKV& operator=(const PagedKV&) = delete;
  ~PagedKV() {
    for (auto& v : dptr)
      for (void* p : v) cudaFree(p);
  }
  kvxfer_page_layout_t host_layout(int32_t l, kvxfer_kv_kind_t kind, int64_t t0, int64_t n) {
    kvxfer_page_layout_t p{};
    p.blocks = hptr[kind].data() + l * nb;
    p.num_blocks = nb;
    p.block_size = bs;
    p.row_stride = stride;
    p.first_token = t0;
    p.num_tokens = n;
    p.num_channels = H;
    p.dtype = dt;
    return p;
  }
  /** Seeded KV-like values (per-channel offset and gain, a few outlier channels). */
  void fill(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    for (int k = 0; k < 2; ++k)
      for (int32_t l = 0; l < L; ++l) {
        std::vector<float> off(H), gain(H);
        for (int32_t c = 0; c < H; ++c) {
          off[c] = 4.0f * u(rng);
          gain[c] = c % 17 == 3 ? 50.0f : 1.0f + u(rng);
        }
        kvxfer_page_layout_t p = host_layout(l, static_cast<kvxfer_kv_kind_t>(k), 0, T);
        codec::Layout lay{&p, es};
        for (int64_t t = 0; t < T; ++t)
          for (int32_t c = 0; c < H; ++c)
            codec::store_elem(lay.row(t), c, dt, off[c] + gain[c] * u(rng));
      }
  }
  void upload() {
    for (int k = 0; k < 2; ++k) {
      if (dptr[k].empty())
        for (auto& b : host[k]) {
          void* d = nullptr;
          EXPECT_EQ(cudaMalloc(&d, b.size()), cudaSuccess);
          dptr[k].push_back(d);
        }
      for (size_t i = 0; i < host[k].size(); ++i)
        EXPECT_EQ(
            cudaMemcpy(dptr[k][i], host[k][i].data(), host[k][i].size(), cudaMemcpyHostToDevice),
            cudaSuccess);
    }
  }
  /** Every device block, concatenated (K then V). */
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> out;
    for (int k = 0; k < 2; ++k)
      for (size_t i = 0; i < dptr[k].size(); ++i) {
        std::vector<uint8_t> b(host[k][i].size());
        EXPECT_EQ(cudaMemcpy(b.data(), dptr[k][i], b.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        out.insert(out.end(), b.begin(), b.end());
      }
    return out;
  }
  std::vector<uint8_t> host_bytes() const {
    std::vector<uint8_t> out;
    for (int k = 0; k < 2; ++k)
      for (const auto& b : host[k]) out.insert(out.end(), b.begin(), b.end());
    return out;
  }
  kvxfer_kv_desc_t desc(int device) const {
    kvxfer_kv_desc_t kv = KVXFER_KV_DESC_INITIALIZER;
    kv.num_layers = L;
    kv.kv_heads = heads;
    kv.head_dim = dim;
    kv.dtype = dt;
    kv.num_tokens = T;
    kv.block_size = bs;
    kv.row_stride = stride;
    kv.num_blocks = nb;
    kv.k_blocks = dptr[0].data();
    kv.v_blocks = dptr[1].data();
    kv.device = device;
    return kv;
  }
};

std::string first_diff(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got) {
  if (want.size() != got.size())
    return "sizes differ: " + std::to_string(want.size()) + " vs " + std::to_string(got.size());
  for (size_t i = 0; i < want.size(); ++i)
    if (want[i] != got[i]) {
      char b[128];
      std::snprintf(b, sizeof(b), "first difference at byte %zu of %zu: cpu 0x%02x gpu 0x%02x", i,
                    want.size(), want[i], got[i]);
      return b;
    }
  return "";
}

/**
 * What the receiver must hold: the CPU codec (REFERENCE) run over the
 * sender's host KV, page by page as the protocol plans them, decoded into a
 * host mirror of the receiver's blocks.  Also the section byte totals.
 */
struct Expected {
  std::vector<uint8_t> anchor_only, full;
  uint64_t anchor_bytes = 0, residual_bytes = 0;
};
Expected cpu_expected(PagedKV& src, PagedKV& dst_mirror, const kvxfer_codec_config_t& cfg,
                      int32_t page_tokens, uint64_t tag) {
  Expected e;
  const auto pages = xfer::plan_pages(src.L, src.T, page_tokens);
  std::vector<std::vector<uint8_t>> anchors, residuals;
  for (const auto& p : pages) {
    size_t am = 0, rm = 0;
    EXPECT_EQ(codec::max_sizes(&cfg, p.num_tokens, src.H, &am, &rm), KVXFER_SUCCESS);
    std::vector<uint8_t> a(am), r(rm);
    size_t al = 0, rl = 0;
    const kvxfer_page_id_t id{static_cast<uint32_t>(p.layer), p.kind, p.token_begin, tag};
    const kvxfer_page_layout_t sl = src.host_layout(p.layer, p.kind, p.token_begin, p.num_tokens);
    EXPECT_EQ(codec::encode_page(&cfg, &id, &sl, a.data(), am, &al, r.data(), rm, &rl,
                                 codec::Impl::REFERENCE, 1),
              KVXFER_SUCCESS)
        << last_error();
    a.resize(al);
    r.resize(rl);
    e.anchor_bytes += al;
    e.residual_bytes += rl;
    const kvxfer_page_layout_t dl =
        dst_mirror.host_layout(p.layer, p.kind, p.token_begin, p.num_tokens);
    EXPECT_EQ(codec::decode_page(a.data(), al, nullptr, 0, &id, &dl, codec::Impl::REFERENCE, 1),
              KVXFER_SUCCESS)
        << last_error();
    anchors.push_back(std::move(a));
    residuals.push_back(std::move(r));
  }
  e.anchor_only = dst_mirror.host_bytes();
  for (size_t i = 0; i < pages.size(); ++i) {
    const auto& p = pages[i];
    const kvxfer_page_id_t id{static_cast<uint32_t>(p.layer), p.kind, p.token_begin, tag};
    const kvxfer_page_layout_t dl =
        dst_mirror.host_layout(p.layer, p.kind, p.token_begin, p.num_tokens);
    EXPECT_EQ(codec::decode_page(anchors[i].data(), anchors[i].size(), residuals[i].data(),
                                 residuals[i].size(), &id, &dl, codec::Impl::REFERENCE, 1),
              KVXFER_SUCCESS)
        << last_error();
  }
  e.full = dst_mirror.host_bytes();
  return e;
}

kvxfer_nccl_op_t make_op(bool send, int peer, const kvxfer_kv_desc_t* kv,
                         const kvxfer_codec_config_t* codec = nullptr) {
  kvxfer_nccl_op_t op = KVXFER_NCCL_OP_INITIALIZER;
  op.is_send = send ? 1 : 0;
  op.peer = peer;
  op.kv = kv;
  op.codec = codec;
  return op;
}

/** A single-rank kvxfer NCCL communicator on device 0. */
kvxfer_result_t self_comm(kvxfer_nccl_comm_t* comm, int32_t timeout_ms = 0) {
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);  // bootstrap on 127.0.0.1 only
  ncclUniqueId a, r;
  if (ncclGetUniqueId(&a) != ncclSuccess || ncclGetUniqueId(&r) != ncclSuccess)
    return KVXFER_ERR_SYSTEM;
  kvxfer_nccl_config_t cfg = KVXFER_NCCL_CONFIG_INITIALIZER;
  cfg.timeout_ms = timeout_ms;
  return kvxfer_nccl_comm_init(comm, 1, a, r, 0, 0, &cfg);
}

// ===========================================================================
// No device needed
// ===========================================================================
TEST(Args, ConfigDefaultsAndChecks) {
  nccl::Options o;
  ASSERT_EQ(nccl::check_config(nullptr, &o), KVXFER_SUCCESS);
  EXPECT_EQ(o.anchor_tc, 0);
  EXPECT_EQ(o.residual_tc, 1);
  EXPECT_GT(o.timeout_ms, 0);
  kvxfer_nccl_config_t c = KVXFER_NCCL_CONFIG_INITIALIZER;
  c.anchor_traffic_class = 106;
  c.residual_traffic_class = -1;
  c.timeout_ms = 1234;
  ASSERT_EQ(nccl::check_config(&c, &o), KVXFER_SUCCESS);
  EXPECT_EQ(o.anchor_tc, 106);
  EXPECT_EQ(o.residual_tc, -1);
  EXPECT_EQ(o.timeout_ms, 1234);

  kvxfer_nccl_config_t bad = c;
  bad.magic = 0;
  EXPECT_EQ(nccl::check_config(&bad, &o), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "KVXFER_NCCL_CONFIG_INITIALIZER")) << last_error();
  bad = c;
  bad.anchor_traffic_class = -2;
  EXPECT_EQ(nccl::check_config(&bad, &o), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "anchor_traffic_class")) << last_error();
  bad = c;
  bad.residual_traffic_class = -7;
  EXPECT_EQ(nccl::check_config(&bad, &o), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "residual_traffic_class")) << last_error();
  bad = c;
  bad.timeout_ms = -1;
  EXPECT_EQ(nccl::check_config(&bad, &o), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(last_error(), "timeout_ms")) << last_error();
}

/** An op over fake device pointers: validate_op never dereferences them. */
struct FakeKV {
  std::vector<void*> k, v;
  kvxfer_kv_desc_t kv = KVXFER_KV_DESC_INITIALIZER;
  FakeKV() {
    kv.num_layers = 2;
    kv.kv_heads = 2;
    kv.head_dim = 64;
    kv.num_tokens = 100;
    kv.block_size = 16;
    kv.num_blocks = 7;
    kv.device = 0;
    for (int i = 0; i < 14; ++i) {
      k.push_back(reinterpret_cast<void*>(uintptr_t{0x10000} * (i + 1)));
      v.push_back(reinterpret_cast<void*>(uintptr_t{0x20000000} + 0x10000 * i));
    }
    kv.k_blocks = k.data();
    kv.v_blocks = v.data();
  }
};

TEST(Args, OpValidation) {
  FakeKV f;
  kvxfer_codec_config_t lynx = KVXFER_CODEC_CONFIG_INITIALIZER;
  kvxfer_nccl_op_t op = make_op(true, 1, &f.kv, &lynx);
  ASSERT_EQ(nccl::validate_op(&op, 0, 2, 0), KVXFER_SUCCESS) << last_error();
  kvxfer_nccl_op_t recv = make_op(false, 0, &f.kv);
  ASSERT_EQ(nccl::validate_op(&recv, 1, 2, 0), KVXFER_SUCCESS) << last_error();

  struct Case {
    const char* name;
    kvxfer_result_t want;
    const char* text;
  };
  auto check = [&](kvxfer_nccl_op_t o, const Case& c) {
    EXPECT_EQ(nccl::validate_op(&o, 3, 2, 0), c.want) << c.name;
    EXPECT_TRUE(contains(last_error(), c.text)) << c.name << ": " << last_error();
    EXPECT_TRUE(contains(last_error(), "op 3")) << c.name << ": " << last_error();
  };
  kvxfer_nccl_op_t o = op;
  o.magic = 1;
  check(o, {"magic", KVXFER_ERR_INVALID_ARGUMENT, "KVXFER_NCCL_OP_INITIALIZER"});
  o = op;
  o.peer = 2;
  check(o, {"peer", KVXFER_ERR_INVALID_ARGUMENT, "peer 2"});
  o = op;
  o.is_send = 2;
  check(o, {"is_send", KVXFER_ERR_INVALID_ARGUMENT, "is_send"});

  FakeKV g;
  g.kv.device = -1;
  o = op;
  o.kv = &g.kv;
  check(o, {"host KV", KVXFER_ERR_UNSUPPORTED, "host memory"});
  g.kv.device = 1;
  check(o, {"other device", KVXFER_ERR_INVALID_ARGUMENT, "device 1"});
  g.kv.device = 0;
  g.kv.kv_heads = 1024;  // 65536 channels
  check(o, {"H", KVXFER_ERR_INVALID_ARGUMENT, "65535"});
  g.kv.kv_heads = 2;
  g.kv.num_blocks = 6;  // 100 tokens need 7 blocks of 16
  check(o, {"num_blocks", KVXFER_ERR_INVALID_ARGUMENT, "num_blocks 6"});
  g.kv.num_blocks = 7;
  g.v[7 + 3] = nullptr;
  check(o, {"NULL block", KVXFER_ERR_INVALID_ARGUMENT, "layer 1 V block 3"});
  g.v[7 + 3] = g.v[0];
  g.kv.row_stride = 100;
  check(o, {"row_stride", KVXFER_ERR_INVALID_ARGUMENT, "row_stride 100"});
  g.kv.row_stride = 0;
  g.kv.magic = 0;
  check(o, {"kv magic", KVXFER_ERR_INVALID_ARGUMENT, "KVXFER_KV_DESC_INITIALIZER"});
  g.kv.magic = KVXFER_CONFIG_MAGIC;
  // The call reads *kv and *codec in place: an older, smaller one is refused.
  g.kv.size = offsetof(kvxfer_kv_desc_t, device);
  check(o, {"older kv", KVXFER_ERR_INVALID_ARGUMENT,
            "size 80, magic 0x6b767866): the size must be 88 to 88"});
  g.kv.size = sizeof(kvxfer_kv_desc_t);
  kvxfer_codec_config_t older = lynx;
  older.size = offsetof(kvxfer_codec_config_t, value_groups);
  o = op;
  o.codec = &older;
  check(o, {"older codec", KVXFER_ERR_INVALID_ARGUMENT, "codec config not initialised (size 40"});

  kvxfer_codec_config_t c = lynx;
  c.alpha = KVXFER_ALPHA_AUTO;
  o = op;
  o.codec = &c;
  check(o, {"alpha auto", KVXFER_ERR_UNSUPPORTED, "alpha=auto"});
  c = lynx;
  c.codec = KVXFER_CODEC_SPECTRUM;  // no GPU encoder: refused before anything is sent
  check(o, {"spectrum", KVXFER_ERR_UNSUPPORTED, "SPECTRUM"});
  c = lynx;
  c.chunk_tokens = 48;
  check(o, {"chunk", KVXFER_ERR_INVALID_ARGUMENT, "48"});
  c = lynx;
  c.codec = KVXFER_CODEC_BF16;
  o.mode = KVXFER_MODE_PROGRESSIVE;
  check(o, {"bf16 progressive", KVXFER_ERR_INVALID_ARGUMENT, "BF16 passthrough"});
  o.mode = KVXFER_MODE_AUTO;
  EXPECT_EQ(nccl::validate_op(&o, 3, 2, 0), KVXFER_SUCCESS) << last_error();
  o = op;
  o.page_tokens = -4;
  check(o, {"page_tokens", KVXFER_ERR_INVALID_ARGUMENT, "page_tokens -4"});
  // A receiver's codec is the sender's: its own codec field is not read.
  kvxfer_nccl_op_t r2 = recv;
  r2.codec = &c;
  c.alpha = KVXFER_ALPHA_AUTO;
  EXPECT_EQ(nccl::validate_op(&r2, 0, 2, 0), KVXFER_SUCCESS) << last_error();
}

TEST(Args, CApiWithoutDevice) {
  ncclUniqueId a{}, b{};
  b.internal[0] = 1;
  EXPECT_EQ(kvxfer_nccl_comm_init(nullptr, 2, a, b, 0, 0, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(kvxfer_nccl_get_last_error(), "NULL")) << kvxfer_nccl_get_last_error();
  kvxfer_nccl_comm_t comm = reinterpret_cast<kvxfer_nccl_comm_t>(0x1);
  EXPECT_EQ(kvxfer_nccl_comm_init(&comm, 0, a, b, 0, 0, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(comm, nullptr);
  EXPECT_TRUE(contains(kvxfer_nccl_get_last_error(), "nranks 0")) << kvxfer_nccl_get_last_error();
  EXPECT_EQ(kvxfer_nccl_comm_init(&comm, 2, a, b, 2, 0, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(kvxfer_nccl_get_last_error(), "rank 2")) << kvxfer_nccl_get_last_error();
  EXPECT_EQ(kvxfer_nccl_comm_init(&comm, 2, a, a, 0, 0, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(kvxfer_nccl_get_last_error(), "ids are equal"))
      << kvxfer_nccl_get_last_error();
  kvxfer_nccl_config_t bad = KVXFER_NCCL_CONFIG_INITIALIZER;
  bad.size = 4;
  EXPECT_EQ(kvxfer_nccl_comm_init(&comm, 2, a, b, 0, 0, &bad), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_nccl_comm_init_from_comms(&comm, nullptr, nullptr, nullptr),
            KVXFER_ERR_INVALID_ARGUMENT);
  ncclComm_t same = reinterpret_cast<ncclComm_t>(0x10);
  EXPECT_EQ(kvxfer_nccl_comm_init_from_comms(&comm, same, same, nullptr),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(kvxfer_nccl_get_last_error(), "the same")) << kvxfer_nccl_get_last_error();
  kvxfer_nccl_op_t op = KVXFER_NCCL_OP_INITIALIZER;
  EXPECT_EQ(kvxfer_nccl_xfer(nullptr, &op, 1), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_nccl_comm_destroy(nullptr), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_nccl_comm_abort(nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(nccl::status_block_bytes(), xfer::kStatusHeaderBytes + xfer::kMaxStatusText);
}

#ifdef KVXFER_NCCL_LIB_PATH
// libkvxfer_nccl.so loads without a GPU and exports only kvxfer_nccl_*, versioned.
TEST(Args, SharedLibraryLoadsAndExportsOnlyNccl) {
  void* h = dlopen(KVXFER_NCCL_LIB_PATH, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr) << dlerror();
  using Init = kvxfer_result_t (*)(kvxfer_nccl_comm_t*, int, ncclUniqueId, ncclUniqueId, int, int,
                                   const kvxfer_nccl_config_t*);
  using LastError = const char* (*)();
  auto init = reinterpret_cast<Init>(dlsym(h, "kvxfer_nccl_comm_init"));
  auto err = reinterpret_cast<LastError>(dlsym(h, "kvxfer_nccl_get_last_error"));
  ASSERT_NE(init, nullptr);
  ASSERT_NE(err, nullptr);
  EXPECT_NE(dlsym(h, "kvxfer_nccl_xfer"), nullptr);
  // The exports carry the library's version node (src/nccl_backend/libkvxfer_nccl.map).
  EXPECT_EQ(dlvsym(h, "kvxfer_nccl_comm_init", "KVXFER_NCCL_0.1"), reinterpret_cast<void*>(init));
  EXPECT_EQ(dlvsym(h, "kvxfer_nccl_get_last_error", "KVXFER_NCCL_0.1"),
            reinterpret_cast<void*>(err));
  EXPECT_EQ(dlsym(h, "kvxfer_page_encode"), nullptr);  // the codec copy stays internal
  EXPECT_EQ(dlsym(h, "kvxfer_get_last_error"), nullptr);
  ncclUniqueId a{}, b{};
  b.internal[0] = 1;
  EXPECT_EQ(init(nullptr, 1, a, b, 0, 0, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(err(), "NULL communicator output")) << err();
  dlclose(h);
}
#endif

// ===========================================================================
// GPU: single-rank loopback
// ===========================================================================
struct Captured {
  PagedKV* dst = nullptr;
  std::vector<uint8_t> at_anchor_ready;
  int anchor_calls = 0, complete_calls = 0;
  kvxfer_stage_t last_stage = KVXFER_STAGE_POSTED;
};
void on_anchor(int, kvxfer_stage_t stage, kvxfer_result_t r, void* u) {
  auto* c = static_cast<Captured*>(u);
  EXPECT_EQ(stage, KVXFER_STAGE_ANCHOR_READY);
  EXPECT_EQ(r, KVXFER_SUCCESS);
  ++c->anchor_calls;
  if (c->dst != nullptr) c->at_anchor_ready = c->dst->download();
}
void on_done(int, kvxfer_stage_t stage, kvxfer_result_t, void* u) {
  auto* c = static_cast<Captured*>(u);
  ++c->complete_calls;
  c->last_stage = stage;
}

/** Sends src to itself through `comm` and checks anchors and the end against the CPU codec. */
void loopback_bit_exact(kvxfer_nccl_comm_t comm, const kvxfer_codec_config_t& cfg,
                        kvxfer_mode_t mode, kvxfer_dtype_t src_dt, kvxfer_dtype_t dst_dt,
                        uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "codec " << cfg.codec << " A " << cfg.anchor_bits << " mode "
                                    << mode << " dtypes " << src_dt << "->" << dst_dt);
  const int32_t page_tokens = 128;
  const uint64_t tag = 77;
  PagedKV src(2, 2, 64, 300, 16, 0, src_dt);  // 300 tokens: pages of 128, 128, 44
  PagedKV dst(2, 2, 64, 300, 48, 8, dst_dt);  // another block size and a row stride
  PagedKV mirror(2, 2, 64, 300, 48, 8, dst_dt);
  src.fill(seed);
  src.upload();
  dst.upload();  // 0xA5 everywhere, as the mirror
  const Expected want = cpu_expected(src, mirror, cfg, page_tokens, tag);

  const kvxfer_kv_desc_t skv = src.desc(0), rkv = dst.desc(0);
  kvxfer_nccl_op_t ops[2] = {make_op(true, 0, &skv, &cfg), make_op(false, 0, &rkv)};
  Captured sc, rc;
  rc.dst = &dst;
  for (int i = 0; i < 2; ++i) {
    ops[i].tag = tag;
    ops[i].on_anchor_ready = on_anchor;
    ops[i].on_complete = on_done;
    ops[i].user_data = i == 0 ? &sc : &rc;
  }
  ops[0].page_tokens = page_tokens;
  ops[0].mode = mode;
  ASSERT_EQ(kvxfer_nccl_xfer(comm, ops, 2), KVXFER_SUCCESS) << kvxfer_nccl_get_last_error();
  const bool progressive = xfer::resolve_mode(mode, cfg) == KVXFER_MODE_PROGRESSIVE;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(ops[i].result, KVXFER_SUCCESS) << ops[i].error;
    EXPECT_EQ(ops[i].stage, KVXFER_STAGE_COMPLETE);
    EXPECT_STREQ(ops[i].error, "");
    EXPECT_EQ(ops[i].num_pages, 2 * 2 * 3);
    EXPECT_EQ(ops[i].anchor_wire_bytes,
              progressive ? want.anchor_bytes : want.anchor_bytes + want.residual_bytes);
    EXPECT_EQ(ops[i].residual_wire_bytes, progressive ? want.residual_bytes : 0u);
    EXPECT_GT(ops[i].t_anchor_ready_ns, 0);
    EXPECT_GE(ops[i].t_complete_ns, ops[i].t_anchor_ready_ns);
  }
  for (Captured* c : {&sc, &rc}) {
    EXPECT_EQ(c->anchor_calls, 1);
    EXPECT_EQ(c->complete_calls, 1);
    EXPECT_EQ(c->last_stage, KVXFER_STAGE_COMPLETE);
  }
  // ANCHOR_READY: exactly the CPU's anchor-only decode (full decode in monolithic mode).
  EXPECT_EQ(first_diff(progressive ? want.anchor_only : want.full, rc.at_anchor_ready), "");
  EXPECT_EQ(first_diff(want.full, dst.download()), "");
  if (progressive) {  // the anchor-ready check above can fail
    EXPECT_NE(want.anchor_only, want.full);
  }
}

TEST(Gpu, SelfLoopbackBitExact) {
  REQUIRE_GPU();
  kvxfer_nccl_comm_t comm = nullptr;
  ASSERT_EQ(self_comm(&comm), KVXFER_SUCCESS) << kvxfer_nccl_get_last_error();
  int n = 0, r = -1;
  EXPECT_EQ(kvxfer_nccl_comm_count(comm, &n), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_nccl_comm_user_rank(comm, &r), KVXFER_SUCCESS);
  EXPECT_EQ(n, 1);
  EXPECT_EQ(r, 0);
  kvxfer_codec_config_t c = KVXFER_CODEC_CONFIG_INITIALIZER;
  loopback_bit_exact(comm, c, KVXFER_MODE_AUTO, KVXFER_DTYPE_BF16, KVXFER_DTYPE_BF16, 1);
  c.alpha = 10.0f;
  c.anchor_bits = 3;
  c.chunk_tokens = 64;
  loopback_bit_exact(comm, c, KVXFER_MODE_AUTO, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32, 2);
  c = KVXFER_CODEC_CONFIG_INITIALIZER;
  c.codec = KVXFER_CODEC_INT8;
  loopback_bit_exact(comm, c, KVXFER_MODE_MONOLITHIC, KVXFER_DTYPE_BF16, KVXFER_DTYPE_BF16, 3);
  c.codec = KVXFER_CODEC_INT4;
  loopback_bit_exact(comm, c, KVXFER_MODE_AUTO, KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, 4);
  c.codec = KVXFER_CODEC_BF16;
  loopback_bit_exact(comm, c, KVXFER_MODE_AUTO, KVXFER_DTYPE_FP32, KVXFER_DTYPE_BF16, 5);
  EXPECT_EQ(kvxfer_nccl_comm_destroy(comm), KVXFER_SUCCESS) << kvxfer_nccl_get_last_error();
}

// The caller's own communicators (non-blocking, one per traffic class): per-op
// failures leave the communicator usable, and kvxfer never destroys them.
TEST(Gpu, UserCommunicatorsMismatchNanThenSuccess) {
  REQUIRE_GPU();
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  CUDA_OK(cudaSetDevice(0));
  ncclComm_t uc[2] = {nullptr, nullptr};
  for (int i = 0; i < 2; ++i) {
    ncclUniqueId id;
    NCCL_OK(ncclGetUniqueId(&id));
    ncclConfig_t nc = NCCL_CONFIG_INITIALIZER;
    nc.blocking = 0;
    nc.trafficClass = i;
    const ncclResult_t r = ncclCommInitRankConfig(&uc[i], 1, id, 0, &nc);
    ASSERT_TRUE(r == ncclSuccess || r == ncclInProgress) << ncclGetErrorString(r);
    ncclResult_t a = ncclInProgress;
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (a == ncclInProgress && std::chrono::steady_clock::now() < end)
      NCCL_OK(ncclCommGetAsyncError(uc[i], &a));
    ASSERT_EQ(a, ncclSuccess);
  }
  kvxfer_nccl_comm_t comm = nullptr;
  ASSERT_EQ(kvxfer_nccl_comm_init_from_comms(&comm, uc[0], uc[1], nullptr), KVXFER_SUCCESS)
      << kvxfer_nccl_get_last_error();

  PagedKV src(1, 1, 32, 100, 16, 0, KVXFER_DTYPE_BF16);
  PagedKV dst(1, 1, 32, 64, 16, 0, KVXFER_DTYPE_BF16);
  src.fill(9);
  src.upload();
  dst.upload();
  const std::vector<uint8_t> untouched = dst.download();
  kvxfer_codec_config_t lynx = KVXFER_CODEC_CONFIG_INITIALIZER;
  {  // 100 tokens against 64: both ops fail, both name the field; nothing written
    const kvxfer_kv_desc_t skv = src.desc(0), rkv = dst.desc(0);
    kvxfer_nccl_op_t ops[2] = {make_op(true, 0, &skv, &lynx), make_op(false, 0, &rkv)};
    EXPECT_EQ(kvxfer_nccl_xfer(comm, ops, 2), KVXFER_ERR_MISMATCH);
    for (const auto& o : ops) {
      EXPECT_EQ(o.result, KVXFER_ERR_MISMATCH);
      EXPECT_EQ(o.stage, KVXFER_STAGE_ERROR);
      EXPECT_TRUE(contains(o.error, "num_tokens is 100 on the sender and 64 on the receiver"))
          << o.error;
    }
    EXPECT_EQ(dst.download(), untouched);
  }
  PagedKV dst2(1, 1, 32, 100, 16, 0, KVXFER_DTYPE_BF16);
  dst2.upload();
  const std::vector<uint8_t> untouched2 = dst2.download();
  {  // NaN at layer 0 V, token 17, channel 5: NONFINITE on both sides, nothing written
    PagedKV bad(1, 1, 32, 100, 16, 0, KVXFER_DTYPE_BF16);
    bad.fill(9);
    kvxfer_page_layout_t l = bad.host_layout(0, KVXFER_KV_VALUE, 0, 100);
    codec::Layout lay{&l, bad.es};
    codec::store_elem(lay.row(17), 5, KVXFER_DTYPE_BF16, std::nanf(""));
    bad.upload();
    const kvxfer_kv_desc_t skv = bad.desc(0), rkv = dst2.desc(0);
    kvxfer_nccl_op_t ops[2] = {make_op(true, 0, &skv, &lynx), make_op(false, 0, &rkv)};
    EXPECT_EQ(kvxfer_nccl_xfer(comm, ops, 2), KVXFER_ERR_NONFINITE);
    for (const auto& o : ops) {
      EXPECT_EQ(o.result, KVXFER_ERR_NONFINITE) << o.error;
      EXPECT_TRUE(contains(o.error, "token 17")) << o.error;
      EXPECT_TRUE(contains(o.error, "channel 5")) << o.error;
    }
    EXPECT_EQ(dst2.download(), untouched2);
  }
  {  // the communicator is still usable
    PagedKV mirror(1, 1, 32, 100, 16, 0, KVXFER_DTYPE_BF16);
    const Expected want = cpu_expected(src, mirror, lynx, 256, 0);
    const kvxfer_kv_desc_t skv = src.desc(0), rkv = dst2.desc(0);
    kvxfer_nccl_op_t ops[2] = {make_op(true, 0, &skv, &lynx), make_op(false, 0, &rkv)};
    ASSERT_EQ(kvxfer_nccl_xfer(comm, ops, 2), KVXFER_SUCCESS) << kvxfer_nccl_get_last_error();
    EXPECT_EQ(first_diff(want.full, dst2.download()), "");
  }
  EXPECT_EQ(kvxfer_nccl_comm_destroy(comm), KVXFER_SUCCESS) << kvxfer_nccl_get_last_error();
  for (ncclComm_t c : uc) {  // still the caller's, still alive
    int n = 0;
    EXPECT_EQ(ncclCommCount(c, &n), ncclSuccess);
    EXPECT_EQ(n, 1);
    ncclCommDestroy(c);
  }
}

// A rank that never joins: kvxfer_nccl_comm_init returns TIMEOUT within the
// configured time (never hangs), with both NCCL communicators aborted.
TEST(Gpu, MissingRankTimesOut) {
  REQUIRE_GPU();
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  ncclUniqueId a, r;
  NCCL_OK(ncclGetUniqueId(&a));
  NCCL_OK(ncclGetUniqueId(&r));
  kvxfer_nccl_config_t cfg = KVXFER_NCCL_CONFIG_INITIALIZER;
  cfg.timeout_ms = 2000;
  kvxfer_nccl_comm_t comm = reinterpret_cast<kvxfer_nccl_comm_t>(0x1);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(kvxfer_nccl_comm_init(&comm, 2, a, r, 0, 0, &cfg), KVXFER_ERR_TIMEOUT)
      << kvxfer_nccl_get_last_error();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 30.0);
  EXPECT_EQ(comm, nullptr);
  EXPECT_TRUE(contains(kvxfer_nccl_get_last_error(), "2000 ms")) << kvxfer_nccl_get_last_error();
}

// Without a matching send a receive op cannot even pair its descriptor: a
// lone recv op to itself meets its own descriptor and fails on the spot
// (both sides receivers), instead of waiting.
TEST(Gpu, LoneReceiveFailsWithoutWaiting) {
  REQUIRE_GPU();
  kvxfer_nccl_comm_t comm = nullptr;
  ASSERT_EQ(self_comm(&comm, 2000), KVXFER_SUCCESS) << kvxfer_nccl_get_last_error();
  PagedKV dst(1, 1, 32, 50, 16, 0, KVXFER_DTYPE_BF16);
  dst.upload();
  const std::vector<uint8_t> untouched = dst.download();
  const kvxfer_kv_desc_t rkv = dst.desc(0);
  kvxfer_nccl_op_t op = make_op(false, 0, &rkv);
  EXPECT_EQ(kvxfer_nccl_xfer(comm, &op, 1), KVXFER_ERR_MISMATCH) << kvxfer_nccl_get_last_error();
  EXPECT_EQ(op.stage, KVXFER_STAGE_ERROR);
  EXPECT_TRUE(contains(op.error, "both ranks posted kvxfer_recv")) << op.error;
  EXPECT_EQ(dst.download(), untouched);
  EXPECT_EQ(kvxfer_nccl_comm_abort(comm), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_nccl_xfer(comm, &op, 1), KVXFER_ERR_INVALID_USAGE);
  EXPECT_TRUE(contains(kvxfer_nccl_get_last_error(), "aborted")) << kvxfer_nccl_get_last_error();
  EXPECT_EQ(kvxfer_nccl_comm_destroy(comm), KVXFER_SUCCESS) << kvxfer_nccl_get_last_error();
}

}  // namespace
}  // namespace kvxfer
