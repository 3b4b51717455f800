// External KV quantization baselines (INT8 per token, KIVI-style INT4/INT2).
// Definitions and citations: kv_baselines.h.
#include "kv_baselines.h"

#include <cmath>
#include <limits>

#include "codec/page.h"  // exact binary16 conversions (f32_to_f16, f16_to_f32, f32_to_f16_up)

namespace kvxfer::baselines {
namespace {

using codec::f16_to_f32;
using codec::f32_to_f16;
using codec::f32_to_f16_up;

/** Largest binary16 value <= f (finite f within the binary16 range). */
float f16_round_down(float f) {
  uint16_t h = f32_to_f16(f);
  float r = f16_to_f32(h);
  if (r > f) {
    if (f >= 0.0f) {
      h = static_cast<uint16_t>(h - 1);  // r > f >= 0: h is a positive non-zero pattern
    } else if ((h & 0x7FFFu) == 0) {
      h = 0x8001u;  // r = +-0 > f: smallest negative subnormal
    } else if (h & 0x8000u) {
      h = static_cast<uint16_t>(h + 1);  // negative: one more unit of magnitude
    } else {
      h = 0x8001u;  // cannot happen (r > f with f < 0 and r > 0 would need r = +tiny)
    }
    r = f16_to_f32(h);
  }
  return r;
}

/** Smallest binary16 value >= f, f >= 0. */
float f16_round_up_nonneg(float f) { return f16_to_f32(f32_to_f16_up(f)); }

void set_error(std::string* e, const std::string& m) {
  if (e != nullptr) *e = m;
}

}  // namespace

GroupParams group_params(float mn, float mx, int bits) {
  GroupParams p;
  p.min = f16_round_down(mn + 0.0f);
  if (!(mx > p.min)) {  // constant group (mx == mn and mn exact in binary16)
    p.scale = 0.0f;
    return p;
  }
  const int L = (1 << bits) - 1;
  p.scale = f16_round_up_nonneg((mx - p.min) / static_cast<float>(L));
  // The stored grid must reach max: bump the step while it does not (float
  // rounding of mx - min can lose up to an ulp).
  while (std::isfinite(p.scale) &&
         static_cast<double>(p.min) + static_cast<double>(L) * p.scale < static_cast<double>(mx))
    p.scale = f16_to_f32(static_cast<uint16_t>(f32_to_f16(p.scale) + 1));
  return p;
}

unsigned quantize(float x, const GroupParams& p, int bits) {
  if (!(p.scale > 0.0f)) return 0;
  const float L = static_cast<float>((1 << bits) - 1);
  const float u = (x - p.min) / p.scale;
  const float r = std::nearbyint(u);  // default rounding mode: half to even (torch.round)
  const float c = r < 0.0f ? 0.0f : (r > L ? L : r);
  return static_cast<unsigned>(c);
}

double error_bound(const GroupParams& p, int bits, float x_hat) {
  const double L = static_cast<double>((1 << bits) - 1);
  const double e = std::ldexp(1.0, -23);
  return p.scale * (0.5 + (L + 1.0) * e) + e * (std::fabs(p.min) + std::fabs(x_hat));
}

std::int64_t num_groups(std::int64_t T, int H, GroupAxis axis, int group) {
  if (axis == GroupAxis::kPerToken) return T * ((H + group - 1) / group);
  return ((T + group - 1) / group) * H;
}

std::int64_t group_index(std::int64_t t, int h, std::int64_t T, int H, GroupAxis axis, int group) {
  (void)T;
  if (axis == GroupAxis::kPerToken) return t * ((H + group - 1) / group) + h / group;
  return (t / group) * H + h;
}

double storage_bits(std::int64_t T, int H, GroupAxis axis, int group, int bits) {
  return static_cast<double>(T) * H * bits +
         32.0 * static_cast<double>(num_groups(T, H, axis, group));
}

bool quantize_page(const float* x, std::int64_t T, int H, std::size_t stride, GroupAxis axis,
                   int group, int bits, QuantizedPage* out, std::string* error) {
  if (x == nullptr && T > 0) return set_error(error, "null input"), false;
  if (T < 0 || H < 1 || stride < static_cast<std::size_t>(H) || group < 1 || bits < 1 || bits > 8)
    return set_error(error, "bad page shape, group or bits"), false;
  const std::int64_t G = num_groups(T, H, axis, group);
  std::vector<float> mn(G, std::numeric_limits<float>::infinity());
  std::vector<float> mx(G, -std::numeric_limits<float>::infinity());
  for (std::int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      const float v = x[t * stride + h];
      if (!(std::fabs(v) <= 65504.0f))
        return set_error(error, "element (" + std::to_string(t) + ", " + std::to_string(h) +
                                    ") is not finite or beyond the binary16 range"),
               false;
      const std::int64_t g = group_index(t, h, T, H, axis, group);
      if (v < mn[g]) mn[g] = v;
      if (v > mx[g]) mx[g] = v;
    }
  out->params.resize(G);
  for (std::int64_t g = 0; g < G; ++g) {
    out->params[g] = group_params(mn[g], mx[g], bits);
    if (!std::isfinite(out->params[g].scale))
      return set_error(error, "group range beyond the binary16 scale range"), false;
  }
  out->codes.resize(static_cast<std::size_t>(T) * H);
  out->recon.resize(static_cast<std::size_t>(T) * H);
  for (std::int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      const GroupParams& p = out->params[group_index(t, h, T, H, axis, group)];
      const unsigned q = quantize(x[t * stride + h], p, bits);
      out->codes[t * H + h] = static_cast<std::uint8_t>(q);
      out->recon[t * H + h] = dequantize(q, p);
    }
  return true;
}

const char* baseline_name(Baseline b) {
  switch (b) {
    case Baseline::kInt8PerToken: return "INT8/token";
    case Baseline::kInt4PerToken: return "INT4/token";
    case Baseline::kKiviInt4: return "KIVI-INT4";
    case Baseline::kKiviInt2: return "KIVI-INT2";
  }
  return "?";
}

int baseline_bits(Baseline b) {
  switch (b) {
    case Baseline::kInt8PerToken: return 8;
    case Baseline::kInt4PerToken: return 4;
    case Baseline::kKiviInt4: return 4;
    case Baseline::kKiviInt2: return 2;
  }
  return 0;
}

void baseline_layout(Baseline b, bool is_key, int H, GroupAxis* axis, int* group) {
  if (b == Baseline::kInt8PerToken || b == Baseline::kInt4PerToken) {
    *axis = GroupAxis::kPerToken;
    *group = H;
    return;
  }
  *axis = is_key ? GroupAxis::kPerChannel : GroupAxis::kPerToken;
  *group = kKiviGroup;
}

}  // namespace kvxfer::baselines
