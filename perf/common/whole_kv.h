// A whole KV in host memory for the benchmarks that move one at a time
// (perf/stream_perf, perf/fanin_perf): bf16, one block per layer and kind,
// and what a receiver of it must hold, through the public codec API.
// Header-only: it needs libkvxfer's C API and nothing of the harness.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace kvxfer::perf {

/** bfloat16 of a finite float, rounded to nearest even. */
inline uint16_t bf16_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/**
 * `L` layers of K and V, `T` tokens of `heads` x `head_dim` bf16 each, one
 * block per layer and kind ([T][H] row-major), zero-filled, and the
 * descriptor of kvxfer_send / kvxfer_recv for them.  Not copyable (the
 * descriptor points into it); not thread-safe.
 */
struct WholeKv {
  int L = 0;
  int64_t T = 0;
  int32_t heads = 8, head_dim = 128;
  std::vector<std::vector<uint16_t>> k, v;
  std::vector<void*> kb, vb;
  kvxfer_kv_desc_t desc = KVXFER_KV_DESC_INITIALIZER;

  WholeKv(int L_, int64_t T_, int32_t heads_ = 8, int32_t head_dim_ = 128)
      : L(L_), T(T_), heads(heads_), head_dim(head_dim_) {
    for (int l = 0; l < L; ++l) {
      k.emplace_back(static_cast<size_t>(T) * H(), 0);
      v.emplace_back(static_cast<size_t>(T) * H(), 0);
    }
    for (int l = 0; l < L; ++l) kb.push_back(k[l].data());
    for (int l = 0; l < L; ++l) vb.push_back(v[l].data());
    desc.num_layers = L;
    desc.kv_heads = heads;
    desc.head_dim = head_dim;
    desc.dtype = KVXFER_DTYPE_BF16;
    desc.num_tokens = T;
    desc.block_size = static_cast<int32_t>(T);
    desc.num_blocks = 1;
    desc.k_blocks = kb.data();
    desc.v_blocks = vb.data();
  }
  WholeKv(const WholeKv&) = delete;
  WholeKv& operator=(const WholeKv&) = delete;
  WholeKv(WholeKv&&) = default;

  int32_t H() const { return heads * head_dim; }
  /** Bytes of one layer's K (or V). */
  size_t layer_bytes() const { return static_cast<size_t>(T) * H() * 2; }
  /** Elements of `other` that differ from this KV's. */
  uint64_t differing(const WholeKv& other) const {
    uint64_t n = 0;
    for (int l = 0; l < L; ++l)
      for (size_t i = 0; i < k[l].size(); ++i)
        n += (k[l][i] != other.k[l][i]) + (v[l][i] != other.v[l][i]);
    return n;
  }
};

/**
 * What a receiver of `src` must hold: each of its pages through
 * kvxfer_page_encode and kvxfer_page_decode (full precision) into `out` (of
 * the same shape), on the engine's page plan (layer-major, K before V,
 * `page_tokens` tokens) with page stream id `tag`, the request's tag.
 * False, with the library's message in *err, on a failed call.
 */
inline bool expected_decode(const WholeKv& src, const kvxfer_codec_config_t& cfg,
                            int32_t page_tokens, uint64_t tag, WholeKv* out, std::string* err) {
  const int32_t H = src.H();
  for (int l = 0; l < src.L; ++l)
    for (int kind = 0; kind < 2; ++kind)
      for (int64_t t0 = 0; t0 < src.T; t0 += page_tokens) {
        const int64_t n = std::min<int64_t>(page_tokens, src.T - t0);
        void* sb = kind == 0 ? src.kb[l] : src.vb[l];
        void* db = kind == 0 ? out->kb[l] : out->vb[l];
        kvxfer_page_layout_t sl{
            &sb, 1, static_cast<int32_t>(src.T), H, t0, n, H, KVXFER_DTYPE_BF16};
        kvxfer_page_layout_t dl = sl;
        dl.blocks = &db;
        size_t acap = 0, rcap = 0, al = 0, rl = 0;
        const kvxfer_page_id_t id{static_cast<uint32_t>(l), static_cast<kvxfer_kv_kind_t>(kind), t0,
                                  tag};
        bool ok = kvxfer_page_max_size(&cfg, n, H, &acap, &rcap) >= 0;
        std::vector<uint8_t> a(acap), r(rcap);
        ok =
            ok && kvxfer_page_encode(&cfg, &id, &sl, a.data(), acap, &al, r.data(), rcap, &rl) >= 0;
        ok = ok && kvxfer_page_decode(a.data(), al, r.data(), rl, &id, &dl) >= 0;
        if (!ok) {
          *err = kvxfer_get_last_error();
          return false;
        }
      }
  return true;
}

/**
 * kvxfer_comm_init of rank `rank` of `nranks` with the link emulation `rate`
 * (tc syntax) and `timeout_ms`.  nullptr on failure, with the library's
 * message in *err.
 */
inline kvxfer_comm_t init_comm(const kvxfer_unique_id_t& id, int nranks, int rank,
                               const std::string& rate, int timeout_ms, std::string* err) {
  kvxfer_comm_config_t cfg = KVXFER_COMM_CONFIG_INITIALIZER;
  cfg.timeout_ms = timeout_ms;
  cfg.rate_limit = rate.c_str();
  kvxfer_comm_t comm = nullptr;
  if (kvxfer_comm_init(&comm, nranks, id, rank, &cfg) < 0) {
    *err = "kvxfer_comm_init (rank " + std::to_string(rank) + "): " + kvxfer_get_last_error();
    return nullptr;
  }
  return comm;
}

/** Fills `kv` with bf16 values uniform on [-4, 4] in steps of 1/250, a
 *  function of `seed`. */
inline void fill_uniform(WholeKv* kv, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int l = 0; l < kv->L; ++l)
    for (auto* t : {&kv->k[l], &kv->v[l]})
      for (auto& x : *t)
        x = bf16_of(static_cast<float>(static_cast<int64_t>(rng() % 2001) - 1000) / 250.0f);
}

}  // namespace kvxfer::perf
