// codec_perf: throughput and wire size of the CPU page codec, in the
// nccl-tests dialect.  Every column and formula is defined in
// docs/PERFORMANCE.md; run with no arguments for the default report.
//
// Table 1 (throughput): for each dataset x dtype x codec x path, the median
// time of encoding / decoding every page of the dataset once, as GB/s of input
// KV and as a ratio to memcpy of the same bytes between the same buffers.
// With -c 1 each fast path's sections and decoded pages are compared byte for
// byte with the reference path's (#wrong).
//
// Table 2 (bits per element): anchor / residual / total / metadata bits per
// element of every codec parameter set, from the actual encoded section sizes.
#include "codec/codec.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "codec/codebook.h"
#include "codec/format.h"
#include "codec/page.h"
#include "common/error.h"
#include "common/params.h"
#include "kvxfer/kvxfer.h"
#include "models/synthetic_kv.h"
#include "perf/common/codec_bound.h"
#include "perf/common/harness.h"
#include "perf/common/kv_data.h"
#ifdef KVXFER_CODEC_PERF_GPU
#include "cuda/cuda_check.h"
#include "cuda/device_codec.h"
#endif

namespace {

namespace kc = kvxfer::codec;
namespace km = kvxfer::model;
namespace kp = kvxfer::perf;
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

using kp::split;  // perf/common/harness.h

using kp::codec_name;  // perf/common/harness.h
using kp::dtype_name;
const char* impl_name(kc::Impl i) {
  switch (i) {
    case kc::Impl::REFERENCE: return "reference";
    case kc::Impl::SCALAR: return "scalar";
    case kc::Impl::AVX2: return "avx2";
    case kc::Impl::AVX512: return "avx512";
    default: return "auto";
  }
}

/** The 1, 5 and 15 minute load averages of /proc/loadavg, or "n/a". */
std::string load_average() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return "n/a";
  double a = 0, b = 0, c = 0;
  const int n = std::fscanf(f, "%lf %lf %lf", &a, &b, &c);
  std::fclose(f);
  return n == 3 ? kp::strprintf("%.2f %.2f %.2f", a, b, c) : "n/a";
}

/** Prints a failed kvxfer call with the library's error text; returns false. */
bool report_failure(const std::string& what, kvxfer_result_t r) {
  std::fprintf(stderr, "codec_perf: %s failed: %s (%d): %s\n", what.c_str(),
               kvxfer_get_error_string(r), static_cast<int>(r), kvxfer::last_error());
  return false;
}

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
bool make_real(const Options& o, Dataset* ds) {
  std::string err;
  kp::GreedyPrefillKV kv;
  if (!kp::greedy_prefill_kv(o.model_path, &kv, &err)) {
    std::fprintf(stderr, "codec_perf: cannot build the stories260K KV from %s: %s\n",
                 o.model_path.c_str(), err.c_str());
    return false;
  }
  const int T = kv.tokens;
  ds->name = "real";
  ds->T = T;
  ds->H = kv.channels();
  for (int l = 0; l < kv.layers; ++l)
    for (int kind = 0; kind < 2; ++kind) {
      FloatPage p;
      p.id = kvxfer_page_id_t{static_cast<uint32_t>(l), static_cast<kvxfer_kv_kind_t>(kind), 0, 0};
      p.data = std::move(kind == 0 ? kv.k[static_cast<size_t>(l)] : kv.v[static_cast<size_t>(l)]);
      ds->pages.push_back(std::move(p));
    }
  std::string first;
  for (int i = 0; i < 12 && i < T; ++i) first += (i ? " " : "") + std::to_string(kv.ids[i]);
  ds->description = kp::strprintf(
      "stories260K prefill of %d tokens greedy-generated from BOS (ids %s ...), "
      "%d layers x K,V = %zu pages of %d tokens x %d channels (%d KV heads x %d head_dim)",
      T, first.c_str(), kv.layers, ds->pages.size(), T, ds->H, kv.kv_heads, kv.head_dim);
  ds->info = {{"source", "stories260K.bin"},
              {"model_path", o.model_path},
              {"tokens", "greedy from BOS (1), then prefill"},
              {"first_ids", first},
              {"n_layers", kv.layers},
              {"n_kv_heads", kv.kv_heads},
              {"head_dim", kv.head_dim}};
  return true;
}

