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
#include "perf/codec_perf.h"
#include "perf/common/codec_bound.h"
#include "perf/common/harness.h"
#include "perf/common/kv_data.h"

namespace codec_perf {

namespace km = kvxfer::model;

/** The 1, 5 and 15 minute load averages of /proc/loadavg, or "n/a". */
std::string load_average() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return "n/a";
  double a = 0, b = 0, c = 0;
  const int n = std::fscanf(f, "%lf %lf %lf", &a, &b, &c);
  std::fclose(f);
  return n == 3 ? kp::strprintf("%.2f %.2f %.2f", a, b, c) : "n/a";
}

// ---------------------------------------------------------------------------
// Datasets: float32 pages, converted to each dtype in a paged pool.
// ---------------------------------------------------------------------------

// ---------------------------------------------------------------------------
// One codec / path measurement.
// ---------------------------------------------------------------------------

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

}  // namespace codec_perf

using namespace codec_perf;  // NOLINT(google-build-using-namespace)

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
  if (cases.empty()) {
    std::fprintf(stderr, "codec_perf: --codec '%s' names no codec\n", o.codecs.c_str());
    return 2;
  }
  std::vector<std::string> ds_names = split(o.datasets);
  if (ds_names.empty()) {
    std::fprintf(stderr, "codec_perf: --dataset '%s' names no dataset\n", o.datasets.c_str());
    return 2;
  }
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
  if (paths.empty()) {
    std::fprintf(stderr, "codec_perf: --path '%s' names no path this CPU runs\n", o.paths.c_str());
    return 2;
  }
  const bool compared =
      std::any_of(paths.begin(), paths.end(), [](const Path& p) { return p.reference; });
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
              : !compared         ? "(not checked: no reference row in --path)"
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
