// codec_perf's shared pieces: its options, data sets, paged pools and codec
// cases, used by the CPU tables (codec_perf.cc) and the --gpu case
// (codec_perf_gpu.cc).
#pragma once

#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "codec/format.h"
#include "codec/page.h"
#include "kvxfer/kvxfer.h"
#include "perf/common/harness.h"

namespace codec_perf {

namespace kc = kvxfer::codec;
namespace kp = kvxfer::perf;
using kp::codec_name;  // perf/common/harness.h
using kp::dtype_name;
using kp::split;
using nlohmann::json;

constexpr int kBlockSize = 16;  // tokens per block of the source/destination pools (vLLM default)

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------
struct Options {
  kp::CommonOptions common;
  std::string dtypes = "bf16";
  std::string codecs = "lynx,lynx-auto,int8,int4,bf16";
  std::string datasets = "real,synth";
  int64_t tokens = 4096;  // synthetic page tokens
  int threads = 0;        // multi-threaded row; 0 = KVXFER_CODEC_THREADS, else every usable CPU
  int bits = 1;           // print the bits-per-element table
  std::string model_path = std::string(KVXFER_DATA_DIR) + "/stories260K.bin";
  bool gpu = false;                   // --gpu: the CUDA kernels instead of the CPU codec
  std::string gpu_ref = "reference";  // --gpu_ref: CPU path the GPU bytes are compared with
  // --path: rows of the throughput table (avx2, avx512: where the CPU has them)
  std::string paths = "reference,scalar,avx2,avx512,mt,bound";
};

const char* impl_name(kc::Impl i);
/** Prints a failed kvxfer call with the library's error text; returns false. */
bool report_failure(const std::string& what, kvxfer_result_t r);

// ---------------------------------------------------------------------------
// Datasets: float32 pages, converted to each dtype in a paged pool.
// ---------------------------------------------------------------------------
struct FloatPage {
  kvxfer_page_id_t id;
  std::vector<float> data;  // [T][H]
};

struct Dataset {
  std::string name;
  std::string description;
  int64_t T = 0;
  int32_t H = 0;
  std::vector<FloatPage> pages;
  json info;
};

/**
 * stories260K: greedy generation of T-1 tokens from BOS (token 1), then one
 * prefill over the T tokens (perf/common/kv_data.h); every layer's K (after
 * RoPE) and V is a page.
 */
bool make_real(const Options& o, Dataset* ds);
/** Llama-3-8B-like synthetic KV: layer 0 K and V, T tokens x 8 heads x 128. */
bool make_synth(const Options& o, int64_t T, Dataset* ds, bool k_only = false);

/**
 * A dataset's pages in one dtype, as a runtime would hold them: one pool of
 * kBlockSize-token blocks (row stride = H, so a block is contiguous), blocks
 * handed to pages in a fixed pseudo-random order.
 */
struct Pool {
  int64_t T = 0;
  int32_t H = 0;
  kvxfer_dtype_t dtype = KVXFER_DTYPE_BF16;
  size_t elem = 2;
  size_t block_bytes = 0;
  static constexpr size_t kPage = 4096;
  std::vector<uint8_t> storage;
  uint8_t* base = nullptr;                 // first block, inside storage
  std::vector<std::vector<void*>> blocks;  // per page
  std::vector<kvxfer_page_layout_t> layouts;

  // `page_offset`: where the blocks start within a 4 KiB page.  The
  // destination pool starts 2 KiB further than the source: glibc's memcpy
  // copies blocks of this size with `rep movsb`, which on some CPUs (AMD
  // Zen 3 among them) runs several times slower when source and destination
  // share their offset within a page, and the baseline must be the fast copy.
  Pool(size_t npages, int64_t T_, int32_t H_, kvxfer_dtype_t dt, uint64_t seed,
       size_t page_offset = 0)
      : T(T_), H(H_), dtype(dt), elem(kc::dtype_size(dt)) {
    const int64_t nbp = (T + kBlockSize - 1) / kBlockSize;
    block_bytes = static_cast<size_t>(kBlockSize) * H * elem;
    const size_t total = npages * static_cast<size_t>(nbp);
    storage.assign(total * block_bytes + 2 * kPage, 0);
    const uintptr_t a = reinterpret_cast<uintptr_t>(storage.data());
    base = storage.data() + ((kPage - a % kPage) % kPage) + page_offset % kPage;
    const std::vector<size_t> perm = kp::shuffled_indices(total, seed);
    blocks.resize(npages);
    layouts.resize(npages);
    for (size_t p = 0; p < npages; ++p) {
      for (int64_t b = 0; b < nbp; ++b) blocks[p].push_back(base + perm[p * nbp + b] * block_bytes);
      kvxfer_page_layout_t& l = layouts[p];
      l.blocks = blocks[p].data();
      l.num_blocks = nbp;
      l.block_size = kBlockSize;
      l.row_stride = H;
      l.first_token = 0;
      l.num_tokens = T;
      l.num_channels = H;
      l.dtype = dt;
    }
  }
  size_t page_bytes() const { return static_cast<size_t>(T) * H * elem; }
  uint8_t* row(size_t p, int64_t t) const {
    return static_cast<uint8_t*>(blocks[p][t / kBlockSize]) + (t % kBlockSize) * H * elem;
  }
  void fill(size_t p, const std::vector<float>& v) {
    for (int64_t t = 0; t < T; ++t)
      for (int32_t c = 0; c < H; ++c) kc::store_elem(row(p, t), c, dtype, v[t * H + c]);
  }
  std::vector<uint8_t> gather(size_t p) const {
    std::vector<uint8_t> out(page_bytes());
    for (int64_t t = 0; t < T; ++t) std::memcpy(&out[t * H * elem], row(p, t), H * elem);
    return out;
  }
  void poison() { std::memset(storage.data(), 0xA5, storage.size()); }
};

struct CodecCase {
  std::string name;
  std::string params;
  kvxfer_codec_config_t cfg;
};

CodecCase make_case(kvxfer_codec_t codec, float alpha, int chunk, int anchor_bits);

/** Bytes that differ, plus the difference in length. */
uint64_t count_wrong(const uint8_t* a, size_t na, const uint8_t* b, size_t nb);

std::string fmt2(double v);
std::string fmt4(double v);

// ---------------------------------------------------------------------------
// --gpu (codec_perf_gpu.cc)
// ---------------------------------------------------------------------------
constexpr int64_t kGpuTokens = 32768;  // one layer's K of a 32K-token Llama-3-8B context
constexpr int64_t kGpuQuickTokens = 4096;
constexpr int kGpuWarmup = 5, kGpuIters = 20;  // defaults of -w / -n with --gpu

/**
 * codec_perf --gpu.  Returns the exit status: 0 (or a skip), 1 wrong bytes,
 * 2 a failed call.
 */
int run_gpu(const Options& o, const std::vector<kvxfer_dtype_t>& dtypes,
            const std::vector<CodecCase>& cases);

}  // namespace codec_perf
