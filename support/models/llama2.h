// Model runner for Llama-architecture checkpoints: llama2.c files (float32,
// e.g. stories260K) and GGUF files of llama.cpp (F32/F16 norms, Q4_1/Q8_0
// matrices, e.g. SmolLM2-135M-Instruct).
//
// Used by the benchmarks, tests and examples to produce *real* KV caches and
// queries, and to measure how a modified (e.g. quantized/dequantized) KV cache
// changes attention outputs and next-token logits.  Not part of the shipped
// library; it does not depend on kvxfer_core.
//
// Architecture (karpathy/llama2.c run.c; llama.cpp's LLM_ARCH_LLAMA):
// RMSNorm (eps from the file, 1e-5 for llama2.c), grouped-query attention,
// RoPE on adjacent pairs (2i, 2i+1) inside each head with frequency
// base^(-2i/head_size) (base 10000 for llama2.c, llama.rope.freq_base for
// GGUF, whose Q/K weights are stored permuted for this pairing), scores
// scaled by 1/sqrt(head_size), SwiGLU feed-forward w2(silu(w1 x) * w3 x).
// Float32 matrices keep run.c's summation order; quantized matrices use the
// products of models/qmatmul.h (activations quantized per 32-block, integer
// block dot products, one fixed float order).
//
// Data layout used throughout:
//   * K and V of one layer: float32, row-major [token][kv_dim] where
//     kv_dim = n_kv_heads * head_size and channel = kv_head * head_size + d
//     (heads outermost).  K rows are stored *after* RoPE.
//   * queries / attention outputs of one layer: float32 [pos][n_heads*head_size]
//     (= [pos][dim]), channel = head * head_size + d; queries after RoPE.
//
// Errors: no exception crosses this API (except std::bad_alloc on memory
// exhaustion).  Functions return bool and, on failure, write a message to
// *error when error != nullptr; outputs are then unspecified, but a caller-
// owned tail cache is left unmodified.
//
// Threading: a loaded Model is immutable; all const member functions may be
// called concurrently from several threads, provided each call has its own
// tail cache and output buffers.  Internally, matrix products and attention
// are parallelised with OpenMP over independent output elements; every output
// element is computed by one thread in a fixed order, so results are bit-
// identical regardless of the number of threads, and a batched pass (prefill,
// verify) gives every token the bits that decode_step gives it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "models/qmatmul.h"

namespace kvxfer::model {

namespace gguf {
class File;
struct TensorInfo;
}  // namespace gguf

// The 7-int32 llama2.c header.  vocab_size is stored positive;
// shared_classifier records the sign it had in the file (positive = the
// classifier reuses the token embedding; negative = a separate wcls follows).
struct Config {
  int dim = 0;         // model width
  int hidden_dim = 0;  // FFN width
  int n_layers = 0;
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads (GQA: n_heads % n_kv_heads == 0)
  int vocab_size = 0;
  int seq_len = 0;  // maximum number of positions
  bool shared_classifier = true;
  float rope_base = 10000.0f;  // RoPE frequency base
  float norm_eps = 1e-5f;      // RMSNorm epsilon
  std::string format;          // "llama2.c" or "gguf"
  std::string name;            // general.name of a GGUF, else the file name

  int head_size() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_size(); }
  int kv_group() const { return n_heads / n_kv_heads; }  // query heads per KV head
};

// Read-only view of one layer's K and V: row t of K starts at k + t*k_stride
// (float32, kv_dim elements), likewise for V.  Strides are in elements and
// must be >= kv_dim.  The view does not own the memory.
// drop: optional uint8 [n_tokens] attention mask: token t is absent (not
// transferred, e.g. a SpectrumKV DROP token or a keep/drop baseline) when
// drop[t] != 0, and every query of this layer then attends only to the
// present tokens (softmax renormalised over them).  nullptr = every token
// present; the arithmetic is then exactly that of a view without the field.
struct KVLayerView {
  const float* k = nullptr;
  const float* v = nullptr;
  std::size_t k_stride = 0;
  std::size_t v_stride = 0;
  const std::uint8_t* drop = nullptr;
};

// Read-only view of a KV cache: positions [0, n_tokens) of every layer.
// Built from a KVCache (KVCache::view) or from external buffers, e.g. a
// dequantized copy.  The viewed memory must stay alive and unchanged while
// the view is used.
struct KVView {
  int n_tokens = 0;
  std::vector<KVLayerView> layers;  // size n_layers
};

// Owning KV cache: per layer, K and V as float32 row-major [n_tokens][kv_dim]
// (contiguous, row stride kv_dim).  Used both for the prefill result and for
// the small mutable "tail" of decode_step/verify.  Appending (done by the
// model) may reallocate: pointers and views obtained earlier are invalidated
// by any call that changes n_tokens.  Not thread-safe for concurrent mutation.
class KVCache {
 public:
  KVCache() = default;
  KVCache(int n_layers, int kv_dim);

  int n_layers() const { return n_layers_; }
  int kv_dim() const { return kv_dim_; }
  int n_tokens() const { return n_tokens_; }
  bool empty() const { return n_tokens_ == 0; }