/** Llama-3-8B-like synthetic KV: layer 0 K and V, T tokens x 8 heads x 128. */
bool make_synth(const Options& o, int64_t T, Dataset* ds, bool k_only = false) {
  const km::SyntheticKVSpec spec = kp::llama3_8b_like_spec(32);  // only layer 0 is used
  ds->name = "synth";
  ds->T = T;
  ds->H = spec.row_channels();
  std::string err;
  for (int kind = 0; kind < (k_only ? 1 : 2); ++kind) {
    FloatPage p;
    p.id = kvxfer_page_id_t{0, static_cast<kvxfer_kv_kind_t>(kind), 0, 0};
    p.data.resize(static_cast<size_t>(T) * ds->H);
    if (!km::fill_synthetic_kv(spec, 0, kind == 0 ? km::KVKind::kKey : km::KVKind::kValue, 0, T,
                               p.data.data(), 0, &err)) {
      std::fprintf(stderr, "codec_perf: synthetic KV failed: %s\n", err.c_str());
      return false;
    }
    ds->pages.push_back(std::move(p));
  }
  (void)o;
  ds->description =
      kp::strprintf("synthetic Llama-3-8B-like KV (models/synthetic_kv.h, seed %" PRIu64
                    ", rope_theta 500000, %d outlier key pairs at %gx), layer 0 %s of %" PRId64
                    " tokens x %d channels (8 KV heads x 128 head_dim)",
                    spec.seed, spec.key_outlier_pairs, static_cast<double>(spec.key_outlier_ratio),
                    k_only ? "K = 1 page" : "K,V = 2 pages", T, ds->H);
  ds->info = {{"source", "models/synthetic_kv.h"},
              {"seed", spec.seed},
              {"rope_theta", 500000.0},
              {"layer", 0},
              {"n_kv_heads", 8},
              {"head_dim", 128},
              {"key_outlier_pairs", spec.key_outlier_pairs},
              {"key_outlier_ratio", spec.key_outlier_ratio}};
  return true;
}

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
    std::vector<size_t> perm(total);
    for (size_t i = 0; i < total; ++i) perm[i] = i;
    uint64_t s = seed;
    for (size_t i = total; i > 1; --i) {  // Fisher-Yates with splitmix64
      uint64_t z = (s += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      std::swap(perm[i - 1], perm[z % i]);
    }
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

// ---------------------------------------------------------------------------
// One codec / path measurement.
// ---------------------------------------------------------------------------
struct CodecCase {
  std::string name;
  std::string params;
  kvxfer_codec_config_t cfg;
};

CodecCase make_case(kvxfer_codec_t codec, float alpha, int chunk, int anchor_bits) {
  CodecCase c{codec_name(codec), "", KVXFER_CODEC_CONFIG_INITIALIZER};
  c.cfg.codec = codec;
  c.cfg.alpha = alpha;
  c.cfg.chunk_tokens = chunk;
  c.cfg.anchor_bits = codec == KVXFER_CODEC_INT4 ? 4 : anchor_bits;
  switch (codec) {
    case KVXFER_CODEC_LYNX:
      c.params = alpha == KVXFER_ALPHA_AUTO
                     ? kp::strprintf("auto/c%d/%d+%d", chunk, anchor_bits, 8 - anchor_bits)
                     : kp::strprintf("a%g/c%d/%d+%d", static_cast<double>(alpha), chunk,
                                     anchor_bits, 8 - anchor_bits);
      break;
    case KVXFER_CODEC_INT8:
      c.params = kp::strprintf("c%d/%d+%d", chunk, anchor_bits, 8 - anchor_bits);
      break;
    case KVXFER_CODEC_INT4: c.params = kp::strprintf("c%d/4+0", chunk); break;
    default: c.params = "-";
  }
  return c;
}

struct Path {
  std::string name;
  kc::Impl impl;
  int threads;
  bool reference;
  bool bound = false;  // the bound row (perf/common/codec_bound.h), not a codec path
};

struct Encodings {
  std::vector<std::vector<uint8_t>> anc, res;
  std::vector<size_t> al, rl;
  size_t anchor_total() const {
    size_t s = 0;
    for (size_t x : al) s += x;
    return s;
  }
  size_t residual_total() const {
    size_t s = 0;
    for (size_t x : rl) s += x;
    return s;
  }
};

struct Expected {
  Encodings enc;
  std::vector<std::vector<uint8_t>> full, anchor;  // decoded pages, page order
};

uint64_t count_wrong(const uint8_t* a, size_t na, const uint8_t* b, size_t nb) {
  uint64_t w = na > nb ? na - nb : nb - na;
  for (size_t i = 0, n = std::min(na, nb); i < n; ++i) w += a[i] != b[i];
  return w;
}

struct RowResult {
  kp::Stats enc, dec_full, dec_anchor;
  kp::Stats mc_enc, mc_full, mc_anchor;  // memcpy timed just before each call of the op
  int64_t wrong = -1;                    // -1: not checked
  size_t anchor_bytes = 0, residual_bytes = 0;
};

bool alloc_encodings(const kvxfer_codec_config_t& cfg, const Dataset& ds, Encodings* e) {
  size_t amax = 0, rmax = 0;
  kvxfer_result_t r = kc::max_sizes(&cfg, ds.T, ds.H, &amax, &rmax);
  if (r < 0) return report_failure("max_sizes", r);
  const size_t n = ds.pages.size();
  e->anc.assign(n, std::vector<uint8_t>(amax));
  e->res.assign(n, std::vector<uint8_t>(rmax));
  e->al.assign(n, 0);
  e->rl.assign(n, 0);
  return true;
}

/**
 * "# of bound" lines under a codec case: each path's op / memcpy divided by
 * the bound row's (the last entry), i.e. its time over the bound's.
 */
void print_of_bound(const std::vector<std::pair<std::string, std::array<double, 3>>>& r) {
  const std::array<double, 3>& b = r.back().second;
  for (size_t i = 0; i + 1 < r.size(); ++i) {
    const std::array<double, 3>& x = r[i].second;
    std::printf("#   of bound (%s): enc %.3f  dec_full %.3f  dec_anchor %.3f\n", r[i].first.c_str(),
                b[0] > 0 ? x[0] / b[0] : 0, b[1] > 0 ? x[1] / b[1] : 0, b[2] > 0 ? x[2] / b[2] : 0);
  }
}

/** Blocks of page p of a pool, each with the bytes of its rows. */
std::vector<kp::Span> page_spans(const Pool& pool, size_t p) {
  std::vector<kp::Span> out;
  for (size_t b = 0; b < pool.blocks[p].size(); ++b) {
    const int64_t rows =
        std::min<int64_t>(kBlockSize, pool.T - static_cast<int64_t>(b) * kBlockSize);
    out.push_back(
        {static_cast<uint8_t*>(pool.blocks[p][b]), static_cast<size_t>(rows) * pool.H * pool.elem});
  }
  return out;
}

/**
 * The bound row: the least memory traffic of encode, full decode and anchor
 * decode of every page (perf/common/codec_bound.h), on the sections of one
 * untimed encode, each timed beside memcpy as the codec paths are.
 */
bool run_bound(const Options& o, const Dataset& ds, const CodecCase& cc, Pool* src, Pool* dst,
               const std::function<bool()>& memcpy_once, Encodings* e, RowResult* out) {
  const size_t np = ds.pages.size();
  for (size_t p = 0; p < np; ++p) {
    const kvxfer_result_t r = kc::encode_page(
        &cc.cfg, &ds.pages[p].id, &src->layouts[p], e->anc[p].data(), e->anc[p].size(), &e->al[p],
        e->res[p].data(), e->res[p].size(), &e->rl[p], kc::Impl::AUTO, 1);
    if (r < 0) return report_failure("encode (" + cc.name + " bound)", r);
  }
  out->anchor_bytes = e->anchor_total();
  out->residual_bytes = e->residual_total();
  uint64_t sink = 0;
  auto sections = [&](size_t p, bool full) {
    std::vector<kp::Span> s{{e->anc[p].data(), e->al[p]}};
    if (full && e->rl[p] > 0) s.push_back({e->res[p].data(), e->rl[p]});
    return s;
  };
  auto encode_all = [&] {
    for (size_t p = 0; p < np; ++p)
      sink ^= kp::bound_encode(page_spans(*src, p), sections(p, true));
    return true;
  };
  auto decode_all = [&](bool full) {
    for (size_t p = 0; p < np; ++p) {
      const std::vector<kp::Span> in = sections(p, full);
      size_t in_bytes = 0;
      for (const kp::Span& s : in) in_bytes += s.n;
      // Section bytes per 64 written: 64 where they are about the page
      // (BF16), 32 for about half (8-bit codes), else 16 (4-bit).
      const size_t page = src->page_bytes();
      const int per = 4 * in_bytes >= 3 * page ? 64 : 8 * in_bytes >= 3 * page ? 32 : 16;
      sink ^= kp::bound_decode(in, page_spans(*dst, p), per);
    }
    return true;
  };
  const int w = o.common.warmup, n = o.common.iters;
  const bool ok =
      kp::time_paired(w, n, memcpy_once, encode_all, &out->mc_enc, &out->enc) &&
      kp::time_paired(
          w, n, memcpy_once, [&] { return decode_all(true); }, &out->mc_full, &out->dec_full) &&
      kp::time_paired(
          w, n, memcpy_once, [&] { return decode_all(false); }, &out->mc_anchor, &out->dec_anchor);
  if (sink == 1) std::printf("#\n");  // keeps the work observable
  return ok;
}

/** Times encode, full decode and anchor-only decode of every page on one path. */
bool run_path(const Options& o, const Dataset& ds, const CodecCase& cc, const Path& path, Pool* src,
              Pool* dst, const std::function<bool()>& memcpy_once, Expected* expected,
              RowResult* out) {
  Encodings e;
  if (!alloc_encodings(cc.cfg, ds, &e)) return false;
  const size_t np = ds.pages.size();
  const std::string what = cc.name + " " + cc.params + " " + path.name;
  if (path.bound) return run_bound(o, ds, cc, src, dst, memcpy_once, &e, out);
  auto encode_all = [&]() {
    for (size_t p = 0; p < np; ++p) {
      kvxfer_result_t r = kc::encode_page(
          &cc.cfg, &ds.pages[p].id, &src->layouts[p], e.anc[p].data(), e.anc[p].size(), &e.al[p],
          e.res[p].data(), e.res[p].size(), &e.rl[p], path.impl, path.threads);
      if (r < 0) return report_failure("encode (" + what + ")", r);
    }
    return true;
  };
  auto decode_all = [&](bool full) {
    for (size_t p = 0; p < np; ++p) {
      kvxfer_result_t r = kc::decode_page(
          e.anc[p].data(), e.al[p], full ? e.res[p].data() : nullptr, full ? e.rl[p] : 0,
          &ds.pages[p].id, &dst->layouts[p], path.impl, path.threads);
      if (r < 0)
        return report_failure(std::string(full ? "full" : "anchor") + " decode (" + what + ")", r);
    }
    return true;
  };
  const int w = o.common.warmup, n = o.common.iters;
  const bool check = o.common.check != 0;
  if (!kp::time_paired(w, n, memcpy_once, encode_all, &out->mc_enc, &out->enc)) return false;
  out->anchor_bytes = e.anchor_total();
  out->residual_bytes = e.residual_total();

  std::vector<std::vector<uint8_t>> full, anchor;
  dst->poison();
  if (!kp::time_paired(
          w, n, memcpy_once, [&] { return decode_all(true); }, &out->mc_full, &out->dec_full))
    return false;
  if (check)
    for (size_t p = 0; p < np; ++p) full.push_back(dst->gather(p));
  dst->poison();
  if (!kp::time_paired(
          w, n, memcpy_once, [&] { return decode_all(false); }, &out->mc_anchor, &out->dec_anchor))
    return false;
  if (check)
    for (size_t p = 0; p < np; ++p) anchor.push_back(dst->gather(p));

  if (!check) return true;
  if (!path.reference && expected->enc.anc.empty()) return true;  // no reference row: N/A
  if (path.reference) {
    expected->enc = std::move(e);
    expected->full = std::move(full);
    expected->anchor = std::move(anchor);
    return true;
  }
  uint64_t wrong = 0;
  for (size_t p = 0; p < np; ++p) {
    wrong +=
        count_wrong(e.anc[p].data(), e.al[p], expected->enc.anc[p].data(), expected->enc.al[p]);
    wrong +=
        count_wrong(e.res[p].data(), e.rl[p], expected->enc.res[p].data(), expected->enc.rl[p]);
    wrong += count_wrong(full[p].data(), full[p].size(), expected->full[p].data(),
                         expected->full[p].size());
    wrong += count_wrong(anchor[p].data(), anchor[p].size(), expected->anchor[p].data(),
                         expected->anchor[p].size());
  }
  out->wrong = static_cast<int64_t>(wrong);
  return true;
}

/** One memcpy of every page's blocks into the destination pool: the baseline of every ratio. */
bool memcpy_pages(const Pool& src, Pool* dst) {
  const size_t np = src.layouts.size();
  const int64_t nbp = src.layouts.empty() ? 0 : src.layouts[0].num_blocks;
  for (size_t p = 0; p < np; ++p)
    for (int64_t b = 0; b < nbp; ++b) {
      const int64_t rows = std::min<int64_t>(kBlockSize, src.T - b * kBlockSize);
      std::memcpy(dst->blocks[p][b], src.blocks[p][b],
                  static_cast<size_t>(rows) * src.H * src.elem);
    }
  return true;
}

// ---------------------------------------------------------------------------
// Bits per element.
// ---------------------------------------------------------------------------
struct BitsRow {
  std::string codec, alpha, chunk, split;
  double anchor = 0, residual = 0, total = 0, meta = 0;
  int code_bits = 0;
  size_t anchor_bytes = 0, residual_bytes = 0;
  int meta_fp32_pages = 0;
};

/** Encodes every page with cfg; sums the section sizes. */
bool measure_sizes(const kvxfer_codec_config_t& cfg, const Dataset& ds, const Pool& src,
                   size_t* abytes, size_t* rbytes, int* meta_fp32) {
  Encodings e;
  if (!alloc_encodings(cfg, ds, &e)) return false;
  *abytes = *rbytes = 0;
  *meta_fp32 = 0;
  for (size_t p = 0; p < ds.pages.size(); ++p) {
    kvxfer_result_t r =
        kc::encode_page(&cfg, &ds.pages[p].id, &src.layouts[p], e.anc[p].data(), e.anc[p].size(),
                        &e.al[p], e.res[p].data(), e.res[p].size(), &e.rl[p], kc::Impl::AUTO, 0);
    if (r < 0) return report_failure("encode (bits table)", r);
    kvxfer_page_info_t info;
    r = kc::inspect_section(e.anc[p].data(), e.al[p], &info);
    if (r < 0) return report_failure("inspect (bits table)", r);
    *meta_fp32 += info.meta_fp32;
    *abytes += e.al[p];
    *rbytes += e.rl[p];
  }
  return true;
}

bool bits_table(const Dataset& ds, const Pool& src, std::vector<BitsRow>* rows) {
  const double elems = static_cast<double>(ds.T) * ds.H * static_cast<double>(ds.pages.size());
  auto finish = [&](BitsRow r, size_t a, size_t res, int fp32) {
    r.anchor_bytes = a;
    r.residual_bytes = res;
    r.meta_fp32_pages = fp32;
    r.anchor = 8.0 * static_cast<double>(a) / elems;
    r.residual = 8.0 * static_cast<double>(res) / elems;
    r.total = r.anchor + r.residual;
    r.meta = r.total - r.code_bits;
    rows->push_back(r);
  };
  const int chunks[] = {16, 32, 64, 128};
  const float alphas[] = {0.0f, 5.0f, 20.0f, 100.0f, 255.0f};
  for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8})
    for (int C : chunks)
      for (int A = 2; A <= 6; ++A) {
        BitsRow base{codec_name(codec), "-", std::to_string(C), kp::strprintf("%d+%d", A, 8 - A)};
        base.code_bits = 8;
        if (codec == KVXFER_CODEC_INT8) {
          size_t a, r;
          int f;
          if (!measure_sizes(make_case(codec, 0, C, A).cfg, ds, src, &a, &r, &f)) return false;
          finish(base, a, r, f);
          continue;
        }
        // Alpha changes codes, not sizes: one row "*" when all alphas agree.
        std::vector<size_t> as, rs;
        std::vector<int> fs;
        for (float al : alphas) {
          size_t a, r;
          int f;
          if (!measure_sizes(make_case(codec, al, C, A).cfg, ds, src, &a, &r, &f)) return false;
          as.push_back(a);
          rs.push_back(r);
          fs.push_back(f);
        }
        bool same = true;
        for (size_t i = 1; i < as.size(); ++i) same &= as[i] == as[0] && rs[i] == rs[0];
        if (same) {
          base.alpha = "*";
          finish(base, as[0], rs[0], fs[0]);
        } else {
          for (size_t i = 0; i < as.size(); ++i) {
            BitsRow b = base;
            b.alpha = kp::strprintf("%g", static_cast<double>(alphas[i]));
            finish(b, as[i], rs[i], fs[i]);
          }
        }
      }
  for (int C : chunks) {
    BitsRow base{"int4", "-", std::to_string(C), "4+0"};
    base.code_bits = 4;
    size_t a, r;
    int f;
    if (!measure_sizes(make_case(KVXFER_CODEC_INT4, 0, C, 4).cfg, ds, src, &a, &r, &f))
      return false;
    finish(base, a, r, f);
  }
  {
    BitsRow base{"bf16", "-", "-", "16+0"};
    base.code_bits = 16;
    size_t a, r;
    int f;
    if (!measure_sizes(make_case(KVXFER_CODEC_BF16, 0, 32, 4).cfg, ds, src, &a, &r, &f))
      return false;
    finish(base, a, r, f);
  }
  return true;
}

