// What both ranks of kvxfer_perf follow: the KV shape, the sizes of the
// -b/-e/-f sweep, and the codec columns of -m (perf/kvxfer_perf, docs/PERFORMANCE.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "kvxfer/spectrum.h"
#include "perf/common/harness.h"

namespace kvxfer::perf {

/** "<what> failed: <error string> (<code>): <last error text>" */
inline std::string api_error(const std::string& what, kvxfer_result_t r) {
  return strprintf("%s failed: %s (%d): %s", what.c_str(), kvxfer_get_error_string(r),
                   static_cast<int>(r), kvxfer_get_last_error());
}

inline const char* mode_name(kvxfer_mode_t m) {
  return m == KVXFER_MODE_PROGRESSIVE ? "prog" : m == KVXFER_MODE_MONOLITHIC ? "mono" : "auto";
}

/** One column of -m: a codec configuration and how it travels. */
struct CodecCase {
  std::string name;  // as given to -m
  std::string params;
  kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  kvxfer_mode_t mode = KVXFER_MODE_MONOLITHIC;
};

/** The names -m accepts. */
constexpr const char* kCodecChoices = "lynx, lynx-mono, int8, int8-prog, int4, bf16, spectrum";

/** The case of -m name `name`; false for an unknown name. */
inline bool make_case(const std::string& name, int chunk, int anchor_bits, CodecCase* c) {
  c->name = name;
  c->cfg = KVXFER_CODEC_CONFIG_INITIALIZER;  // alpha 0: the library's default
  c->cfg.chunk_tokens = chunk;
  c->cfg.anchor_bits = anchor_bits;
  if (name == "lynx" || name == "lynx-mono") {
    c->cfg.codec = KVXFER_CODEC_LYNX;
    c->mode = name == "lynx" ? KVXFER_MODE_PROGRESSIVE : KVXFER_MODE_MONOLITHIC;
  } else if (name == "int8" || name == "int8-prog") {
    c->cfg.codec = KVXFER_CODEC_INT8;
    c->mode = name == "int8" ? KVXFER_MODE_MONOLITHIC : KVXFER_MODE_PROGRESSIVE;
  } else if (name == "int4") {
    c->cfg.codec = KVXFER_CODEC_INT4;
    c->cfg.anchor_bits = 4;
    c->mode = KVXFER_MODE_MONOLITHIC;
  } else if (name == "bf16") {
    c->cfg.codec = KVXFER_CODEC_BF16;
    c->mode = KVXFER_MODE_MONOLITHIC;
  } else if (name == "spectrum") {  // kvxfer_send's default SpectrumKV policy
    c->cfg.codec = KVXFER_CODEC_SPECTRUM;
    c->mode = KVXFER_MODE_PROGRESSIVE;
  } else {
    return false;
  }
  switch (c->cfg.codec) {
    case KVXFER_CODEC_LYNX:
      c->params = strprintf("a0/c%d/%d+%d", chunk, anchor_bits, 8 - anchor_bits);
      break;
    case KVXFER_CODEC_INT8:
      c->params = strprintf("c%d/%d+%d", chunk, anchor_bits, 8 - anchor_bits);
      break;
    case KVXFER_CODEC_INT4: c->params = strprintf("c%d/4+0", chunk); break;
    case KVXFER_CODEC_SPECTRUM: {
      const kvxfer_spectrum_config_t d = KVXFER_SPECTRUM_CONFIG_INITIALIZER;
      c->params = strprintf("b%.2f/s%d/c%d/%d+%d", d.budget, d.sink_tokens, chunk, anchor_bits,
                            8 - anchor_bits);
      break;
    }
    default: c->params = "-"; break;
  }
  return true;
}

// ---------------------------------------------------------------------------

struct Shape {
  int32_t layers = 32, kv_heads = 8, head_dim = 128;
  kvxfer_dtype_t dtype = KVXFER_DTYPE_BF16;
  int32_t H() const { return kv_heads * head_dim; }
  size_t esize() const { return dtype == KVXFER_DTYPE_FP32 ? 4 : 2; }
  size_t row_bytes() const { return static_cast<size_t>(H()) * esize(); }
  uint64_t bytes_per_token() const {
    return uint64_t{2} * static_cast<uint64_t>(layers) * row_bytes();
  }
};

struct SizePoint {
  uint64_t requested = 0;  // -b/-e/-f value
  int64_t tokens = 0;      // floor(requested / bytes_per_token)
  uint64_t kv_bytes = 0;   // tokens * bytes_per_token: the size of one request's KV
};

struct Plan {
  Shape shape;
  std::vector<SizePoint> sizes;
  std::vector<CodecCase> codecs;
  int iters_total() const { return warmup + iters; }
  int warmup = 1, iters = 3, requests = 1;
  int32_t page_tokens = 256;
  int32_t block = 16;
};

/** The tag of request r of a batch (both ranks use it). */
inline uint64_t request_tag(int r) { return static_cast<uint64_t>(r) + 1; }

}  // namespace kvxfer::perf
