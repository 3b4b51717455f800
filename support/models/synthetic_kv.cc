// Synthetic KV generator; see synthetic_kv.h for the exact definition.
#include "models/synthetic_kv.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace kvxfer::model {
namespace {

void set_error(std::string* error, const std::string& msg) {
  if (error != nullptr) *error = msg;
}

// Hash stream tags (the "kind" slot of the tuple).
enum Tag : std::uint64_t {
  kTagKeySample = 0,
  kTagValueSample = 1,
  kTagKeyChannelScale = 2,
  kTagOutlierSelect = 3,
  kTagOutlierAmp = 4,
  kTagValueTokenScale = 5,
};

inline std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

inline std::uint64_t hash_tuple(std::uint64_t seed, int layer, std::uint64_t tag,
                                std::uint64_t token, std::uint64_t channel) {
  std::uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<std::uint64_t>(layer));
  h = splitmix64(h ^ tag);
  h = splitmix64(h ^ token);
  h = splitmix64(h ^ channel);
  return h;
}

// Uniform in (0, 1) from the top 53 bits.
inline double to_uniform(std::uint64_t h) {
  return (static_cast<double>(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Laplace(0, 1) from a uniform in (0, 1).
inline double laplace(double u) {
  const double x = u - 0.5;
  const double mag = -std::log(1.0 - 2.0 * std::fabs(x));
  return x < 0.0 ? -mag : mag;
}

// Per-layer key channel properties.
struct KeyChannel {
  double scale;  // bulk scale s_c
  bool outlier;
  double mean;  // outlier mean m_c (signed), 0 for bulk
};

std::vector<int> select_outlier_pairs(const SyntheticKVSpec& s, int layer) {
  const int pairs_per_head = s.head_dim / 2;
  const int lo = pairs_per_head / 2;  // low-frequency half: pairs [lo, pairs_per_head)
  const int per_head = pairs_per_head - lo;
  const int n_cand = s.n_kv_heads * per_head;
  const int k = std::max(0, std::min(s.key_outlier_pairs, n_cand));
  std::vector<int> chosen;  // global pair indices (channel / 2)
  chosen.reserve(static_cast<std::size_t>(k));
  for (int slot = 0; slot < k; ++slot) {
    for (std::uint64_t attempt = 0;; ++attempt) {
      const std::uint64_t h =
          hash_tuple(s.seed, layer, kTagOutlierSelect, static_cast<std::uint64_t>(slot), attempt);
      const int idx = static_cast<int>(h % static_cast<std::uint64_t>(n_cand));
      const int pair = (idx / per_head) * pairs_per_head + lo + idx % per_head;
      if (std::find(chosen.begin(), chosen.end(), pair) == chosen.end()) {
        chosen.push_back(pair);
        break;
      }
    }
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

KeyChannel key_channel(const SyntheticKVSpec& s, int layer, int channel,
                       const std::vector<int>& outlier_pairs) {
  KeyChannel kc;
  kc.scale = 0.5 + to_uniform(hash_tuple(s.seed, layer, kTagKeyChannelScale, 0,
                                         static_cast<std::uint64_t>(channel)));
  kc.outlier = std::binary_search(outlier_pairs.begin(), outlier_pairs.end(), channel / 2);
  kc.mean = 0.0;
  if (kc.outlier) {
    const std::uint64_t h =
        hash_tuple(s.seed, layer, kTagOutlierAmp, 0, static_cast<std::uint64_t>(channel));
    const double mag = static_cast<double>(s.key_outlier_ratio) * std::sqrt(2.0) *
                       static_cast<double>(s.key_scale) * (0.75 + 0.5 * to_uniform(h));
    kc.mean = (h & 1u) ? -mag : mag;
  }
  return kc;
}

// Pre-RoPE key element.
inline double key_pre(const SyntheticKVSpec& s, int layer, std::int64_t token, int channel,
                      const KeyChannel& kc) {
  const double l =
      laplace(to_uniform(hash_tuple(s.seed, layer, kTagKeySample, static_cast<std::uint64_t>(token),
                                    static_cast<std::uint64_t>(channel))));
  if (kc.outlier) return kc.mean * (1.0 + static_cast<double>(s.outlier_jitter) * l);
  return static_cast<double>(s.key_scale) * kc.scale * l;
}

inline double value_token_scale(const SyntheticKVSpec& s, int layer, std::int64_t token) {
  return 0.5 + to_uniform(hash_tuple(s.seed, layer, kTagValueTokenScale,
                                     static_cast<std::uint64_t>(token), 0));
}

inline double value_elem(const SyntheticKVSpec& s, int layer, std::int64_t token, int channel,
                         double token_scale) {
  const double l = laplace(
      to_uniform(hash_tuple(s.seed, layer, kTagValueSample, static_cast<std::uint64_t>(token),
                            static_cast<std::uint64_t>(channel))));
  return static_cast<double>(s.value_scale) * token_scale * l;
}

// Inverse frequency of pair j (within a head).
inline double rope_freq(const SyntheticKVSpec& s, int j) {
  return std::pow(static_cast<double>(s.rope_theta),
                  -2.0 * static_cast<double>(j) / static_cast<double>(s.head_dim));
}

// Rotated element of pair (a = even channel, b = odd channel).
inline float rotate(double a, double b, double c, double sn, bool even) {
  return static_cast<float>(even ? a * c - b * sn : a * sn + b * c);
}

}  // namespace

bool validate_synthetic_kv_spec(const SyntheticKVSpec& s, std::string* error) {
  if (s.n_layers <= 0 || s.n_kv_heads <= 0 || s.head_dim <= 0) {
    set_error(error, "synthetic KV: n_layers, n_kv_heads and head_dim must be positive");
    return false;
  }
  if (s.head_dim % 2 != 0) {
    set_error(error, "synthetic KV: head_dim must be even (RoPE pairs)");
    return false;
  }
  if (static_cast<long long>(s.n_kv_heads) * s.head_dim > (1 << 20)) {
    set_error(error, "synthetic KV: n_kv_heads * head_dim too large");
    return false;
  }
  const float scales[] = {s.key_scale, s.value_scale, s.key_outlier_ratio, s.outlier_jitter};
  for (float v : scales) {
    if (!std::isfinite(v) || v < 0.0f) {
      set_error(error, "synthetic KV: scales must be finite and non-negative");
      return false;
    }
  }
  if (s.rope && !(std::isfinite(s.rope_theta) && s.rope_theta > 1.0f)) {
    set_error(error, "synthetic KV: rope_theta must be > 1");
    return false;
  }
  return true;
}

std::vector<int> synthetic_key_outlier_channels(const SyntheticKVSpec& spec, int layer) {
  std::vector<int> ch;
  for (int p : select_outlier_pairs(spec, layer)) {
    ch.push_back(2 * p);
    ch.push_back(2 * p + 1);
  }
  return ch;
}

float synthetic_kv_value(const SyntheticKVSpec& s, int layer, KVKind kind, std::int64_t token,
                         int channel) {
  if (kind == KVKind::kValue)
    return static_cast<float>(
        value_elem(s, layer, token, channel, value_token_scale(s, layer, token)));
  const std::vector<int> pairs = select_outlier_pairs(s, layer);
  const KeyChannel kc = key_channel(s, layer, channel, pairs);
  const double x = key_pre(s, layer, token, channel, kc);
  if (!s.rope) return static_cast<float>(x);
  const int partner = channel ^ 1;
  const KeyChannel kp = key_channel(s, layer, partner, pairs);
  const double y = key_pre(s, layer, token, partner, kp);
  const bool even = (channel & 1) == 0;
  const int j = (channel % s.head_dim) / 2;
  const double angle = static_cast<double>(token) * rope_freq(s, j);
  const double c = std::cos(angle), sn = std::sin(angle);
  return even ? rotate(x, y, c, sn, true) : rotate(y, x, c, sn, false);
}

bool fill_synthetic_kv(const SyntheticKVSpec& s, int layer, KVKind kind, std::int64_t token_begin,
                       std::int64_t n_tokens, float* out, std::size_t row_stride,
                       std::string* error) {
  if (!validate_synthetic_kv_spec(s, error)) return false;
  if (layer < 0 || layer >= s.n_layers) {
    set_error(error, "synthetic KV: layer " + std::to_string(layer) + " out of range");
    return false;
  }
  if (token_begin < 0 || n_tokens < 0) {
    set_error(error, "synthetic KV: negative token range");
    return false;
  }
  const int H = s.row_channels();
  if (row_stride == 0) row_stride = static_cast<std::size_t>(H);
  if (row_stride < static_cast<std::size_t>(H)) {
    set_error(error, "synthetic KV: row_stride below the row width");
    return false;
  }
  if (n_tokens == 0) return true;
  if (out == nullptr) {
    set_error(error, "synthetic KV: null output buffer");
    return false;
  }

  if (kind == KVKind::kValue) {
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n_tokens; ++i) {
      const std::int64_t t = token_begin + i;
      const double ts = value_token_scale(s, layer, t);
      float* row = out + static_cast<std::size_t>(i) * row_stride;
      for (int c = 0; c < H; ++c) row[c] = static_cast<float>(value_elem(s, layer, t, c, ts));
    }
    return true;
  }

  const std::vector<int> pairs = select_outlier_pairs(s, layer);
  std::vector<KeyChannel> chan(static_cast<std::size_t>(H));
  for (int c = 0; c < H; ++c) chan[c] = key_channel(s, layer, c, pairs);
  std::vector<double> freq(static_cast<std::size_t>(s.head_dim / 2));
  for (int j = 0; j < s.head_dim / 2; ++j) freq[j] = rope_freq(s, j);

#pragma omp parallel
  {
    std::vector<double> pre(static_cast<std::size_t>(H));
#pragma omp for schedule(static)
    for (std::int64_t i = 0; i < n_tokens; ++i) {
      const std::int64_t t = token_begin + i;
      float* row = out + static_cast<std::size_t>(i) * row_stride;
      for (int c = 0; c < H; ++c) pre[c] = key_pre(s, layer, t, c, chan[c]);
      if (!s.rope) {
        for (int c = 0; c < H; ++c) row[c] = static_cast<float>(pre[c]);
        continue;
      }
      for (int c = 0; c < H; c += 2) {
        const double angle = static_cast<double>(t) * freq[(c % s.head_dim) / 2];
        const double cs = std::cos(angle), sn = std::sin(angle);
        row[c] = rotate(pre[c], pre[c + 1], cs, sn, true);
        row[c + 1] = rotate(pre[c], pre[c + 1], cs, sn, false);
      }
    }
  }
  return true;
}

}  // namespace kvxfer::model