  // Layer base pointers ([n_tokens][kv_dim]); valid until n_tokens changes.
  float* k(int layer) { return k_[layer].data(); }
  float* v(int layer) { return v_[layer].data(); }
  const float* k(int layer) const { return k_[layer].data(); }
  const float* v(int layer) const { return v_[layer].data(); }

  // Sets n_tokens; new rows are zero.  Shrinking (truncate) discards the
  // last rows, e.g. rejected speculative tokens.
  void resize(int n_tokens);
  void truncate(int n_tokens) {
    if (n_tokens < n_tokens_) resize(n_tokens);
  }
  void clear() { resize(0); }
  void reserve(int n_tokens);

  // View of the first n_tokens positions (all of them when n_tokens < 0).
  KVView view(int n_tokens = -1) const;

 private:
  int n_layers_ = 0;
  int kv_dim_ = 0;
  int n_tokens_ = 0;
  std::vector<std::vector<float>> k_, v_;
};

struct PrefillOptions {
  bool record_queries = false;         // fill PrefillResult::queries
  bool all_logits = false;             // fill PrefillResult::all_logits
  bool record_attention_mass = false;  // fill PrefillResult::attention_mass
};

struct PrefillResult {
  KVCache kv;                      // positions 0..n-1
  std::vector<float> last_logits;  // [vocab_size], logits after the last token
  std::vector<float> all_logits;   // [n][vocab_size] if requested, else empty
  std::vector<float> queries;      // [n_layers][n][dim] (after RoPE) if requested
  // [n_layers][n_heads][n] if requested: attention_mass[l][h][j] = sum over
  // the prefill queries i >= j of the softmax probability p_l,h(i, j) that
  // query i of head h gave key j (float32 sums in ascending i; the input of
  // kvxfer_spectrum_importance_from_attention, one row per (layer, head)).
  // Needs n_heads * n * n floats of scratch per layer.
  std::vector<float> attention_mass;
};

class Model {
 public:
  // Loads a checkpoint, by its first bytes: a GGUF file ("GGUF" magic;
  // general.architecture "llama", tensors token_embd, output_norm, optional
  // output, blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm,
  // ffn_gate, ffn_up, ffn_down}; norms F32, matrices F32/Q4_1/Q8_0; the file
  // stays mapped) or else a llama2.c checkpoint (legacy "version 0" format: 7
  // int32 header, then float32 weights, little-endian; the header is
  // validated and the file size must equal exactly the size it implies).
  // Returns nullptr and sets *error (naming the field) on failure: "cannot
  // open model file" when it cannot be read; a file without the GGUF magic
  // that is no valid llama2.c checkpoint either says both.
  static std::unique_ptr<Model> load(const std::string& path, std::string* error);
  ~Model();

  // The GGUF file of a GGUF model (its metadata holds the tokenizer), else
  // nullptr.  Valid while the Model lives.
  const gguf::File* gguf_file() const { return gguf_.get(); }

  const Config& config() const { return cfg_; }

  // An empty cache shaped for this model (n_layers x kv_dim, 0 tokens).
  KVCache make_cache() const { return KVCache(cfg_.n_layers, cfg_.kv_dim()); }

  // Runs tokens at positions 0..n-1 in one batched pass (causal).  1 <= n <=
  // seq_len; every token in [0, vocab_size).
  bool prefill(const std::vector<int>& tokens, const PrefillOptions& options, PrefillResult* out,
               std::string* error) const;

  // One decoding step: `token` at position `pos`, attending to positions
  // [0, view.n_tokens) read through `view`, then to the tail rows (positions
  // view.n_tokens .. pos-1), then to itself.  Requirements:
  //   pos == view.n_tokens + tail->n_tokens(), pos < seq_len.
  // Appends this token's K/V to *tail (a default-constructed tail is shaped
  // automatically).  logits: resized to [vocab_size].  The view must not
  // point into *tail.
  //
  // Speculative decoding without copying the prefix: draft with
  // view = approximate KV and a draft tail; verify with view = full KV and a
  // separate verify tail; then truncate() the tails to the accepted length.
  bool decode_step(int token, int pos, const KVView& view, KVCache* tail,
                   std::vector<float>* logits, std::string* error) const;

  // Batched verification: runs draft[i] at position start_pos + i for all i in
  // ONE pass, each attending to the view, the existing tail rows and the
  // draft tokens before it (causal).  Same requirements as decode_step with
  // pos = start_pos; appends draft.size() rows to *tail.  logits: resized to
  // [draft.size()][vocab_size]; row i equals what decode_step would return
  // for draft[i] after decoding draft[0..i-1] on the same view.  (Typically
  // draft[0] is the last accepted token, so row i scores draft[i+1].)
  bool verify(const std::vector<int>& draft, int start_pos, const KVView& view, KVCache* tail,
              std::vector<float>* logits, std::string* error) const;
  // The same pass, calling layer_ready(l) before it first reads the view's
  // layer l, on the calling thread, layers in order; so the pass can start
  // while the view's later layers are still being written, each read only
  // once layer_ready(l) has returned true.  layer_ready returning false
  // stops the pass: verify returns false and leaves *error, *tail and
  // *logits unspecified.  The bits are those of verify without it.
  bool verify(const std::vector<int>& draft, int start_pos, const KVView& view, KVCache* tail,
              std::vector<float>* logits, std::string* error,
              const std::function<bool(int)>& layer_ready) const;