std::string fmt2(double v) { return kp::strprintf("%.2f", v); }
std::string fmt4(double v) { return kp::strprintf("%.4f", v); }

// ---------------------------------------------------------------------------
// --gpu: the CUDA kernels (src/cuda/device_codec.h) on one device page
// (docs/PERFORMANCE.md, "codec_perf --gpu").  Built when CMake found CUDA
// (KVXFER_HAVE_CUDA defines KVXFER_CODEC_PERF_GPU); elsewhere --gpu only
// prints why it skipped.
// ---------------------------------------------------------------------------
constexpr int64_t kGpuTokens = 32768;  // one layer's K of a 32K-token Llama-3-8B context
constexpr int64_t kGpuQuickTokens = 4096;
constexpr int kGpuWarmup = 5, kGpuIters = 20;  // defaults of -w / -n with --gpu
#ifdef KVXFER_GPU_EMULATION
constexpr const char* kGpuTimerName = "steady_clock (CPU emulation)";
#else
constexpr const char* kGpuTimerName = "CUDA events, L2 flushed before each";
#endif
constexpr double kHbmTarget = 0.8;  // the target: >= 80% of HBM bandwidth

/** The "# skipped" line (and JSON file) of --gpu without a usable device; exit status 0. */
int gpu_skip(const Options& o, const std::string& why) {
  std::printf("# skipped: no CUDA device (%s)\n", why.c_str());
  if (!o.common.json_path.empty()) {
    json j = {{"tool", "codec_perf"},
              {"mode", "gpu"},
              {"kvxfer_version", KVXFER_VERSION_CODE},
              {"machine", kp::to_json(kp::machine_info())},
              {"skipped", why}};
    if (kp::emit_json("codec_perf", o.common.json_path, j) != 0) return 2;
  }
  return 0;
}

#ifdef KVXFER_CODEC_PERF_GPU
namespace kcu = kvxfer::cuda;

