#include "codec/codebook.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "codec/detmath.h"

namespace kvxfer::codec {

bool valid_chunk_tokens(int c) { return c == 16 || c == 32 || c == 64 || c == 128; }

uint8_t Codebook::encode_threshold(float z) const {
  const float v = sign_magnitude ? std::fabs(z) : z;
  unsigned q = 0;
  while (q < thresholds.size() && v >= thresholds[q]) ++q;
  if (sign_magnitude && z < 0.0f) q |= 0x80u;
  return static_cast<uint8_t>(q);
}

namespace {

// Inverse of the alpha-law (Lynx Algorithm 1, companding step): the |z| at which Y = y.
double alpha_law_inverse(double alpha, double y) {
  if (alpha == 0.0) return y / 127.0;
  return detmath::expm1(y / 127.0 * detmath::log1p(alpha)) / alpha;
}

// Bin of code `c` in z: [lo, hi].
void code_bin(const Codebook& cb, unsigned c, double* lo, double* hi) {
  const auto& t = cb.thresholds;
  if (cb.sign_magnitude) {
    const unsigned q = c & 0x7Fu;
    const double mlo = q == 0 ? 0.0 : t[q - 1];
    const double mhi = q == 127 ? 1.0 : t[q];
    if (c & 0x80u) {
      *lo = -mhi;
      *hi = -mlo;
    } else {
      *lo = mlo;
      *hi = mhi;
    }
  } else {
    const unsigned last = (1u << cb.code_bits) - 1;
    *lo = c == 0 ? -1.0 : t[c - 1];
    *hi = c == last ? 1.0 : t[c];
  }
}

void build_tables(Codebook* cb) {
  const unsigned ncodes = 1u << cb->code_bits;
  double mhw = 0.0;
  for (unsigned c = 0; c < ncodes; ++c) {
    double lo, hi;
    code_bin(*cb, c, &lo, &hi);
    // Linear codes at their level (the extremes at +-1), alpha-law codes at
    // the centre of their bin (docs/FORMAT.md 2.4).
    cb->recon_full[c] = cb->kind == CODE_LUT ? static_cast<float>(0.5 * (lo + hi))
                                             : recon_linear(cb->kind, c, cb->recon_step);
    const double r = cb->recon_full[c];
    mhw = std::max(mhw, std::max(r - lo, hi - r));
  }
  cb->max_half_width_full = mhw;

  // An anchor is the run of codes sharing the top A bits.  In both code
  // layouts that run is contiguous in z, so its bin is [lo(first), hi(last)]
  // for positive runs; min/max covers the mirrored negative runs too.
  const unsigned nanchors = 1u << cb->anchor_bits;
  const unsigned run = 1u << cb->residual_bits;
  double ahw = 0.0;
  for (unsigned a = 0; a < nanchors; ++a) {
    double lo = 2.0, hi = -2.0;
    for (unsigned c = a * run; c < (a + 1) * run; ++c) {
      double l, h;
      code_bin(*cb, c, &l, &h);
      lo = std::min(lo, l);
      hi = std::max(hi, h);
    }
    // Without a residual the anchor is the code itself (INT4): its level.
    // The nested code's 4-bit anchor is INT4's code: INT4's level, the same float.
    cb->recon_anchor[a] = cb->residual_bits == 0 ? cb->recon_full[a]
                          : !has_anchor_table(*cb)
                              ? recon_linear(CODE_UNIFORM, a, f_div(2.0f, 15.0f))
                              : static_cast<float>(0.5 * (lo + hi));
    cb->anchor_lo[a] = static_cast<float>(lo);  // bin edges are floats already
    cb->anchor_hi[a] = static_cast<float>(hi);
    const double r = cb->recon_anchor[a];
    ahw = std::max(ahw, std::max(r - lo, hi - r));
  }
  cb->max_half_width_anchor = ahw;

  // Fast-path lookup: smallest power-of-two cell count with <= 1 threshold
  // strictly inside every cell.
  const auto& t = cb->thresholds;
  const double dom_lo = cb->sign_magnitude ? 0.0 : -1.0;
  for (int lg = 4; lg <= 22; ++lg) {
    const double n = std::ldexp(1.0, lg);
    const int origin = cb->sign_magnitude ? 0 : (1 << lg);
    const int cells = static_cast<int>((1.0 - dom_lo) * n) + 1;
    std::vector<int32_t> base(cells);
    std::vector<float> next(cells);
    bool ok = true;
    size_t k = 0;
    for (int i = 0; i < cells && ok; ++i) {
      const double start = (i - origin) / n, end = (i - origin + 1) / n;
      while (k < t.size() && t[k] <= start) ++k;
      base[i] = static_cast<int32_t>(k);
      next[i] = k < t.size() ? t[k] : std::numeric_limits<float>::infinity();
      if (k + 1 < t.size() && t[k + 1] < end) ok = false;
    }
    if (ok) {
      cb->lut_log2 = lg;
      cb->lut_origin = origin;
      cb->lut_base = std::move(base);
      cb->lut_next = std::move(next);
      if (cb->sign_magnitude) {
        cb->lut_base8.assign(cb->lut_base.size() + 3, 0);
        for (size_t j = 0; j < cb->lut_base.size(); ++j)
          cb->lut_base8[j] = static_cast<uint8_t>(cb->lut_base[j]);
        for (int k = 0; k < 128; ++k)
          cb->thresholds_inf[k] =
              k < 127 ? t[static_cast<size_t>(k)] : std::numeric_limits<float>::infinity();
      }
      return;
    }
  }
  // Unreachable for alpha <= kMaxAlpha (the finest bin is wider than 2^-22).
  std::abort();
}

std::unique_ptr<Codebook> make_codebook(kvxfer_codec_t codec, float alpha, int anchor_bits) {
  auto cb = std::make_unique<Codebook>();
  std::memset(cb->recon_full, 0, sizeof(cb->recon_full));
  std::memset(cb->recon_anchor, 0, sizeof(cb->recon_anchor));
  std::memset(cb->anchor_lo, 0, sizeof(cb->anchor_lo));
  std::memset(cb->anchor_hi, 0, sizeof(cb->anchor_hi));
  cb->codec = codec;
  cb->alpha = codec == KVXFER_CODEC_LYNX ? alpha : 0.0f;
  cb->code_bits = codec == KVXFER_CODEC_INT4 ? 4 : 8;
  cb->anchor_bits = anchor_bits;
  cb->residual_bits = cb->code_bits - anchor_bits;
  cb->sign_magnitude = codec == KVXFER_CODEC_LYNX;
  const int levels = 1 << cb->code_bits;
  if (codec != KVXFER_CODEC_LYNX) {
    cb->kind = CODE_UNIFORM;
    cb->scale_num = 0.5f * static_cast<float>(levels - 1);  // 127.5, 7.5: exact
    cb->bias = cb->scale_num + 0.5f;
    cb->max_code = levels - 1;
    cb->recon_step = f_div(2.0f, static_cast<float>(levels - 1));
  } else if (cb->alpha == 0.0f) {
    cb->kind = CODE_NEST;
    cb->sign_magnitude = false;
    cb->scale_num = 240.0f;
    cb->bias = 256.0f;
    cb->max_code = 255;
    cb->recon_step = f_div(1.0f, 480.0f);
  } else {
    cb->kind = CODE_LUT;
    cb->scale_num = 1.0f;
    cb->bias = 0.0f;
    cb->max_code = 127;
    cb->recon_step = 0.0f;
  }
  if (cb->kind == CODE_NEST) {
    // The lower edge of code k + 1, at y = 256 + 240 z (codec_math.h nest_code).
    for (int k = 0; k < 255; ++k) {
      const int c = k + 1, y = c < 16 ? 16 + c : (c < 240 ? 2 * c : c + 240);
      cb->thresholds.push_back(static_cast<float>((y - 256) / 240.0));
    }
  } else if (cb->sign_magnitude) {
    // q = round(Y) = #{k : Y >= k + 1/2} = #{k : |z| >= g(k + 1/2)}.
    for (int k = 0; k < 127; ++k)
      cb->thresholds.push_back(static_cast<float>(alpha_law_inverse(cb->alpha, k + 0.5)));
  } else {
    // q = round((z + 1)/2 * (L - 1)): thresholds halfway between levels.
    for (int k = 0; k + 1 < levels; ++k)
      cb->thresholds.push_back(static_cast<float>(-1.0 + (2.0 * k + 1.0) / (levels - 1)));
  }
  build_tables(cb.get());
  return cb;
}

}  // namespace

void anchor_table_from_histogram(const Codebook& cb, const uint64_t* hist, float* table) {
  // One definition of the arithmetic, shared with the CUDA kernels.
  for (unsigned a = 0; a < (1u << cb.anchor_bits); ++a)
    table[a] = anchor_table_entry(hist, cb.recon_full, cb.recon_anchor[a], cb.anchor_lo[a],
                                  cb.anchor_hi[a], a, static_cast<unsigned>(cb.residual_bits));
}

bool anchor_table_valid(const Codebook& cb, const float* table) {
  for (unsigned a = 0; a < (1u << cb.anchor_bits); ++a)
    if (!(table[a] >= cb.anchor_lo[a] && table[a] <= cb.anchor_hi[a])) return false;  // NaN fails
  return true;
}

CodebookRef get_codebook(kvxfer_codec_t codec, float alpha, int anchor_bits, std::string* why) {
  switch (codec) {
    case KVXFER_CODEC_LYNX:
      if (!(alpha >= 0.0f && alpha <= kMaxAlpha)) {
        *why = "alpha must be in [0, 1000]";
        return nullptr;
      }
      [[fallthrough]];
    case KVXFER_CODEC_INT8:
      if (anchor_bits < 2 || anchor_bits > 6) {
        *why = "anchor_bits must be 2..6 for LYNX and INT8";
        return nullptr;
      }
      break;
    case KVXFER_CODEC_INT4:
      if (anchor_bits != 4) {
        *why = "anchor_bits must be 4 for INT4 (anchor only)";
        return nullptr;
      }
      break;
    default: *why = "codec has no codebook"; return nullptr;
  }
  using Key = std::tuple<int, uint32_t, int>;
  static std::mutex mu;
  static std::map<Key, CodebookRef> cache;
  static std::deque<Key> order;  // insertion order, oldest first
  uint32_t abits = 0;
  const float a = codec == KVXFER_CODEC_LYNX && alpha != 0.0f ? alpha : 0.0f;  // -0 == +0
  std::memcpy(&abits, &a, sizeof(abits));
  const Key key = std::make_tuple(static_cast<int>(codec), abits, anchor_bits);
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  CodebookRef made = make_codebook(codec, a, anchor_bits);  // built outside the lock
  std::lock_guard<std::mutex> lk(mu);
  auto ins = cache.emplace(key, made);
  if (!ins.second) return ins.first->second;  // another thread built it first
  order.push_back(key);
  if (order.size() > kCodebookCacheSize) {
    cache.erase(order.front());
    order.pop_front();
  }
  return made;
}

}  // namespace kvxfer::codec
