// The KV that kvxfer_perf moves: its data sources (synthetic Llama-3-8B-like
// or stories260K's greedy prefill), the paged cache a serving runtime holds,
// the contiguous image a receiver checks against, and the expected decode.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "perf/common/kv_data.h"
#include "perf/common/xfer_plan.h"

namespace kvxfer::perf {

/** One row of H float values, converted to dt with the codec's own rounding. */
void store_row(const float* src, int32_t H, kvxfer_dtype_t dt, uint8_t* dst);

class DataSource {
 public:
  virtual ~DataSource() = default;
  /** Values of request r, layer l, kind (0 K, 1 V), tokens [0, T): float [T][H]. */
  virtual bool fill(int r, int32_t layer, int kind, int64_t T, float* out,
                    std::string* err) const = 0;
};

/** Llama-3-8B-like synthetic KV (models/synthetic_kv.h); request r has seed 1 + r. */
class SyntheticSource : public DataSource {
 public:
  explicit SyntheticSource(const Shape& s);
  const model::SyntheticKVSpec& spec() const { return spec_; }
  bool fill(int r, int32_t layer, int kind, int64_t T, float* out, std::string* err) const override;

 private:
  model::SyntheticKVSpec spec_;
};

/**
 * KV of the stories260K checkpoint: BOS, 511 greedy tokens, one prefill (as
 * perf/codec_perf's "real" dataset).  Token t of request r is the model's
 * token (t + 97 r) mod 512, so longer KV tiles the real one.
 */
class StoriesSource : public DataSource {
 public:
  bool load(const std::string& path, std::string* err) {
    return greedy_prefill_kv(path, &kv_, err);
  }
  bool fill(int r, int32_t layer, int kind, int64_t T, float* out, std::string* err) const override;

 private:
  GreedyPrefillKV kv_;  // perf/common/kv_data.h
};

/** Reads only the llama2.c header (7 int32) of the checkpoint: the KV shape. */
bool read_model_shape(const std::string& path, Shape* s, int* seq_len, std::string* err);

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

/**
 * A KV cache as a serving runtime holds it: one allocation of `block`-token
 * blocks of H contiguous elements per row, handed out to (layer, K/V, block
 * index) in a fixed pseudo-random order (a splitmix64 Fisher-Yates shuffle),
 * as codec_perf lays out its pools.
 */
class PagedKV {
 public:
  PagedKV(const Shape& s, int64_t T, int32_t block, uint64_t seed);
  uint8_t* row(int32_t layer, int kind, int64_t t) {
    const std::vector<void*>& b = kind == 0 ? k_ : v_;
    return static_cast<uint8_t*>(b[static_cast<size_t>(layer * nblocks_ + t / block_)]) +
           static_cast<size_t>(t % block_) * row_bytes_;
  }
  void fill_bytes(uint8_t v);
  const kvxfer_kv_desc_t* desc() const { return &desc_; }

 private:
  int32_t block_;
  int64_t nblocks_ = 0;
  size_t row_bytes_ = 0, bytes_ = 0;
  std::unique_ptr<uint8_t, FreeDeleter> mem_;
  std::vector<void*> k_, v_;
  kvxfer_kv_desc_t desc_;
};

/**
 * One request's KV as a contiguous image, [layer][K,V][token][H] in the
 * dtype: the receiver's copy of what the sender sends, and the expected
 * decode it is compared with.
 */
struct Image {
  Shape s;
  int64_t T = 0;
  std::vector<uint8_t> bytes;
  Image(const Shape& shape, int64_t tokens)
      : s(shape), T(tokens), bytes(static_cast<size_t>(tokens) * shape.bytes_per_token()) {}
  uint8_t* plane(int32_t layer, int kind) {
    return bytes.data() + (static_cast<size_t>(layer) * 2 + static_cast<size_t>(kind)) *
                              static_cast<size_t>(T) * s.row_bytes();
  }
};

/** Generates request r's KV and hands each (layer, kind) row to `put`. */
bool generate(const DataSource& src, const Shape& s, int64_t T, int r,
              const std::function<void(int32_t, int, int64_t, const float*)>& put,
              std::string* err);

/**
 * The receiver's blocks must equal, byte for byte, the codec's own
 * kvxfer_page_encode + kvxfer_page_decode of the same pages: page ids
 * {layer, kind, token_begin, stream_id = tag}, pages of page_tokens tokens.
 */
bool expected_decode(const CodecCase& cc, const Shape& s, int64_t T, int32_t page_tokens,
                     uint64_t tag, Image& src, Image* out, std::string* err);

/** Bytes of the receiver's blocks that differ from the expected image. */
uint64_t count_wrong(PagedKV& dst, Image& want);

}  // namespace kvxfer::perf