/** A CUDA runtime result through kcu::cuda_result; prints a failure and returns false. */
bool cuda_ok(cudaError_t e, const char* what) {
  const kvxfer_result_t r = kcu::cuda_result(e, what);
  return r >= 0 || report_failure(what, r);
}
#define CODEC_PERF_KV(call)                       \
  do {                                            \
    const kvxfer_result_t r_ = (call);            \
    if (r_ < 0) return report_failure(#call, r_); \
  } while (0)

using DevBuf = kvxfer::cuda::DeviceBuffer;  // src/cuda/device_buffer.h

/** DevBuf::alloc, printing a failure; returns false then. */
bool alloc(DevBuf* b, size_t bytes) { return cuda_ok(b->alloc(bytes), "cudaMalloc"); }

/**
 * Copies n bytes host <-> device in order with the work on stream s: through a
 * pinned staging buffer, by cudaMemcpyAsync on s, then waits for s (before the
 * staging buffer goes).  A pageable cudaMemcpy runs on the legacy default
 * stream, which s (non-blocking) does not wait for: an upload might not have
 * landed when the next kernel on s starts.
 */
bool copy_on_stream(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s,
                    const char* what) {
  if (n == 0) return true;
  kvxfer::cuda::PinnedBuffer pin;
  if (!cuda_ok(pin.alloc(n), "cudaMallocHost")) return false;
  const bool up = kind == cudaMemcpyHostToDevice;
  if (up) std::memcpy(pin.p, src, n);
  if (!cuda_ok(cudaMemcpyAsync(up ? dst : pin.p, up ? pin.p : src, n, kind, s), what) ||
      !cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize"))
    return false;
  if (!up) std::memcpy(dst, pin.p, n);
  return true;
}

/**
 * A one-page host Pool mirrored in device memory: the same bytes, the same
 * pseudo-random block order, and the block table itself in device memory
 * (src/cuda/device_codec.h, "Device layouts"), as a vLLM runtime holds it.
 */
struct DevicePool {
  DevBuf storage, table;
  kvxfer_page_layout_t layout{};
  cudaStream_t stream = nullptr;  // the stream of the kernels: every copy is ordered on it
  bool init(const Pool& h, cudaStream_t s) {
    stream = s;
    if (!alloc(&storage, h.storage.size())) return false;
    std::vector<void*> blocks;
    for (void* b : h.blocks[0])
      blocks.push_back(storage.p + (static_cast<uint8_t*>(b) - h.storage.data()));
    if (!alloc(&table, blocks.size() * sizeof(void*))) return false;
    if (!copy_on_stream(table.p, blocks.data(), blocks.size() * sizeof(void*),
                        cudaMemcpyHostToDevice, stream, "cudaMemcpyAsync(block table)"))
      return false;
    layout = h.layouts[0];
    layout.blocks = reinterpret_cast<void* const*>(table.p);
    return true;
  }
  bool upload(const Pool& h) {
    return copy_on_stream(storage.p, h.storage.data(), h.storage.size(), cudaMemcpyHostToDevice,
                          stream, "cudaMemcpyAsync(upload)");
  }
  bool download(Pool* h) const {
    return copy_on_stream(h->storage.data(), storage.p, h->storage.size(), cudaMemcpyDeviceToHost,
                          stream, "cudaMemcpyAsync(download)");
  }
};

/**
 * Times work enqueued on one stream.  Each of the w + n iterations: the L2
 * cache is flushed (a cudaMemsetAsync of twice its size, not timed), then a
 * CUDA event is recorded before and after the work, and the iteration's time
 * is cudaEventElapsedTime of the pair.  Under the CPU emulation of the
 * kernels (KVXFER_GPU_EMULATION, target codec_perf_emu) there are no events
 * and no cache: steady_clock around the (synchronous) work.
 */
class GpuTimer {
 public:
  GpuTimer() = default;
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;
  ~GpuTimer() {
#ifndef KVXFER_GPU_EMULATION
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
#endif
  }
  bool init(cudaStream_t s, size_t l2_bytes) {
    stream_ = s;
#ifndef KVXFER_GPU_EMULATION
    if (!cuda_ok(cudaEventCreate(&start_), "cudaEventCreate")) return false;
    if (!cuda_ok(cudaEventCreate(&stop_), "cudaEventCreate")) return false;
    if (l2_bytes > 0 && !alloc(&flush_, 2 * l2_bytes)) return false;
#else
    (void)l2_bytes;
#endif
    return true;
  }
  /** Runs `enqueue` w + n times; *out summarises the last n (median etc., as kp::time_loop). */
  bool loop(int w, int n, const std::function<bool()>& enqueue, kp::Stats* out) {
    std::vector<double> us;
    for (int i = 0; i < w + n; ++i) {
#ifndef KVXFER_GPU_EMULATION
      if (flush_.n > 0 &&
          !cuda_ok(cudaMemsetAsync(flush_.p, i & 0xff, flush_.n, stream_), "cudaMemsetAsync"))
        return false;
      if (!cuda_ok(cudaEventRecord(start_, stream_), "cudaEventRecord")) return false;
      if (!enqueue()) return false;
      if (!cuda_ok(cudaEventRecord(stop_, stream_), "cudaEventRecord")) return false;
      if (!cuda_ok(cudaEventSynchronize(stop_), "cudaEventSynchronize")) return false;
      float ms = 0;
      if (!cuda_ok(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime")) return false;
      if (i >= w) us.push_back(1e3 * static_cast<double>(ms));
#else
      const auto t0 = std::chrono::steady_clock::now();
      if (!enqueue()) return false;
      if (!cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")) return false;
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= w) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
#endif
    }
    *out = kp::summarize(std::move(us));
    return true;
  }

 private:
  cudaStream_t stream_ = nullptr;
#ifndef KVXFER_GPU_EMULATION
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  DevBuf flush_;
#endif
};

/** One row of the --gpu table: one kernel operation of one codec. */
struct GpuRow {
  GpuRow(std::string o, uint64_t r, uint64_t w) : op(std::move(o)), read(r), written(w) {}
  std::string op;             // encode | dec_anchor | dec_full
  uint64_t read = 0;          // bytes the operation must read from device memory
  uint64_t written = 0;       // bytes it must write
  kp::Stats t;                // the operation
  uint64_t memcpy_bytes = 0;  // (read + written) / 2, copied device to device
  kp::Stats mc;               // that cudaMemcpyAsync
  int64_t wrong = -1;         // -1: not checked
};

/** Times a device-to-device cudaMemcpyAsync of `bytes` (moving 2 x bytes). */
bool gpu_memcpy(const Options& o, GpuTimer* timer, cudaStream_t s, uint64_t bytes, kp::Stats* out) {
  DevBuf a, b;
  if (!alloc(&a, bytes) || !alloc(&b, bytes)) return false;
  if (!cuda_ok(cudaMemcpyAsync(a.p, b.p, bytes, cudaMemcpyDeviceToDevice, s),
               "cudaMemcpyAsync(touch)"))
    return false;
  return timer->loop(
      o.common.warmup, o.common.iters,
      [&] {
        return cuda_ok(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s),
                       "cudaMemcpyAsync(device to device)");
      },
      out);
}

/** Status after a launch sequence; false (with a message) on anything but `allowed` flags. */
bool gpu_status(const kcu::DeviceScratch& sc, cudaStream_t s, uint32_t allowed, uint32_t* flags,
                const char* what) {
  kcu::DeviceStatus st{};
  CODEC_PERF_KV(kcu::read_status(sc.status(), &st, s));
  *flags = st.flags;
  if ((st.flags & ~allowed) != 0) {
    std::fprintf(stderr, "codec_perf: %s: device status 0x%x (%s%s%s)\n", what, st.flags,
                 st.flags & kcu::STATUS_NEED_FP32 ? "need fp32 metadata " : "",
                 st.flags & kcu::STATUS_NONFINITE ? "non-finite input " : "",
                 st.flags & kcu::STATUS_BAD_META ? "bad metadata" : "");
    return false;
  }
  return true;
}

/**
 * Measures one codec on one device page: encode, anchor-only decode and (for
 * the split codecs) full decode, each against a D2D memcpy of the same bytes,
 * and with -c 1 compares the GPU's payloads and decoded pages with the CPU
 * codec's (`ref` path) byte for byte.  The decodes read the payloads the GPU
 * encode just wrote.
 */
bool gpu_codec(const Options& o, const CodecCase& cc, kc::Impl ref, const Pool& hsrc, Pool* hdst,
               const DevicePool& dsrc, DevicePool* ddst, GpuTimer* timer, cudaStream_t s,
               bool* meta_fp32, std::vector<GpuRow>* rows) {
  // The kernels alone: a page past the attention-sink rows, which the encode
  // driver packs with the BF16 passthrough's kernel (docs/FORMAT.md 2.7).
  const kvxfer_page_id_t id{0, KVXFER_KV_KEY, int64_t{1} << 20, 0};
  const int64_t T = hsrc.T;
  const int32_t H = hsrc.H;
  const uint64_t page = hsrc.page_bytes();
  const bool check = o.common.check != 0;

  // CPU: sections and decoded pages (-c 1).
  std::vector<uint8_t> canc, cres, cpu_anchor, cpu_full;
  size_t cal = 0, crl = 0;
  if (check) {
    size_t amax = 0, rmax = 0;
    CODEC_PERF_KV(kc::max_sizes(&cc.cfg, T, H, &amax, &rmax));
    canc.resize(amax);
    cres.resize(rmax);
    CODEC_PERF_KV(kc::encode_page(&cc.cfg, &id, &hsrc.layouts[0], canc.data(), amax, &cal,
                                  cres.data(), rmax, &crl, ref, 0));
    hdst->poison();
    CODEC_PERF_KV(kc::decode_page(canc.data(), cal, nullptr, 0, &id, &hdst->layouts[0], ref, 0));
    cpu_anchor = hdst->gather(0);
    hdst->poison();
    CODEC_PERF_KV(
        kc::decode_page(canc.data(), cal, cres.data(), crl, &id, &hdst->layouts[0], ref, 0));
    cpu_full = hdst->gather(0);
  }

  // GPU: codebook, scratch, metadata precision (fp16 first, as the CPU codec).
  std::string why;
  const kc::CodebookRef cb = kc::get_codebook(cc.cfg.codec, cc.cfg.alpha, cc.cfg.anchor_bits, &why);
  if (cb == nullptr) {
    std::fprintf(stderr, "codec_perf: no codebook for %s %s: %s\n", cc.name.c_str(),
                 cc.params.c_str(), why.c_str());
    return false;
  }
  kcu::DeviceCodebook dcb;
  CODEC_PERF_KV(kcu::upload_codebook(cb.get(), &dcb));
  kcu::DeviceScratch sc;
  CODEC_PERF_KV(kcu::alloc_scratch(&cc.cfg, T, H, &sc));
  kc::PageHeader h = kc::make_header(cc.cfg, id, T, H, hsrc.dtype);
  bool fp32 = false;
  auto encode = [&] {
    const kvxfer_result_t r1 = kcu::launch_reset_status(sc.status(), s);
    if (r1 < 0) return report_failure("launch_reset_status", r1);
    const kvxfer_result_t r2 = kcu::launch_encode(
        dcb, &dsrc.layout, cc.cfg.chunk_tokens, static_cast<int64_t>(h.sink_rows), fp32,
        sc.anchor_payload(), sc.residual_payload(), sc.status(), s);
    return r2 < 0 ? report_failure("launch_encode", r2) : true;
  };
  uint32_t flags = 0;
  if (!encode() || !gpu_status(sc, s, kcu::STATUS_NEED_FP32, &flags, "encode")) return false;
  if (flags & kcu::STATUS_NEED_FP32) {
    fp32 = true;
    h.flags = kc::FLAG_META_FP32;
  }
  *meta_fp32 = fp32;
  const kc::PayloadSizes ps = kc::payload_sizes(h);
  const uint64_t apay = ps.anchor_payload(), rpay = ps.residual_codes;
  std::vector<uint8_t> tmp;
  auto count = [&](const uint8_t* dev, uint64_t n, const std::vector<uint8_t>& cpu, size_t cpu_len,
                   uint64_t* wrong) {
    tmp.resize(n);
    if (!copy_on_stream(tmp.data(), dev, n, cudaMemcpyDeviceToHost, s, "cudaMemcpyAsync"))
      return false;
    *wrong += count_wrong(tmp.data(), n, cpu.data() + kc::kHeaderBytes, cpu_len - kc::kHeaderBytes);
    return true;
  };

  // encode
  GpuRow enc{"encode", page, apay + rpay};
  if (!timer->loop(o.common.warmup, o.common.iters, encode, &enc.t)) return false;
  if (!gpu_status(sc, s, 0, &flags, "encode")) return false;
  if (check) {
    uint64_t w = 0;
    if (!count(sc.anchor_payload(), apay, canc, cal, &w) ||
        !count(sc.residual_payload(), rpay, cres, crl, &w))
      return false;
    enc.wrong = static_cast<int64_t>(w);
  }
  rows->push_back(enc);

  // decodes, from the payloads just encoded on the device
  auto decode = [&](bool full, GpuRow* row) {
    hdst->poison();  // 0xA5 everywhere: a row the kernel skipped cannot match
    if (!ddst->upload(*hdst)) return false;
    auto run = [&] {
      const kvxfer_result_t r1 = kcu::launch_reset_status(sc.status(), s);
      if (r1 < 0) return report_failure("launch_reset_status", r1);
      const kvxfer_result_t r2 =
          kcu::launch_decode(h, dcb, sc.anchor_payload(), full ? sc.residual_payload() : nullptr,
                             &ddst->layout, sc.status(), s);
      return r2 < 0 ? report_failure("launch_decode", r2) : true;
    };
    if (!timer->loop(o.common.warmup, o.common.iters, run, &row->t)) return false;
    if (!gpu_status(sc, s, 0, &flags, full ? "full decode" : "anchor decode")) return false;
    if (check) {
      if (!ddst->download(hdst)) return false;
      const std::vector<uint8_t> got = hdst->gather(0);
      const std::vector<uint8_t>& want = full ? cpu_full : cpu_anchor;
      row->wrong =
          static_cast<int64_t>(count_wrong(got.data(), got.size(), want.data(), want.size()));
    }
    return true;
  };
  GpuRow da{"dec_anchor", apay, page};
  if (!decode(false, &da)) return false;
  rows->push_back(da);
  if (rpay > 0) {  // INT4 has no residual: its full decode is the anchor decode
    GpuRow df{"dec_full", apay + rpay, page};
    if (!decode(true, &df)) return false;
    rows->push_back(df);
  }
  return true;
}

#endif  // KVXFER_CODEC_PERF_GPU

/**
 * codec_perf --gpu.  Returns the exit status: 0 (or a skip), 1 wrong bytes,
 * 2 a failed call.
 */
int run_gpu(const Options& o, const std::vector<kvxfer_dtype_t>& dtypes,
            const std::vector<CodecCase>& cases) {
  const kp::MachineInfo mach = kp::machine_info();
  const std::vector<kp::Setting> settings = kp::kvxfer_settings();
  kp::print_preamble(stdout, "codec_perf", mach, settings);
  std::string dts;
  for (kvxfer_dtype_t d : dtypes) dts += std::string(dts.empty() ? "" : ",") + dtype_name(d);
  std::printf("# Options: --gpu -w %d -n %d -c %d -d %s --codec %s --tokens %" PRId64
              "%s | time = median of -n iterations, %s | "
              "block %d tokens\n",
              o.common.warmup, o.common.iters, o.common.check, dts.c_str(), o.codecs.c_str(),
              o.tokens, o.common.quick ? " --quick" : "", kGpuTimerName, kBlockSize);
  std::fflush(stdout);
#ifndef KVXFER_CODEC_PERF_GPU
  (void)cases;
  return gpu_skip(o, "this codec_perf was built without CUDA (KVXFER_HAVE_CUDA OFF)");
#else
  int ndev = 0;
  const cudaError_t de = cudaGetDeviceCount(&ndev);
  if (de != cudaSuccess)
    return gpu_skip(o, kp::strprintf("cudaGetDeviceCount: %s", cudaGetErrorString(de)));
  if (ndev == 0) return gpu_skip(o, "cudaGetDeviceCount found 0 devices");
  int dev = 0;
  if (!cuda_ok(cudaGetDevice(&dev), "cudaGetDevice")) return 2;
  json jgpu;
  size_t l2 = 0;
  double peak_gbps = 0;
#ifndef KVXFER_GPU_EMULATION
  cudaDeviceProp prop{};
  if (!cuda_ok(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties")) return 2;
  int mem_khz = 0;
  if (cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess) mem_khz = 0;
  // DDR: two transfers per clock over memoryBusWidth bits.
  peak_gbps = 2.0 * mem_khz * 1e3 * (prop.memoryBusWidth / 8.0) / 1e9;
  l2 = static_cast<size_t>(prop.l2CacheSize);
  std::printf(
      "# GPU %d: %s | sm_%d%d | %d SMs | %.1f GiB | L2 %.0f MiB | memory %d-bit at %d MHz "
      "= %.0f GB/s peak (2 x clock x width)\n",
      dev, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
      static_cast<double>(prop.totalGlobalMem) / (1 << 30), static_cast<double>(l2) / (1 << 20),
      prop.memoryBusWidth, mem_khz / 1000, peak_gbps);
  jgpu = {{"device", dev},
          {"name", prop.name},
          {"sm", prop.major * 10 + prop.minor},
          {"multiprocessors", prop.multiProcessorCount},
          {"total_bytes", prop.totalGlobalMem},
          {"l2_bytes", prop.l2CacheSize},
          {"memory_bus_bits", prop.memoryBusWidth},
          {"memory_clock_khz", mem_khz},
          {"peak_gbps", peak_gbps}};
#else
  std::printf(
      "# GPU %d: CPU emulation of the kernels (cuda_emu/): checks the bytes, "
      "times are not GPU figures\n",
      dev);
  jgpu = {{"device", dev}, {"name", "emulation"}};
#endif
  kc::Impl ref = kc::Impl::REFERENCE;
  if (o.gpu_ref == "fast" && kc::resolve_impl(kc::Impl::AUTO, &ref) < 0) {
    report_failure("resolve_impl", KVXFER_ERR_INTERNAL);
    return 2;
  }

  // Data: layer 0's K of the synthetic Llama-3-8B-like KV (make_synth), T tokens.
  Dataset ds;
  if (!make_synth(o, o.tokens, &ds, /*k_only=*/true)) return 2;
  std::printf("# Dataset synth: %s\n", ds.description.c_str());
  std::printf("# Check: GPU payloads and decoded pages against the CPU %s path, byte for byte%s\n",
              impl_name(ref), o.common.check ? "" : " (off: -c 0)");
  std::printf("#\n");

  cudaStream_t stream = nullptr;
  if (!cuda_ok(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, 0),
               "cudaStreamCreateWithPriority"))
    return 2;
  std::unique_ptr<std::remove_pointer_t<cudaStream_t>, void (*)(cudaStream_t)> stream_guard(
      stream, [](cudaStream_t st) { cudaStreamDestroy(st); });
  GpuTimer timer;
  if (!timer.init(stream, l2)) return 2;

  kp::Table table({{"codec", 5},
                   {"params", 9},
                   {"tokens", 6},
                   {"H", 5},
                   {"dtype", 5},
                   {"meta", 4},
                   {"op", 10},
                   {"read(B)", 10},
                   {"written(B)", 10},
                   {"time(us)", 8},
                   {"rw_GB/s", 7},
                   {"memcpy_GB/s", 7},
                   {"rw/memcpy", 6},
                   {"#wrong", 6}});
  std::printf("%s\n", table.header().c_str());
  std::fflush(stdout);

  json jrows = json::array();
  uint64_t total_wrong = 0;
  std::map<std::string, std::pair<double, int>> sum;  // op -> (sum of rw/memcpy, rows)
  int met = 0, nrows = 0;
  bool ok = true;
  for (kvxfer_dtype_t dt : dtypes) {
    Pool hsrc(1, ds.T, ds.H, dt, 0x5eed0001), hdst(1, ds.T, ds.H, dt, 0x5eed0002);
    hsrc.fill(0, ds.pages[0].data);
    DevicePool dsrc, ddst;
    if (!dsrc.init(hsrc, stream) || !dsrc.upload(hsrc) || !ddst.init(hdst, stream)) {
      ok = false;
      break;
    }
    for (const CodecCase& cc : cases) {
      std::vector<GpuRow> rows;
      bool fp32 = false;
      if (!gpu_codec(o, cc, ref, hsrc, &hdst, dsrc, &ddst, &timer, stream, &fp32, &rows)) {
        ok = false;
        break;
      }
      for (GpuRow& r : rows) {
        r.memcpy_bytes = (r.read + r.written + 1) / 2;
        if (!gpu_memcpy(o, &timer, stream, r.memcpy_bytes, &r.mc)) {
          ok = false;
          break;
        }
        const double bw = kp::gbps(static_cast<double>(r.read + r.written), r.t.median_us);
        const double mbw = kp::gbps(2.0 * static_cast<double>(r.memcpy_bytes), r.mc.median_us);
        const double ratio = mbw > 0 ? bw / mbw : 0;
        std::printf("%s\n", table
                                .row({cc.name, cc.params, std::to_string(ds.T),
                                      std::to_string(ds.H), dtype_name(dt), fp32 ? "fp32" : "fp16",
                                      r.op, std::to_string(r.read), std::to_string(r.written),
                                      kp::strprintf("%.1f", r.t.median_us), fmt2(bw), fmt2(mbw),
                                      fmt4(ratio), r.wrong < 0 ? "N/A" : std::to_string(r.wrong)})
                                .c_str());
        std::fflush(stdout);
        if (r.wrong > 0) total_wrong += static_cast<uint64_t>(r.wrong);
        sum[r.op].first += ratio;
        sum[r.op].second += 1;
        met += ratio >= kHbmTarget;
        ++nrows;
        json params = {{"alpha", cc.cfg.alpha},
                       {"chunk_tokens", cc.cfg.chunk_tokens},
                       {"anchor_bits", cc.cfg.anchor_bits}};
        jrows.push_back({{"codec", cc.name},
                         {"params", cc.params},
                         {"config", params},
                         {"dtype", dtype_name(dt)},
                         {"tokens", ds.T},
                         {"channels", ds.H},
                         {"meta_fp32", fp32},
                         {"op", r.op},
                         {"read_bytes", r.read},
                         {"written_bytes", r.written},
                         {"time", kp::to_json(r.t)},
                         {"rw_gbps", bw},
                         {"memcpy_bytes", r.memcpy_bytes},
                         {"memcpy", kp::to_json(r.mc)},
                         {"memcpy_gbps", mbw},
                         {"ratio", ratio},
                         {"peak_ratio", peak_gbps > 0 ? json(bw / peak_gbps) : json(nullptr)},
                         {"wrong", r.wrong < 0 ? json(nullptr) : json(r.wrong)}});
      }
      if (!ok) break;
    }
    if (!ok) break;
  }

  const bool exact = ok && total_wrong == 0;
  std::printf("# Wrong bytes : %" PRIu64 " %s\n", total_wrong,
              o.common.check == 0 ? "(not checked)"
              : total_wrong == 0  ? "OK"
                                  : "FAILED");
  std::printf("# Bit-exact   : %s\n",
              o.common.check == 0 ? "not checked (-c 0)"
              : !ok               ? "not established (a call failed)"
              : exact             ? "yes, every GPU payload and decoded page equals the CPU codec's"
                                  : "NO, the GPU differs from the CPU codec");
  json javg = json::object();
  for (const char* op : {"encode", "dec_anchor", "dec_full"}) {
    auto it = sum.find(op);
    if (it == sum.end()) continue;
    const double avg = it->second.first / it->second.second;
    javg[op] = avg;
    std::printf("# Avg rw/memcpy %-10s: %.3f  (mean over %d rows)\n", op, avg, it->second.second);
  }
  std::printf("# Rows at rw/memcpy >= %.2f (target): %d of %d\n", kHbmTarget, met, nrows);
  std::printf("#\n");
  std::fflush(stdout);

  if (!o.common.json_path.empty()) {
    json j = {{"tool", "codec_perf"},
              {"mode", "gpu"},
              {"kvxfer_version", KVXFER_VERSION_CODE},
              {"machine", kp::to_json(mach)},
              {"gpu", jgpu},
              {"settings", kp::to_json(settings)},
              {"options",
               {{"warmup_iters", o.common.warmup},
                {"iters", o.common.iters},
                {"check", o.common.check},
                {"check_path", impl_name(ref)},
                {"dtype", dts},
                {"codec", o.codecs},
                {"tokens", o.tokens},
                {"quick", o.common.quick},
                {"block_size", kBlockSize},
                {"time_statistic", "median"},
                {"timer", kGpuTimerName},
                {"l2_flush_bytes", 2 * l2}}},
              {"dataset", ds.info},
              {"rows", jrows},
              {"summary",
               {{"ok", exact},
                {"wrong_bytes", total_wrong},
                {"avg_ratio", javg},
                {"target_ratio", kHbmTarget},
                {"rows_at_target", met},
                {"rows", nrows}}}};
    if (kp::emit_json("codec_perf", o.common.json_path, j) != 0) return 2;
  }
  if (!ok) return 2;
  return total_wrong > 0 ? 1 : 0;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "codec_perf: CPU page codec throughput and bits per element "
      "(columns defined in docs/PERFORMANCE.md)"};
  kp::add_common_options(&app, &o.common);
  app.add_option("-d,--dtype", o.dtypes,
                 "source/destination dtypes: comma list of bf16,fp16,fp32, or all")
      ->capture_default_str();
  auto* codec_opt = app.add_option("--codec", o.codecs,
                                   "codecs of the throughput table: comma list of "
                                   "lynx,lynx-a100,lynx-auto,int8,int4,bf16, or all")
                        ->capture_default_str();
  auto* ds_opt =
      app.add_option("--dataset", o.datasets, "comma list of real,synth")->capture_default_str();
  auto* tok_opt = app.add_option("--tokens", o.tokens,
                                 "tokens per synthetic page (--quick: 1024; --gpu: 32768)")
                      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
                      ->capture_default_str();
  auto* threads_opt =
      app.add_option(
             "-t,--threads", o.threads,
             "threads of the multi-threaded row; 0 = KVXFER_CODEC_THREADS if set, else every "
             "usable CPU")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
  auto* bits_opt =
      app.add_option("--bits", o.bits, "1: print the bits-per-element table, 0: skip it")
          ->check(CLI::Range(0, 1))
          ->capture_default_str();
  auto* model_opt =
      app.add_option("--model", o.model_path, "llama2.c checkpoint of the real dataset")
          ->capture_default_str();
  app.add_option("--path", o.paths,
                 "paths of the throughput table: comma list of reference,scalar,avx2,avx512,mt "
                 "(avx2, avx512: rows only where the CPU has them; mt = the default path on -t "
                 "threads); #wrong needs reference")
      ->capture_default_str();
  app.add_flag("--gpu", o.gpu,
               "measure the CUDA kernels on one device page instead of the CPU codec "
               "(docs/PERFORMANCE.md, \"codec_perf --gpu\")");
  auto* gpu_ref_opt =
      app.add_option("--gpu_ref", o.gpu_ref,
                     "--gpu: CPU path the GPU bytes are checked against (reference, fast)")
          ->check(CLI::IsMember({"reference", "fast"}))
          ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  if (o.gpu) {  // --gpu defaults: one 32K-token K page (docs/PERFORMANCE.md)
    for (const CLI::Option* opt : {ds_opt, threads_opt, bits_opt, model_opt})
      if (opt->count() > 0) {
        std::fprintf(stderr, "codec_perf: %s does not apply to --gpu\n", opt->get_name().c_str());
        return 2;
      }
    if (app.count("-w") == 0) o.common.warmup = o.common.quick ? 2 : kGpuWarmup;
    if (app.count("-n") == 0) o.common.iters = o.common.quick ? 5 : kGpuIters;
    if (tok_opt->count() == 0) o.tokens = o.common.quick ? kGpuQuickTokens : kGpuTokens;
    if (codec_opt->count() == 0) o.codecs = "lynx,int8,int4";
    o.datasets = "synth";
  } else if (gpu_ref_opt->count() > 0) {
    std::fprintf(stderr, "codec_perf: --gpu_ref needs --gpu\n");
    return 2;
  } else if (o.common.quick) {
    if (app.count("-w") == 0) o.common.warmup = 1;
    if (app.count("-n") == 0) o.common.iters = 3;
    if (tok_opt->count() == 0) o.tokens = 1024;
  }
  std::vector<kvxfer_dtype_t> dtypes;
  for (const std::string& d : split(o.dtypes == "all" ? "bf16,fp16,fp32" : o.dtypes)) {
    if (d == "bf16")
      dtypes.push_back(KVXFER_DTYPE_BF16);
    else if (d == "fp16")
      dtypes.push_back(KVXFER_DTYPE_FP16);
    else if (d == "fp32")
      dtypes.push_back(KVXFER_DTYPE_FP32);
    else {
      std::fprintf(stderr, "codec_perf: unknown dtype '%s' (bf16, fp16, fp32, all)\n", d.c_str());
      return 2;
    }
  }
  std::vector<CodecCase> cases;
  const kvxfer_codec_config_t defaults = KVXFER_CODEC_CONFIG_INITIALIZER;
  for (const std::string& c :
       split(o.codecs == "all"
                 ? (o.gpu ? "lynx,int8,int4" : "lynx,lynx-a100,lynx-auto,int8,int4,bf16")
                 : o.codecs)) {
    if (o.gpu && (c == "lynx-auto" || c == "lynx-a100" || c == "bf16")) {
      std::fprintf(stderr, "codec_perf: --gpu measures lynx, int8 and int4 only (%s: %s)\n",
                   c.c_str(),
                   c == "bf16" ? "a passthrough, no quantization kernel"
                               : "alpha=auto is calibrated on the host, docs/GPU.md");
      return 2;
    }
    if (c == "lynx")  // the library's default alpha (docs/FORMAT.md 2.6)
      cases.push_back(make_case(KVXFER_CODEC_LYNX, defaults.alpha, 32, 4));
    else if (c == "lynx-a100")  // the alpha-law with the paper's appendix alpha (table lookup)
      cases.push_back(make_case(KVXFER_CODEC_LYNX, 100.0f, 32, 4));
    else if (c == "lynx-auto")  // per-page alpha calibration included in the encode time
      cases.push_back(make_case(KVXFER_CODEC_LYNX, KVXFER_ALPHA_AUTO, 32, 4));
    else if (c == "int8")
      cases.push_back(make_case(KVXFER_CODEC_INT8, 0.0f, 32, 4));
    else if (c == "int4")
      cases.push_back(make_case(KVXFER_CODEC_INT4, 0.0f, 32, 4));
    else if (c == "bf16")
      cases.push_back(make_case(KVXFER_CODEC_BF16, 0.0f, 32, 4));
    else {
      std::fprintf(
          stderr,
          "codec_perf: unknown codec '%s' (lynx, lynx-a100, lynx-auto, int8, int4, bf16, all)\n",
          c.c_str());
      return 2;
    }
  }
  std::vector<std::string> ds_names = split(o.datasets);
  for (const std::string& d : ds_names)
    if (d != "real" && d != "synth") {
      std::fprintf(stderr, "codec_perf: unknown dataset '%s' (real, synth)\n", d.c_str());
      return 2;
    }
  if (dtypes.empty() || ds_names.empty()) {
    std::fprintf(stderr, "codec_perf: nothing to run\n");
    return 2;
  }

  kvxfer_result_t vr = kvxfer::params::validate();
  if (vr < 0) {
    report_failure("KVXFER_* environment check", vr);
    return 2;
  }
  if (o.gpu) return run_gpu(o, dtypes, cases);
  const kp::MachineInfo mach = kp::machine_info();
  const std::vector<kp::Setting> settings = kp::kvxfer_settings();
  kp::print_preamble(stdout, "codec_perf", mach, settings);

  // Paths: reference, scalar, avx2 and avx512 on one thread, then the
  // library's default path (KVXFER_CODEC_IMPL, auto = avx512, else avx2, when
  // present) on N threads.
  // -t wins; else KVXFER_CODEC_THREADS when set (> 0); else every usable CPU.
  const int mt = o.threads > 0 ? o.threads
                 : kvxfer::params::CodecThreads() > 0
                     ? static_cast<int>(kvxfer::params::CodecThreads())
                     : std::max(1, mach.usable_cpus);
  kc::Impl best;
  if (kvxfer_result_t r = kc::resolve_impl(kc::Impl::AUTO, &best); r < 0) {
    report_failure("resolve_impl", r);
    return 2;
  }
  std::vector<Path> paths;
  for (const std::string& p : split(o.paths)) {
    if (p == "reference") {
      paths.push_back({"reference", kc::Impl::REFERENCE, 1, true});
    } else if (p == "scalar") {
      paths.push_back({"scalar", kc::Impl::SCALAR, 1, false});
    } else if (p == "avx2") {
      if (kc::fast::cpu_has_avx2()) paths.push_back({"avx2", kc::Impl::AVX2, 1, false});
    } else if (p == "avx512") {
      if (kc::fast::cpu_has_avx512()) paths.push_back({"avx512", kc::Impl::AVX512, 1, false});
    } else if (p == "mt") {
      paths.push_back({impl_name(best), best, mt, false});
    } else if (p == "bound") {
      if (kc::fast::cpu_has_avx2()) paths.push_back({"bound", kc::Impl::AUTO, 1, false, true});
    } else {
      std::fprintf(stderr,
                   "codec_perf: unknown path '%s' (reference, scalar, avx2, avx512, mt, bound)\n",
                   p.c_str());
      return 2;
    }
  }
  // #wrong compares with the reference's bytes: it runs first when asked for;
  // the bound row comes last, under the paths it bounds.
  std::stable_partition(paths.begin(), paths.end(), [](const Path& p) { return p.reference; });
  std::stable_partition(paths.begin(), paths.end(), [](const Path& p) { return !p.bound; });

  std::printf("# Options: -w %d -n %d -c %d -d %s --codec %s --dataset %s --tokens %" PRId64
              " -t %d%s | time = median of -n iterations, steady_clock | block %d tokens\n",
              o.common.warmup, o.common.iters, o.common.check, o.dtypes.c_str(), o.codecs.c_str(),
              o.datasets.c_str(), o.tokens, mt, o.common.quick ? " --quick" : "", kBlockSize);
  std::fflush(stdout);

  std::vector<Dataset> datasets;
  for (const std::string& name : ds_names) {
    Dataset ds;
    if (!(name == "real" ? make_real(o, &ds) : make_synth(o, o.tokens, &ds))) return 2;
    std::printf("# Dataset %-5s: %s\n", ds.name.c_str(), ds.description.c_str());
    datasets.push_back(std::move(ds));
  }
  std::printf("#\n");

  // ---- Table 1: throughput ------------------------------------------------
  // The 1-minute load average (/proc/loadavg), printed beside the table: the
  // two-thread rows only mean something on an otherwise idle machine.
  const std::string load_before = load_average();
  kp::Table table({{"dataset", 7},
                   {"codec", 5},
                   {"params", 11},
                   {"size(B)", 10},
                   {"pages", 5},
                   {"tokens", 6},
                   {"H", 5},
                   {"dtype", 5},
                   {"path", 9},
                   {"threads", 7},
                   {"memcpy_GB/s", 7},
                   {"enc_time(us)", 10},
                   {"enc_GB/s", 7},
                   {"enc/memcpy", 7},
                   {"dec_full_GB/s", 7},
                   {"dec_full/memcpy", 7},
                   {"dec_anchor_GB/s", 7},
                   {"dec_anchor/memcpy", 7},
                   {"#wrong", 6}});
  std::printf("%s\n", table.header().c_str());
  std::fflush(stdout);

  json jrows = json::array();
  uint64_t total_wrong = 0;
  double sum_enc = 0, sum_full = 0, sum_anchor = 0;
  int nrows = 0;
  bool ok = true;
  std::map<std::string, std::unique_ptr<Pool>> bits_src;  // first dtype's pool per dataset

  for (const Dataset& ds : datasets) {
    for (kvxfer_dtype_t dt : dtypes) {
      auto src = std::make_unique<Pool>(ds.pages.size(), ds.T, ds.H, dt, 0x5eed0001);
      Pool dst(ds.pages.size(), ds.T, ds.H, dt, 0x5eed0002, Pool::kPage / 2);
      for (size_t p = 0; p < ds.pages.size(); ++p) src->fill(p, ds.pages[p].data);
      const double bytes = static_cast<double>(src->page_bytes()) * ds.pages.size();
      const std::function<bool()> memcpy_once = [&] { return memcpy_pages(*src, &dst); };
      for (const CodecCase& cc : cases) {
        Expected expected;
        // Each codec path's ratios to memcpy, then (last) the bound row's.
        std::vector<std::pair<std::string, std::array<double, 3>>> case_ratios;
        for (const Path& path : paths) {
          RowResult rr;
          if (!run_path(o, ds, cc, path, src.get(), &dst, memcpy_once, &expected, &rr)) {
            ok = false;
            break;
          }
          const double e = kp::gbps(bytes, rr.enc.median_us);
          const double f = kp::gbps(bytes, rr.dec_full.median_us);
          const double a = kp::gbps(bytes, rr.dec_anchor.median_us);
          // Each ratio against the memcpy timed alongside that operation.
          const double mc_gbps = kp::gbps(bytes, rr.mc_enc.median_us);
          const double re = rr.enc.median_us > 0 ? rr.mc_enc.median_us / rr.enc.median_us : 0;
          const double rf =
              rr.dec_full.median_us > 0 ? rr.mc_full.median_us / rr.dec_full.median_us : 0;
          const double ra =
              rr.dec_anchor.median_us > 0 ? rr.mc_anchor.median_us / rr.dec_anchor.median_us : 0;
          std::printf(
              "%s\n",
              table
                  .row({ds.name, cc.name, cc.params, std::to_string(static_cast<uint64_t>(bytes)),
                        std::to_string(ds.pages.size()), std::to_string(ds.T), std::to_string(ds.H),
                        dtype_name(dt), path.name, std::to_string(path.threads), fmt2(mc_gbps),
                        kp::strprintf("%.1f", rr.enc.median_us), fmt2(e), fmt4(re), fmt2(f),
                        fmt4(rf), fmt2(a), fmt4(ra),
                        rr.wrong < 0 ? "N/A" : std::to_string(rr.wrong)})
                  .c_str());
          std::fflush(stdout);
          if (rr.wrong > 0) total_wrong += static_cast<uint64_t>(rr.wrong);
          case_ratios.push_back(
              {path.threads > 1 ? kp::strprintf("%s, %d threads", path.name.c_str(), path.threads)
                                : path.name,
               {re, rf, ra}});
          if (!path.bound) {
            sum_enc += re;
            sum_full += rf;
            sum_anchor += ra;
            ++nrows;
          }
          json params = {{"alpha", cc.cfg.alpha},
                         {"chunk_tokens", cc.cfg.chunk_tokens},
                         {"anchor_bits", cc.cfg.anchor_bits}};
          jrows.push_back({{"dataset", ds.name},
                           {"codec", cc.name},
                           {"params", cc.params},
                           {"config", params},
                           {"dtype", dtype_name(dt)},
                           {"path", path.name},
                           {"bound", path.bound},
                           {"threads", path.threads},
                           {"bytes", static_cast<uint64_t>(bytes)},
                           {"pages", ds.pages.size()},
                           {"tokens", ds.T},
                           {"channels", ds.H},
                           {"anchor_bytes", rr.anchor_bytes},
                           {"residual_bytes", rr.residual_bytes},
                           {"memcpy", kp::to_json(rr.mc_enc)},
                           {"memcpy_gbps", mc_gbps},
                           {"memcpy_beside_decode_full", kp::to_json(rr.mc_full)},
                           {"memcpy_beside_decode_anchor", kp::to_json(rr.mc_anchor)},
                           {"encode", kp::to_json(rr.enc)},
                           {"encode_gbps", e},
                           {"encode_ratio", re},
                           {"decode_full", kp::to_json(rr.dec_full)},
                           {"decode_full_gbps", f},
                           {"decode_full_ratio", rf},
                           {"decode_anchor", kp::to_json(rr.dec_anchor)},
                           {"decode_anchor_gbps", a},
                           {"decode_anchor_ratio", ra},
                           {"wrong", rr.wrong < 0 ? json(nullptr) : json(rr.wrong)}});
        }
        if (ok && !case_ratios.empty() && paths.back().bound) print_of_bound(case_ratios);
        if (!ok) break;
      }
      if (!ok) break;
      if (bits_src.count(ds.name) == 0) bits_src[ds.name] = std::move(src);
    }
    if (!ok) break;
  }

  const double avg_enc = nrows ? sum_enc / nrows : 0, avg_full = nrows ? sum_full / nrows : 0,
               avg_anchor = nrows ? sum_anchor / nrows : 0;
  std::printf("# Wrong bytes : %" PRIu64 " %s\n", total_wrong,
              o.common.check == 0 ? "(not checked)"
              : total_wrong == 0  ? "OK"
                                  : "FAILED");
  std::printf("# Avg encode ratio to memcpy       : %.3f  (mean over %d rows)\n", avg_enc, nrows);
  std::printf("# Avg full decode ratio to memcpy  : %.3f\n", avg_full);
  std::printf("# Avg anchor decode ratio to memcpy: %.3f\n", avg_anchor);
  std::printf("# Load average before / after the table: %s / %s\n", load_before.c_str(),
              load_average().c_str());
  std::printf("#\n");
  std::fflush(stdout);

  // ---- Table 2: bits per element ------------------------------------------
  json jbits = json::array();
  if (ok && o.bits) {
    kp::Table bt({{"dataset", 7},
                  {"tokens", 6},
                  {"H", 5},
                  {"dtype", 5},
                  {"codec", 5},
                  {"alpha", 5},
                  {"chunk", 5},
                  {"A+R", 4},
                  {"anchor_b/e", 8},
                  {"residual_b/e", 8},
                  {"total_b/e", 8},
                  {"meta_b/e", 8}});
    std::printf(
        "# Bits per element on the wire (section bytes * 8 / (pages * tokens * H); "
        "alpha '*' = same sizes for alpha 0,5,20,100,255)\n");
    std::printf("%s\n", bt.header().c_str());
    for (const Dataset& ds : datasets) {
      const Pool& src = *bits_src.at(ds.name);
      std::vector<BitsRow> rows;
      if (!bits_table(ds, src, &rows)) {
        ok = false;
        break;
      }
      for (const BitsRow& r : rows) {
        std::printf("%s\n", bt.row({ds.name, std::to_string(ds.T), std::to_string(ds.H),
                                    dtype_name(src.dtype), r.codec, r.alpha, r.chunk, r.split,
                                    fmt4(r.anchor), fmt4(r.residual), fmt4(r.total), fmt4(r.meta)})
                                .c_str());
        jbits.push_back({{"dataset", ds.name},
                         {"tokens", ds.T},
                         {"channels", ds.H},
                         {"pages", ds.pages.size()},
                         {"dtype", dtype_name(src.dtype)},
                         {"codec", r.codec},
                         {"alpha", r.alpha},
                         {"chunk", r.chunk},
                         {"split", r.split},
                         {"code_bits", r.code_bits},
                         {"anchor_bytes", r.anchor_bytes},
                         {"residual_bytes", r.residual_bytes},
                         {"anchor_bits_per_elem", r.anchor},
                         {"residual_bits_per_elem", r.residual},
                         {"total_bits_per_elem", r.total},
                         {"meta_bits_per_elem", r.meta},
                         {"meta_fp32_pages", r.meta_fp32_pages}});
      }
      std::fflush(stdout);
    }
  }

  if (!o.common.json_path.empty()) {
    json ds_json = json::array();
    for (const Dataset& ds : datasets) {
      json d = ds.info;
      d["name"] = ds.name;
      d["description"] = ds.description;
      d["tokens"] = ds.T;
      d["channels"] = ds.H;
      d["pages"] = ds.pages.size();
      ds_json.push_back(d);
    }
    json j = {{"tool", "codec_perf"},
              {"kvxfer_version", KVXFER_VERSION_CODE},
              {"machine", kp::to_json(mach)},
              {"settings", kp::to_json(settings)},
              {"options",
               {{"warmup_iters", o.common.warmup},
                {"iters", o.common.iters},
                {"check", o.common.check},
                {"dtype", o.dtypes},
                {"codec", o.codecs},
                {"dataset", o.datasets},
                {"tokens", o.tokens},
                {"threads", mt},
                {"quick", o.common.quick},
                {"block_size", kBlockSize},
                {"time_statistic", "median"}}},
              {"datasets", ds_json},
              {"throughput", jrows},
              {"bits", jbits},
              {"summary",
               {{"ok", ok && total_wrong == 0},
                {"wrong_bytes", total_wrong},
                {"avg_encode_ratio", avg_enc},
                {"avg_decode_full_ratio", avg_full},
                {"avg_decode_anchor_ratio", avg_anchor},
                {"rows", nrows}}}};
    if (kp::emit_json("codec_perf", o.common.json_path, j) != 0) return 2;
  }
  if (!ok) return 2;
  return total_wrong > 0 ? 1 : 0;
}
