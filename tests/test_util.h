// Helpers shared by the codec tests: pages in a paged block layout, filled
// from a seeded generator, and the documented error bound.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "codec/page.h"
#include "common/error.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::test {

/** A page held in `num_blocks` separately allocated blocks, with a row stride. */
struct PagedBuffer {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<void*> ptrs;
  kvxfer_page_layout_t layout{};

  PagedBuffer(int64_t T, int32_t H, kvxfer_dtype_t dt, int32_t block_size = 16,
              int64_t stride_pad = 3, int64_t first_token = 5) {
    layout.dtype = dt;
    layout.num_tokens = T;
    layout.num_channels = H;
    layout.block_size = block_size;
    layout.row_stride = H + stride_pad;
    layout.first_token = first_token;
    const int64_t nblocks = (first_token + T + block_size - 1) / block_size + 1;
    const size_t es = codec::dtype_size(dt);
    for (int64_t b = 0; b < nblocks; ++b)
      storage.emplace_back(static_cast<size_t>(block_size * layout.row_stride) * es, 0xA5);
    for (auto& s : storage) ptrs.push_back(s.data());
    layout.blocks = ptrs.data();
    layout.num_blocks = nblocks;
  }
  codec::Layout lay() const { return codec::Layout{&layout, codec::dtype_size(layout.dtype)}; }
  float get(int64_t t, int32_t c) const { return codec::load_elem(lay().row(t), c, layout.dtype); }
  void set(int64_t t, int32_t c, float v) { codec::store_elem(lay().row(t), c, layout.dtype, v); }
  /** Bytes of every row of the page, concatenated (for bit-exact comparisons). */
  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> out;
    const size_t es = codec::dtype_size(layout.dtype);
    for (int64_t t = 0; t < layout.num_tokens; ++t) {
      const uint8_t* r = lay().row(t);
      out.insert(out.end(), r, r + layout.num_channels * es);
    }
    return out;
  }
};

/** KV-like data: Laplacian bulk, per-channel offsets, a few 100x outlier channels. */
inline void fill_kv_like(PagedBuffer* p, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  const int32_t H = p->layout.num_channels;
  std::vector<float> offset(H), gain(H);
  for (int32_t c = 0; c < H; ++c) {
    offset[c] = u(rng) * 4.0f;
    gain[c] = (c % 17 == 3) ? 100.0f : 1.0f + u(rng);
  }
  for (int64_t t = 0; t < p->layout.num_tokens; ++t)
    for (int32_t c = 0; c < H; ++c) {
      const float v = u(rng);
      const float lap = (v < 0 ? 1.0f : -1.0f) * std::log(1.0f - 2.0f * std::fabs(v) + 1e-7f);
      p->set(t, c, scale * (offset[c] + gain[c] * lap));
    }
}

struct Encoded {
  std::vector<uint8_t> anchor, residual;
  kvxfer_result_t rc = KVXFER_SUCCESS;
};

inline Encoded encode(const kvxfer_codec_config_t& cfg, const PagedBuffer& src, codec::Impl impl,
                      kvxfer_page_id_t id = {3, KVXFER_KV_VALUE, 1000, 42}, int threads = 1) {
  Encoded e;
  size_t amax = 0, rmax = 0;
  e.rc = codec::max_sizes(&cfg, src.layout.num_tokens, src.layout.num_channels, &amax, &rmax);
  if (e.rc != KVXFER_SUCCESS) return e;
  e.anchor.assign(amax, 0xEE);
  e.residual.assign(rmax, 0xEE);
  size_t al = 0, rl = 0;
  e.rc = codec::encode_page(&cfg, &id, &src.layout, e.anchor.data(), amax, &al, e.residual.data(),
                            rmax, &rl, impl, threads);
  e.anchor.resize(al);
  e.residual.resize(rl);
  return e;
}

inline kvxfer_codec_config_t config(kvxfer_codec_t codec, float alpha = 20.0f, int chunk = 32,
                                    int anchor_bits = 4) {
  kvxfer_codec_config_t c = KVXFER_CODEC_CONFIG_INITIALIZER;
  c.codec = codec;
  c.alpha = alpha;
  c.chunk_tokens = chunk;
  c.anchor_bits = codec == KVXFER_CODEC_INT4 ? 4 : anchor_bits;
  return c;
}

inline std::string hex(const std::vector<uint8_t>& v, size_t at) {
  char b[64];
  std::snprintf(b, sizeof(b), "byte %zu = 0x%02x", at, at < v.size() ? v[at] : 0);
  return b;
}

/** Index of the first differing byte, or -1. */
inline long first_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return static_cast<long>(std::min(a.size(), b.size()));
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<long>(i);
  return -1;
}

}  // namespace kvxfer::test
