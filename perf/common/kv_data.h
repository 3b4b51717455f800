// KV data shared by the kvxfer perf binaries (perf/codec_perf, perf/kvxfer_perf):
//   * the Llama-3-8B-like synthetic KV spec the benchmarks use;
//   * the "real" KV of a llama2.c checkpoint (stories260K): BOS, seq_len - 1
//     greedy tokens, then one prefill over all of them, each layer's K (after
//     RoPE) and V.
// Kept apart from the harness (perf/common/harness.h) so that only the
// binaries that need the model runner link kvxfer_models.
#pragma once

#include <string>
#include <vector>

#include "models/synthetic_kv.h"

namespace kvxfer::perf {

/**
 * The benchmarks' Llama-3-8B-like synthetic KV (models/synthetic_kv.h): seed 1,
 * n_layers layers, 8 KV heads x 128 head_dim, rope_theta 500000 (Llama-3); the
 * rest at the spec's defaults (4 outlier key pairs at 100x).
 */
model::SyntheticKVSpec llama3_8b_like_spec(int n_layers);

/** A checkpoint's greedy-prefill KV; see greedy_prefill_kv. */
struct GreedyPrefillKV {
  int tokens = 0;  // T: the checkpoint's seq_len
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::vector<int> ids;               // the T token ids: BOS (1), then T - 1 greedy tokens
  std::vector<std::vector<float>> k;  // per layer: float [T][H] (after RoPE)
  std::vector<std::vector<float>> v;  // per layer: float [T][H]

  // H: channels per token row, kv_heads * head_dim.
  int channels() const { return kv_heads * head_dim; }
};

/**
 * Loads the llama2.c checkpoint at `path`, generates from BOS (token 1) the
 * seq_len - 1 greedy (argmax) tokens by decode steps, prefills all seq_len
 * tokens once and keeps every layer's K and V.  Deterministic.  Returns false
 * with *err on a load, decode or prefill failure.
 */
bool greedy_prefill_kv(const std::string& path, GreedyPrefillKV* out, std::string* err);

}  // namespace kvxfer::perf
