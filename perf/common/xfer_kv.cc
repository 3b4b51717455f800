// kvxfer_perf's KV: data sources, the paged cache, the expected decode.
#include "perf/common/xfer_kv.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>

#include "codec/codec_math.h"
#include "models/synthetic_kv.h"

namespace kvxfer::perf {

// The exact conversions of the codec (src/codec/codec_math.h).
using kvxfer::codec::f32_to_bf16;
using kvxfer::codec::f32_to_f16;

void store_row(const float* src, int32_t H, kvxfer_dtype_t dt, uint8_t* dst) {
  switch (dt) {
    case KVXFER_DTYPE_BF16:
      for (int32_t c = 0; c < H; ++c) {
        const uint16_t v = f32_to_bf16(src[c]);
        std::memcpy(dst + 2 * c, &v, 2);
      }
      break;
    case KVXFER_DTYPE_FP16:
      for (int32_t c = 0; c < H; ++c) {
        const uint16_t v = f32_to_f16(src[c]);
        std::memcpy(dst + 2 * c, &v, 2);
      }
      break;
    default: std::memcpy(dst, src, static_cast<size_t>(H) * 4); break;
  }
}

SyntheticSource::SyntheticSource(const Shape& s) : spec_(llama3_8b_like_spec(s.layers)) {
  spec_.n_kv_heads = s.kv_heads;
  spec_.head_dim = s.head_dim;
}

bool SyntheticSource::fill(int r, int32_t layer, int kind, int64_t T, float* out,
                           std::string* err) const {
  model::SyntheticKVSpec s = spec_;
  s.seed = spec_.seed + static_cast<uint64_t>(r);
  return model::fill_synthetic_kv(s, layer, kind == 0 ? model::KVKind::kKey : model::KVKind::kValue,
                                  0, T, out, 0, err);
}

bool StoriesSource::fill(int r, int32_t layer, int kind, int64_t T, float* out,
                         std::string* err) const {
  (void)err;
  const std::vector<float>& src = (kind == 0 ? kv_.k : kv_.v)[static_cast<size_t>(layer)];
  const int64_t T_real = kv_.tokens, H = kv_.channels();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t u = (t + 97 * int64_t{r}) % T_real;
    std::memcpy(out + t * H, src.data() + u * H, static_cast<size_t>(H) * sizeof(float));
  }
  return true;
}

bool read_model_shape(const std::string& path, Shape* s, int* seq_len, std::string* err) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    *err = "cannot open " + path + ": " + std::strerror(errno);
    return false;
  }
  int32_t h[7];
  const size_t n = std::fread(h, sizeof(int32_t), 7, f);
  std::fclose(f);
  if (n != 7 || h[0] <= 0 || h[2] <= 0 || h[3] <= 0 || h[4] <= 0 || h[0] % h[3] != 0 || h[6] <= 0) {
    *err = path + " is not a llama2.c checkpoint";
    return false;
  }
  s->layers = h[2];
  s->kv_heads = h[4];
  s->head_dim = h[0] / h[3];
  *seq_len = h[6];
  return true;
}

PagedKV::PagedKV(const Shape& s, int64_t T, int32_t block, uint64_t seed) : block_(block) {
  nblocks_ = std::max<int64_t>(1, (T + block - 1) / block);
  row_bytes_ = s.row_bytes();
  const size_t block_bytes = static_cast<size_t>(block) * row_bytes_;
  const size_t total = static_cast<size_t>(2 * s.layers * nblocks_);
  bytes_ = total * block_bytes;
  mem_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes_ + 63) / 64 * 64)));
  if (!mem_) throw std::bad_alloc();
  const std::vector<size_t> slot = shuffled_indices(total, seed);
  const size_t per = static_cast<size_t>(s.layers * nblocks_);
  k_.resize(per);
  v_.resize(per);
  for (size_t i = 0; i < per; ++i) {
    k_[i] = mem_.get() + slot[i] * block_bytes;
    v_[i] = mem_.get() + slot[per + i] * block_bytes;
  }
  desc_ = KVXFER_KV_DESC_INITIALIZER;
  desc_.num_layers = s.layers;
  desc_.kv_heads = s.kv_heads;
  desc_.head_dim = s.head_dim;
  desc_.dtype = s.dtype;
  desc_.num_tokens = T;
  desc_.block_size = block;
  desc_.row_stride = s.H();
  desc_.num_blocks = nblocks_;
  desc_.k_blocks = k_.data();
  desc_.v_blocks = v_.data();
}

void PagedKV::fill_bytes(uint8_t v) { std::memset(mem_.get(), v, bytes_); }

