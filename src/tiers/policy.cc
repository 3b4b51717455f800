// SpectrumKV policy: budget mapping, token counts, importance and tier
// assignment (include/kvxfer/spectrum.h; docs/SPECTRUMKV.md defines every
// rule here and says where it reads the paper, arXiv:2606.08635).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

#include "codec/page.h"
#include "common/error.h"
#include "common/struct_abi.h"
#include "tiers/spectrum_impl.h"

namespace kvxfer::spectrum {
namespace {

/** The shortest digits that read back as `v`: 0.24999999999999997, not 0.25. */
std::string exact_digits(double v) {
  char b[40];
  std::snprintf(b, sizeof(b), "%.15g", v);
  if (std::strtod(b, nullptr) != v) std::snprintf(b, sizeof(b), "%.17g", v);
  return b;
}

const char* variant_name(kvxfer_spectrum_variant_t v) {
  switch (v) {
    case KVXFER_SPECTRUM_GREEDY: return "GREEDY";
    case KVXFER_SPECTRUM_SINK_PROTECT: return "SINK_PROTECT";
    case KVXFER_SPECTRUM_BALANCED: return "BALANCED";
    case KVXFER_SPECTRUM_RANDOM: return "RANDOM";
  }
  return "?";
}

bool needs_importance(kvxfer_spectrum_variant_t v) {
  return v == KVXFER_SPECTRUM_GREEDY || v == KVXFER_SPECTRUM_BALANCED;
}

// Draw k of the RANDOM variant's stream: splitmix64's output function of
// seed + (k + 1) * golden (docs/SPECTRUMKV.md, "Variants").
uint64_t draw(uint64_t seed, uint64_t k) {
  uint64_t z = seed + (k + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Recency factor exp(-lambda * Delta_j), Delta_j = n - 1 - j, in double.
double recency(float lambda, int64_t n, int64_t j) {
  return std::exp(-static_cast<double>(lambda) * static_cast<double>(n - 1 - j));
}

kvxfer_result_t check_lambda(float lambda) {
  KVXFER_REQUIRE(std::isfinite(lambda) && lambda >= 0.0f,
                 "lambda = %g must be finite and >= 0 (recency decay per token)",
                 static_cast<double>(lambda));
  return KVXFER_SUCCESS;
}

// Writes tiers for `order` (token indices) from the counts cnt[FP16..DROP].
void fill_in_order(const std::vector<int64_t>& order, const int64_t cnt[4], uint8_t* tiers) {
  size_t k = 0;
  for (int t = 0; t < 4; ++t)
    for (int64_t i = 0; i < cnt[t]; ++i) tiers[order[k++]] = static_cast<uint8_t>(t);
}

}  // namespace

kvxfer_result_t validate_config(const kvxfer_spectrum_config_t* c) {
  KVXFER_CHECK(check_struct_in_place(c));
  if (!(c->budget >= 0.25 && c->budget <= 1.0))
    return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                     "config->budget = %s is outside [0.25, 1] (fp16 = 1, int8 = 0.5, int4 = 0.25)",
                     exact_digits(c->budget).c_str());
  KVXFER_REQUIRE(c->sink_tokens >= 0, "config->sink_tokens = %d is negative", c->sink_tokens);
  KVXFER_REQUIRE(std::isfinite(c->lambda) && c->lambda >= 0.0f,
                 "config->lambda = %g must be finite and >= 0", static_cast<double>(c->lambda));
  const int32_t variant = c_enum_value(c->variant);
  KVXFER_REQUIRE(variant >= KVXFER_SPECTRUM_GREEDY && variant <= KVXFER_SPECTRUM_RANDOM,
                 "config->variant = %d is not a kvxfer_spectrum_variant_t", variant);
  KVXFER_REQUIRE(c->allow_int4 == 0 || c->allow_int4 == 1, "config->allow_int4 = %d is not 0 or 1",
                 c->allow_int4);
  KVXFER_REQUIRE(c->balance_tokens >= 1, "config->balance_tokens = %d must be >= 1",
                 c->balance_tokens);
  return KVXFER_SUCCESS;
}

void split_units(int64_t n, int64_t units, bool int4, int64_t out[4]) {
  out[0] = out[1] = out[2] = out[3] = 0;
  if (n <= 0) return;
  if (units >= 2 * n) {  // 2-tier: FP16 + INT8
    out[KVXFER_TIER_FP16] = std::min(n, (units - 2 * n) / 2);
    out[KVXFER_TIER_INT8] = n - out[KVXFER_TIER_FP16];
  } else if (int4) {  // 3-tier: INT8 + INT4, exact (units >= n)
    out[KVXFER_TIER_INT8] = units - n;
    out[KVXFER_TIER_INT4] = 2 * n - units;
  } else {  // INT8 + DROP
    out[KVXFER_TIER_INT8] = units / 2;
    out[KVXFER_TIER_DROP] = n - units / 2;
  }
}

kvxfer_result_t budget_fractions(double b, int32_t allow_int4, double* f) {
  KVXFER_REQUIRE(f != nullptr, "fractions is NULL");
  KVXFER_REQUIRE(b >= 0.25 && b <= 1.0, "budget = %s is outside [0.25, 1]",
                 exact_digits(b).c_str());
  KVXFER_REQUIRE(allow_int4 == 0 || allow_int4 == 1, "allow_int4 = %d is not 0 or 1", allow_int4);
  double out[4] = {0, 0, 0, 0};
  if (b >= 0.5) {
    out[KVXFER_TIER_FP16] = 2 * b - 1;
    out[KVXFER_TIER_INT8] = 2 - 2 * b;
  } else if (allow_int4) {
    out[KVXFER_TIER_INT8] = 4 * b - 1;
    out[KVXFER_TIER_INT4] = 2 - 4 * b;
  } else {
    out[KVXFER_TIER_INT8] = 2 * b;
    out[KVXFER_TIER_DROP] = 1 - 2 * b;
  }
  std::memcpy(f, out, sizeof(out));
  return KVXFER_SUCCESS;
}

/** I_j in float32: finite inputs give a finite importance (saturated at FLT_MAX). */
float to_importance(double x) {
  return static_cast<float>(std::min(x, static_cast<double>(std::numeric_limits<float>::max())));
}

int64_t budget_units(double b, int64_t n) {
  // 0.3 and 0.7 are not binary fractions: b is read as the nearest multiple
  // of 10^-9 (B = round(b 10^9), so 0.7 is exactly 7/10), then the product
  // is exact in 128 bits (4n <= 2^42, B <= 10^9).
  const auto B = static_cast<uint64_t>(std::llround(b * 1e9));
  const unsigned __int128 p = static_cast<unsigned __int128>(4 * static_cast<uint64_t>(n)) * B;
  return std::min<int64_t>(static_cast<int64_t>(p / 1000000000u), 4 * n);
}

kvxfer_result_t tier_counts(const kvxfer_spectrum_config_t* c, int64_t n, Counts* out) {
  KVXFER_CHECK(validate_config(c));
  KVXFER_REQUIRE(n >= 0 && n <= kMaxTokens, "num_tokens = %lld is outside [0, 2^40]",
                 static_cast<long long>(n));
  Counts r;
  if (n == 0) {
    *out = r;
    return KVXFER_SUCCESS;
  }
  const bool int4 = c->allow_int4 == 1;
  const int64_t units = budget_units(c->budget, n);
  // Sinks are paid for only while every other token keeps at least the
  // cheapest tier the budget mapping gives at this budget: INT8 from b = 1/2
  // up (so no INT4 or DROP appears there), else INT4 or, without it, DROP.
  const int64_t cheapest = units >= 2 * n ? 2 : (int4 ? 1 : 0);  // units per token
  const int64_t sinks = std::min<int64_t>(
      {static_cast<int64_t>(c->sink_tokens), n, (units - cheapest * n) / (4 - cheapest)});
  r.sinks = sinks;
  r.budget_units = units;
  int64_t rest[4];
  split_units(n - sinks, units - 4 * sinks, int4, rest);
  for (int t = 0; t < 4; ++t) r.count[t] = rest[t];
  r.count[KVXFER_TIER_FP16] += sinks;
  *out = r;
  return KVXFER_SUCCESS;
}

kvxfer_result_t importance_from_attention(const float* mass, int32_t rows, int64_t n, float lambda,
                                          float* importance) {
  KVXFER_REQUIRE(n >= 0 && n <= kMaxTokens, "num_tokens = %lld is outside [0, 2^40]",
                 static_cast<long long>(n));
  KVXFER_REQUIRE(rows >= 1, "num_rows = %d must be >= 1", rows);
  KVXFER_CHECK(check_lambda(lambda));
  if (n == 0) return KVXFER_SUCCESS;
  KVXFER_REQUIRE(mass != nullptr && importance != nullptr, "attention_mass or importance is NULL");
  std::vector<double> a(static_cast<size_t>(n), 0.0);
  for (int32_t r = 0; r < rows; ++r) {
    const float* row = mass + static_cast<size_t>(r) * static_cast<size_t>(n);
    for (int64_t j = 0; j < n; ++j) {
      KVXFER_REQUIRE(std::isfinite(row[j]) && row[j] >= 0.0f,
                     "attention_mass[row %d][token %lld] = %g is not a finite mass >= 0", r,
                     static_cast<long long>(j), static_cast<double>(row[j]));
      a[j] += row[j];
    }
  }
  for (int64_t j = 0; j < n; ++j) importance[j] = to_importance(a[j] * recency(lambda, n, j));
  return KVXFER_SUCCESS;
}

kvxfer_result_t importance_from_kv(const kvxfer_page_layout_t* pages, int32_t num_pages,
                                   float lambda, float* importance) {
  KVXFER_REQUIRE(pages != nullptr && importance != nullptr, "pages or importance is NULL");
  KVXFER_REQUIRE(num_pages >= 1, "num_pages = %d must be >= 1", num_pages);
  KVXFER_CHECK(check_lambda(lambda));
  std::vector<codec::Layout> lay(static_cast<size_t>(num_pages));
  const int64_t n = pages[0].num_tokens;
  for (int32_t p = 0; p < num_pages; ++p) {
    char what[32];
    std::snprintf(what, sizeof(what), "pages[%d]", p);
    KVXFER_CHECK(codec::validate_layout(&pages[p], what, &lay[p]));
    KVXFER_REQUIRE(pages[p].num_tokens == n,
                   "pages[%d] has %lld tokens, pages[0] has %lld: all pages must cover the same "
                   "tokens",
                   p, static_cast<long long>(pages[p].num_tokens), static_cast<long long>(n));
  }
  KVXFER_REQUIRE(n <= kMaxTokens, "num_tokens = %lld exceeds 2^40", static_cast<long long>(n));
  std::vector<double> a(static_cast<size_t>(n), 0.0);
  for (int32_t p = 0; p < num_pages; ++p) {
    const int32_t H = pages[p].num_channels;
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* row = lay[p].row(j);
      double ss = 0.0;
      for (int32_t c = 0; c < H; ++c) {
        const float v = codec::load_elem(row, c, pages[p].dtype);
        if (!std::isfinite(v))
          return set_error(KVXFER_ERR_NONFINITE, "%s in pages[%d], token %lld, channel %d",
                           std::isnan(v) ? "NaN" : "Inf", p, static_cast<long long>(j), c);
        ss += static_cast<double>(v) * v;
      }
      a[j] += std::sqrt(ss);
    }
  }
  for (int64_t j = 0; j < n; ++j) importance[j] = to_importance(a[j] * recency(lambda, n, j));
  return KVXFER_SUCCESS;
}

std::vector<int64_t> importance_order(const float* imp, int64_t begin, int64_t end) {
  std::vector<int64_t> order(static_cast<size_t>(end - begin));
  std::iota(order.begin(), order.end(), begin);
  std::sort(order.begin(), order.end(),
            [imp](int64_t a, int64_t b) { return imp[a] > imp[b] || (imp[a] == imp[b] && a > b); });
  return order;
}

kvxfer_result_t assign(const kvxfer_spectrum_config_t* c, int64_t n, const float* imp,
                       uint8_t* tiers) {
  Counts cnt;
  KVXFER_CHECK(tier_counts(c, n, &cnt));
  if (n == 0) return KVXFER_SUCCESS;
  KVXFER_REQUIRE(tiers != nullptr, "tiers is NULL");
  if (needs_importance(c->variant)) {
    KVXFER_REQUIRE(imp != nullptr, "importance is NULL (variant %s ranks by importance)",
                   variant_name(c->variant));
    for (int64_t j = 0; j < n; ++j)
      KVXFER_REQUIRE(std::isfinite(imp[j]), "importance[%lld] = %g is not finite",
                     static_cast<long long>(j), static_cast<double>(imp[j]));
  }
  const int64_t s = cnt.sinks;
  std::vector<uint8_t> out(static_cast<size_t>(n), KVXFER_TIER_DROP);
  std::fill(out.begin(), out.begin() + s, static_cast<uint8_t>(KVXFER_TIER_FP16));
  int64_t rest[4];
  for (int t = 0; t < 4; ++t) rest[t] = cnt.count[t];
  rest[KVXFER_TIER_FP16] -= s;
  switch (c->variant) {
    case KVXFER_SPECTRUM_GREEDY:
      fill_in_order(importance_order(imp, s, n), rest, out.data());
      break;
    case KVXFER_SPECTRUM_SINK_PROTECT: {
      std::vector<int64_t> order(static_cast<size_t>(n - s));
      for (size_t k = 0; k < order.size(); ++k) order[k] = n - 1 - static_cast<int64_t>(k);
      fill_in_order(order, rest, out.data());
      break;
    }
    case KVXFER_SPECTRUM_RANDOM: {
      std::vector<int64_t> order(static_cast<size_t>(n - s));
      std::iota(order.begin(), order.end(), s);
      uint64_t k = 0;
      for (size_t i = order.size(); i-- > 1;) {
        const uint64_t r = draw(c->seed, k++);
        const size_t j = static_cast<size_t>(
            (static_cast<unsigned __int128>(r) * static_cast<unsigned __int128>(i + 1)) >> 64);
        std::swap(order[i], order[j]);
      }
      fill_in_order(order, rest, out.data());
      break;
    }
    case KVXFER_SPECTRUM_BALANCED: {
      const int64_t m = n - s;  // non-sink tokens
      const int64_t units = cnt.budget_units - 4 * s;
      const int64_t w = c->balance_tokens;
      for (int64_t b = s; b < n; b += w) {
        const int64_t e = std::min(n, b + w), nw = e - b;
        const int64_t uw = static_cast<int64_t>(
            (static_cast<unsigned __int128>(units) * static_cast<unsigned __int128>(nw)) /
            static_cast<unsigned __int128>(m));
        int64_t cw[4];
        split_units(nw, uw, c->allow_int4 == 1, cw);
        fill_in_order(importance_order(imp, b, e), cw, out.data());
      }
      break;
    }
  }
  std::memcpy(tiers, out.data(), out.size());
  return KVXFER_SUCCESS;
}

kvxfer_result_t send_codec_config(const kvxfer_codec_config_t* codec, kvxfer_codec_config_t* out) {
  kvxfer_codec_config_t cc = KVXFER_CODEC_CONFIG_INITIALIZER;
  cc.codec = KVXFER_CODEC_SPECTRUM;
  if (codec != nullptr) KVXFER_CHECK(read_struct(codec, &cc));
  KVXFER_REQUIRE(cc.codec == KVXFER_CODEC_SPECTRUM,
                 "kvxfer_send_spectrum needs codec KVXFER_CODEC_SPECTRUM (or a NULL codec)");
  *out = cc;
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::spectrum