  // Teacher-forced scoring over a given KV, e.g. a transferred and
  // compressed copy of a prompt's own cache: tokens[i] runs at position
  // start_pos + i and attends to rows 0..start_pos+i of the view (its own row
  // included, as the view holds it; dropped rows skipped) and to nothing
  // else.  No K/V is computed or appended.  Requires 0 <= start_pos,
  // start_pos + tokens.size() <= view.n_tokens, and token 0 present in every
  // layer (so every query sees a key).  logits: resized to
  // [tokens.size()][vocab_size].  Over the prompt's own full-precision KV,
  // row i has the bits of prefill's all_logits row start_pos + i.
  bool score_over_view(const std::vector<int>& tokens, int start_pos, const KVView& view,
                       std::vector<float>* logits, std::string* error) const;

  // Attention outputs of recorded queries against a (possibly modified) view,
  // for every layer: queries and out are [n_layers][n_q][dim]; query i of a
  // layer is at position q_pos0 + i and attends to keys 0..q_pos0+i of the
  // view (requires q_pos0 + n_q <= view.n_tokens).  out excludes the wo
  // projection (it is the per-head softmax(q k^T/sqrt(hs)) v, concatenated).
  bool attention_outputs(const float* queries, int n_q, int q_pos0, const KVView& view, float* out,
                         std::string* error) const;

 private:
  struct LayerWeights {
    const float* rms_att;  // [dim]
    WeightMatrix wq;       // [dim][dim]
    WeightMatrix wk;       // [kv_dim][dim]
    WeightMatrix wv;       // [kv_dim][dim]
    WeightMatrix wo;       // [dim][dim]
    const float* rms_ffn;  // [dim]
    WeightMatrix w1;       // gate [hidden][dim]
    WeightMatrix w2;       // down [dim][hidden]
    WeightMatrix w3;       // up [hidden][dim]
  };

  Model() = default;
  static std::unique_ptr<Model> load_llama2c(const std::string& path, std::string* error);
  static std::unique_ptr<Model> load_gguf(const std::string& path, std::string* error);
  bool check_view(const KVView& view, std::string* error) const;
  // Batched forward of tokens at positions start_pos.. over view + tail
  // (tail == nullptr: over the view only, as score_over_view).
  // logits_rows: 0 = none, 1 = last row only, 2 = all rows.
  // att_mass: if non-null (prefill only: empty view and tail), filled as
  // PrefillResult::attention_mass.
  bool forward(const std::vector<int>& tokens, int start_pos, const KVView& view, KVCache* tail,
               int logits_rows, std::vector<float>* logits, std::vector<float>* queries,
               std::string* error, std::vector<float>* att_mass = nullptr,
               const std::function<bool(int)>* layer_ready = nullptr) const;

  Config cfg_;
  std::vector<float> data_;           // llama2.c: all float32 weights of the file
  std::unique_ptr<gguf::File> gguf_;  // GGUF: the mapped file the weights point into
  // GGUF on an AVX-512 CPU: every block matrix repacked (qmatmul.h
  // pack_weights), 64-byte aligned; the matrices' `packed` point into it.
  struct AlignedDelete {
    void operator()(std::uint8_t* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<std::uint8_t[], AlignedDelete> packed_;
  std::vector<LayerWeights> layers_;
  WeightMatrix token_embedding_{};    // [vocab][dim]
  const float* rms_final_ = nullptr;  // [dim]
  WeightMatrix wcls_{};               // [vocab][dim]
};

// Shape of a (GQA) attention computation.
struct AttentionShape {
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_size = 0;
};

// Causal attention of one layer: q is [n_q][n_heads*head_size] with row
// stride q_stride (elements; 0 = n_heads*head_size); query i is at position
// q_pos0 + i and attends to keys [0, q_pos0 + i] of kv (so q_pos0 + n_q <=
// n_kv_tokens is required), skipping keys that kv.drop marks absent (a query
// that sees no present key gets a zero output).  Query head h uses KV head h / (n_heads /
// n_kv_heads).  out: [n_q][n_heads*head_size] contiguous, the per-head
// softmax(q k^T / sqrt(head_size)) v.  Deterministic; parallel over queries
// and heads.
bool attention(const AttentionShape& shape, const KVLayerView& kv, int n_kv_tokens, const float* q,
               std::size_t q_stride, int n_q, int q_pos0, float* out, std::string* error);

// vNMSE = ||approx - ref||^2 / ||ref||^2, accumulated in double (0 when both
// are zero; +inf when only ref is zero).
double vnmse(const float* ref, const float* approx, std::size_t n);

// Index of the largest element (first one on ties); -1 when n == 0.
int argmax(const float* x, std::size_t n);

}  // namespace kvxfer::model
