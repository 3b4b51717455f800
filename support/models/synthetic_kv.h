// Synthetic KV cache with the qualitative statistics reported for large
// Llama-style models, for benchmarks at shapes the reference model does not
// have (up to 32 layers x 8 KV heads x 128 head_dim and long contexts).
//
// Statistics modelled (and where they come from):
//   * Keys have a few *persistent outlier channels*: fixed channel indices per
//     layer whose magnitude is far above the rest on every token.  This is the
//     observation behind per-channel key quantization in KIVI (Liu et al.,
//     "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML
//     2024) and KVQuant (Hooper et al., "KVQuant: Towards 10 Million Context
//     Length LLM Inference with KV Cache Quantization", NeurIPS 2024), and is
//     related to the outlier features / massive activations of LLMs (Dettmers
//     et al., "LLM.int8()", 2022; Sun et al., "Massive Activations in Large
//     Language Models", COLM 2024).  Here: key_outlier_pairs RoPE pairs per
//     layer (2 channels each), chosen among the low-frequency half of each
//     head's pairs, with RMS ~ key_outlier_ratio (default 100) times the
//     nominal bulk RMS.  The 100x default is the stressful end of what these
//     papers show; use a smaller ratio for a milder model.
//   * Keys are stored *after* RoPE (as a serving engine caches them): KVQuant
//     notes that RoPE mixes each pair across tokens, which is why it
//     quantizes pre-RoPE keys.  We generate pre-RoPE keys and rotate pair
//     (2i, 2i+1) of each head by angle token * theta^(-2i/head_dim)
//     (adjacent-pair convention of llama2.c / Meta's reference code).
//   * Values have no outlier channels (KIVI: values show no channel-wise
//     outlier pattern, hence per-token value quantization); they get a per-
//     token scale instead.
//   * The bulk of both is Laplacian (heavy-tailed relative to a Gaussian, a
//     common model for activation distributions), with a per-channel scale
//     in [0.5, 1.5) for keys and a per-token scale in [0.5, 1.5) for values.
//
// Exact definition (all randomness is counter-based, so any slice can be
// regenerated independently, by any process, in any order):
//   H(tag, token, channel) = splitmix64 chain of (seed, layer, tag, token,
//   channel); U = (top 53 bits + 0.5) / 2^53 in (0,1); Laplace(b) =
//   -b sgn(U-1/2) ln(1 - 2|U-1/2|).  Channel c = kv_head * head_dim + d.
//   Keys, pre-RoPE:   bulk  k0 = key_scale * s_c * Laplace(1),
//                     s_c = 0.5 + U(key-channel-scale, 0, c)
//                     outlier channel c (in pair j): k0 = m_c * (1 +
//                     outlier_jitter * Laplace(1)), m_c = +-key_outlier_ratio
//                     * sqrt(2) * key_scale * (0.75 + 0.5 U(amp, 0, c)).
//   Keys:             k = RoPE_token(k0) when rope, else k0.
//   Values:           v = value_scale * s_t * Laplace(1),
//                     s_t = 0.5 + U(value-token-scale, token, 0).
// Arithmetic is done in double and rounded to float once, so a value is a pure
// function of (spec, layer, kind, token, channel); fill_synthetic_kv returns
// exactly the same bits as synthetic_kv_value (same libm).
//
// Thread-safety: all functions are pure; fill_synthetic_kv uses OpenMP over
// tokens and its output does not depend on the thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvxfer::model {

enum class KVKind : int { kKey = 0, kValue = 1 };

struct SyntheticKVSpec {
  std::uint64_t seed = 0;
  int n_layers = 32;
  int n_kv_heads = 8;
  int head_dim = 128;  // even (RoPE pairs)

  float key_scale = 1.0f;            // Laplace b of the key bulk (RMS = b*sqrt(2)*~1.04)
  float value_scale = 1.0f;          // Laplace b of the value bulk
  int key_outlier_pairs = 4;         // outlier RoPE pairs per layer (clamped to candidates)
  float key_outlier_ratio = 100.0f;  // outlier RMS / nominal bulk RMS (b*sqrt(2))
  float outlier_jitter = 0.1f;       // relative per-token Laplace jitter of outliers
  bool rope = true;                  // rotate keys by token position
  float rope_theta = 10000.0f;       // 10000 (Llama-2); 500000 for Llama-3

  // Channels per row: n_kv_heads * head_dim.
  int row_channels() const { return n_kv_heads * head_dim; }
};

// Checks the spec (positive shape, even head_dim, finite non-negative
// scales).  The other functions assume a valid spec.
bool validate_synthetic_kv_spec(const SyntheticKVSpec& spec, std::string* error);

// The key outlier channels of `layer`, ascending (2 per outlier pair).
std::vector<int> synthetic_key_outlier_channels(const SyntheticKVSpec& spec, int layer);

// One element: layer in [0, n_layers), token >= 0, channel in
// [0, row_channels()).  O(key_outlier_pairs^2) hashing per call for keys;
// use fill_synthetic_kv for bulk generation.
float synthetic_kv_value(const SyntheticKVSpec& spec, int layer, KVKind kind, std::int64_t token,
                         int channel);

// Fills out[(t - token_begin) * row_stride + c] for tokens
// [token_begin, token_begin + n_tokens) and channels [0, row_channels()),
// i.e. a float32 row-major [n_tokens][H] page (row_stride in elements, 0 = H,
// must be >= H).  Padding between rows is left untouched.  Multithreaded
// (OpenMP).  Returns false (with *error) on an invalid spec or arguments.
bool fill_synthetic_kv(const SyntheticKVSpec& spec, int layer, KVKind kind,
                       std::int64_t token_begin, std::int64_t n_tokens, float* out,
                       std::size_t row_stride, std::string* error);

}  // namespace kvxfer::model
