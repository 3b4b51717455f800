// codec_perf's data sets and codec cases (codec_perf.h), shared by its CPU
// tables and its --gpu case.
#include <cinttypes>
#include <cstdio>
#include <string>
#include <vector>

#include "common/error.h"
#include "models/synthetic_kv.h"
#include "perf/codec_perf.h"
#include "perf/common/kv_data.h"

namespace codec_perf {

namespace km = kvxfer::model;

const char* impl_name(kc::Impl i) {
  switch (i) {
    case kc::Impl::REFERENCE: return "reference";
    case kc::Impl::SCALAR: return "scalar";
    case kc::Impl::AVX2: return "avx2";
    case kc::Impl::AVX512: return "avx512";
    default: return "auto";
  }
}

/** Prints a failed kvxfer call with the library's error text; returns false. */
bool report_failure(const std::string& what, kvxfer_result_t r) {
  std::fprintf(stderr, "codec_perf: %s failed: %s (%d): %s\n", what.c_str(),
               kvxfer_get_error_string(r), static_cast<int>(r), kvxfer::last_error());
  return false;
}

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
bool make_synth(const Options& o, int64_t T, Dataset* ds, bool k_only) {
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

uint64_t count_wrong(const uint8_t* a, size_t na, const uint8_t* b, size_t nb) {
  uint64_t w = na > nb ? na - nb : nb - na;
  for (size_t i = 0, n = std::min(na, nb); i < n; ++i) w += a[i] != b[i];
  return w;
}

std::string fmt2(double v) { return kp::strprintf("%.2f", v); }

std::string fmt4(double v) { return kp::strprintf("%.4f", v); }

}  // namespace codec_perf