/** Generates request r's KV and hands each (layer, kind) row to `put`. */
bool generate(const DataSource& src, const Shape& s, int64_t T, int r,
              const std::function<void(int32_t, int, int64_t, const float*)>& put,
              std::string* err) {
  std::vector<float> buf(static_cast<size_t>(T) * static_cast<size_t>(s.H()));
  for (int32_t l = 0; l < s.layers; ++l)
    for (int kind = 0; kind < 2; ++kind) {
      if (!src.fill(r, l, kind, T, buf.data(), err)) return false;
      for (int64_t t = 0; t < T; ++t) put(l, kind, t, buf.data() + t * s.H());
    }
  return true;
}

/**
 * The receiver's blocks must equal, byte for byte, the codec's own
 * kvxfer_page_encode + kvxfer_page_decode of the same pages: page ids
 * {layer, kind, token_begin, stream_id = tag}, pages of page_tokens tokens.
 */
bool expected_decode(const CodecCase& cc, const Shape& s, int64_t T, int32_t page_tokens,
                     uint64_t tag, Image& src, Image* out, std::string* err) {
  const int64_t pmax = std::min<int64_t>(page_tokens, T);
  size_t acap = 0, rcap = 0;
  kvxfer_result_t rc = kvxfer_page_max_size(&cc.cfg, pmax, s.H(), &acap, &rcap);
  if (rc < 0) {
    *err = api_error("kvxfer_page_max_size", rc);
    return false;
  }
  std::vector<uint8_t> a(acap), res(rcap);
  // SPECTRUM: the tiers kvxfer_send's default policy chooses, from the KV
  // norm over every layer's K and V in the sender's order (layer, K, V).
  std::vector<uint8_t> tiers;
  if (cc.cfg.codec == KVXFER_CODEC_SPECTRUM) {
    std::vector<void*> planes;
    for (int32_t l = 0; l < s.layers; ++l)
      for (int kind = 0; kind < 2; ++kind) planes.push_back(src.plane(l, kind));
    std::vector<kvxfer_page_layout_t> pages;
    for (void*& pl : planes)
      pages.push_back({&pl, 1, static_cast<int32_t>(T), s.H(), 0, T, s.H(), s.dtype});
    const kvxfer_spectrum_config_t policy = KVXFER_SPECTRUM_CONFIG_INITIALIZER;
    std::vector<float> imp(static_cast<size_t>(T));
    tiers.resize(static_cast<size_t>(T));
    rc = kvxfer_spectrum_importance_from_kv(pages.data(), static_cast<int32_t>(pages.size()),
                                            policy.lambda, imp.data());
    if (rc == KVXFER_SUCCESS) rc = kvxfer_spectrum_assign(&policy, T, imp.data(), tiers.data());
    if (rc < 0) {
      *err = api_error("SpectrumKV policy (expected decode)", rc);
      return false;
    }
  }
  for (int32_t l = 0; l < s.layers; ++l)
    for (int kind = 0; kind < 2; ++kind) {
      void* sb = src.plane(l, kind);
      void* db = out->plane(l, kind);
      for (int64_t t0 = 0; t0 < T; t0 += page_tokens) {
        const int64_t n = std::min<int64_t>(page_tokens, T - t0);
        kvxfer_page_id_t id{static_cast<uint32_t>(l), kind == 0 ? KVXFER_KV_KEY : KVXFER_KV_VALUE,
                            t0, tag};
        kvxfer_page_layout_t lay{&sb, 1, static_cast<int32_t>(T), s.H(), t0, n, s.H(), s.dtype};
        size_t alen = 0, rlen = 0;
        rc = tiers.empty()
                 ? kvxfer_page_encode(&cc.cfg, &id, &lay, a.data(), acap, &alen, res.data(), rcap,
                                      &rlen)
                 : kvxfer_page_encode_tiered(&cc.cfg, &id, &lay, tiers.data() + t0, a.data(), acap,
                                             &alen, res.data(), rcap, &rlen);
        if (rc < 0) {
          *err = api_error("kvxfer_page_encode (expected decode)", rc);
          return false;
        }
        lay.blocks = &db;
        rc = kvxfer_page_decode(a.data(), alen, res.data(), rlen, &id, &lay);
        if (rc < 0) {
          *err = api_error("kvxfer_page_decode (expected decode)", rc);
          return false;
        }
      }
    }
  return true;
}

/** Bytes of the receiver's blocks that differ from the expected image. */
uint64_t count_wrong(PagedKV& dst, Image& want) {
  uint64_t wrong = 0;
  const size_t rb = want.s.row_bytes();
  for (int32_t l = 0; l < want.s.layers; ++l)
    for (int kind = 0; kind < 2; ++kind) {
      const uint8_t* w = want.plane(l, kind);
      for (int64_t t = 0; t < want.T; ++t) {
        const uint8_t* g = dst.row(l, kind, t);
        const uint8_t* e = w + static_cast<size_t>(t) * rb;
        if (std::memcmp(g, e, rb) == 0) continue;
        for (size_t i = 0; i < rb; ++i) wrong += g[i] != e[i];
      }
    }
  return wrong;
}

}  // namespace kvxfer::perf
