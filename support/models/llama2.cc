// Reference llama2.c runner; see llama2.h.  The arithmetic follows
// karpathy/llama2.c run.c operation by operation (float32, same summation
// order), batched over tokens.
#include "models/llama2.h"

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <sstream>

#include "models/attention_kernels.h"
#include "models/gguf.h"

namespace kvxfer::model {
namespace {

using detail::attend_head;
using detail::Segment;

void set_error(std::string* error, const std::string& msg) {
  if (error != nullptr) *error = msg;
}

// Work (multiply-adds) below which a parallel region costs more than it saves.
constexpr std::int64_t kParallelWork = 1 << 15;

// A 64-byte aligned allocator: matmul reads activations with aligned loads
// and copies any that are not (qmatmul.h).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}  // NOLINT(google-explicit-constructor): the allocator model
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete (p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const Aligned64<U>&) const {
    return true;
  }
  template <class U>
  bool operator!=(const Aligned64<U>&) const {
    return false;
  }
};
using Activations = std::vector<float, Aligned64<float>>;

// Row-wise RMSNorm: o = weight * (x / sqrt(mean(x^2) + eps)), each row's
// sum of squares in run.c's order (j ascending, one float accumulator).  The
// sums of up to 8 rows run side by side, so a batched pass does not wait on
// one add chain at a time.
void rmsnorm(float* o, const float* x, const float* weight, int n_rows, int size, float eps) {
  constexpr int kRows = 8;
  const int groups = (n_rows + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (groups > 1 && n_rows * size >= 4096)
  for (int gi = 0; gi < groups; ++gi) {
    const int t0 = gi * kRows, nr = n_rows - t0 < kRows ? n_rows - t0 : kRows;
    float ss[kRows] = {0, 0, 0, 0, 0, 0, 0, 0};
    const float* x0 = x + static_cast<std::size_t>(t0) * size;
    for (int j = 0; j < size; ++j)
      for (int r = 0; r < nr; ++r) {
        const float v = x0[static_cast<std::size_t>(r) * size + j];
        ss[r] += v * v;
      }
    for (int r = 0; r < nr; ++r) {
      const float* xr = x0 + static_cast<std::size_t>(r) * size;
      float* orow = o + static_cast<std::size_t>(t0 + r) * size;
      float s = ss[r] / static_cast<float>(size);
      s += eps;
      s = 1.0f / std::sqrt(s);
      for (int j = 0; j < size; ++j) orow[j] = weight[j] * (s * xr[j]);
    }
  }
}

bool host_is_little_endian() {
  const std::uint32_t one = 1;
  unsigned char b;
  std::memcpy(&b, &one, 1);
  return b == 1;
}

}  // namespace

// ---------------------------------------------------------------------------
// KVCache
// ---------------------------------------------------------------------------
KVCache::KVCache(int n_layers, int kv_dim)
    : n_layers_(n_layers < 0 ? 0 : n_layers),
      kv_dim_(kv_dim < 0 ? 0 : kv_dim),
      k_(static_cast<std::size_t>(n_layers_)),
      v_(static_cast<std::size_t>(n_layers_)) {}

void KVCache::resize(int n_tokens) {
  if (n_tokens < 0) n_tokens = 0;
  const std::size_t n = static_cast<std::size_t>(n_tokens) * static_cast<std::size_t>(kv_dim_);
  for (int l = 0; l < n_layers_; ++l) {
    k_[l].resize(n, 0.0f);
    v_[l].resize(n, 0.0f);
  }
  n_tokens_ = n_tokens;
}

void KVCache::reserve(int n_tokens) {
  if (n_tokens <= 0) return;
  const std::size_t n = static_cast<std::size_t>(n_tokens) * static_cast<std::size_t>(kv_dim_);
  for (int l = 0; l < n_layers_; ++l) {
    k_[l].reserve(n);
    v_[l].reserve(n);
  }
}

KVView KVCache::view(int n_tokens) const {
  KVView view;
  view.n_tokens = (n_tokens < 0 || n_tokens > n_tokens_) ? n_tokens_ : n_tokens;
  view.layers.resize(static_cast<std::size_t>(n_layers_));
  for (int l = 0; l < n_layers_; ++l) {
    view.layers[l].k = k_[l].data();
    view.layers[l].v = v_[l].data();
    view.layers[l].k_stride = static_cast<std::size_t>(kv_dim_);
    view.layers[l].v_stride = static_cast<std::size_t>(kv_dim_);
  }
  return view;
}

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------
Model::~Model() = default;

std::unique_ptr<Model> Model::load(const std::string& path, std::string* error) {
  if (!host_is_little_endian()) {
    set_error(error, "the model loaders require a little-endian host");
    return nullptr;
  }
  if (!std::ifstream(path, std::ios::binary)) {
    set_error(error, "cannot open model file '" + path + "': " + std::strerror(errno));
    return nullptr;
  }
  if (gguf::has_magic(path)) return load_gguf(path, error);
  std::string why;
  std::unique_ptr<Model> m = load_llama2c(path, &why);
  if (!m)
    set_error(error,
              "'" + path +
                  "' is neither a GGUF file (no \"GGUF\" magic) nor a llama2.c checkpoint: " + why);
  return m;
}

std::unique_ptr<Model> Model::load_llama2c(const std::string& path, std::string* error) {
  if (!host_is_little_endian()) {
    set_error(error, "llama2 checkpoint loader requires a little-endian host");
    return nullptr;
  }
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) {
    set_error(error, "cannot open llama2 checkpoint '" + path + "'");
    return nullptr;
  }
  const std::streamoff file_size_off = in.tellg();
  if (file_size_off < 0) {
    set_error(error, "cannot determine the size of '" + path + "'");
    return nullptr;
  }
  const std::uint64_t file_size = static_cast<std::uint64_t>(file_size_off);
  constexpr std::uint64_t kHeaderBytes = 7 * sizeof(std::int32_t);
  if (file_size < kHeaderBytes) {
    std::ostringstream os;
    os << "'" << path << "' is too small for a llama2.c header (" << file_size
       << " bytes, need at least " << kHeaderBytes << ")";
    set_error(error, os.str());
    return nullptr;
  }
  in.seekg(0);
  std::int32_t h[7];
  if (!in.read(reinterpret_cast<char*>(h), sizeof(h))) {
    set_error(error, "cannot read the header of '" + path + "'");
    return nullptr;
  }

  // Validate the header before trusting any size derived from it.
  std::ostringstream hdr;
  hdr << "dim=" << h[0] << " hidden_dim=" << h[1] << " n_layers=" << h[2] << " n_heads=" << h[3]
      << " n_kv_heads=" << h[4] << " vocab_size=" << h[5] << " seq_len=" << h[6];
  auto bad_header = [&](const std::string& why) {
    set_error(error, "bad llama2.c header in '" + path + "' (" + hdr.str() + "): " + why);
    return nullptr;
  };
  const std::int32_t dim = h[0], hidden = h[1], n_layers = h[2], n_heads = h[3], n_kv_heads = h[4],
                     vocab_raw = h[5], seq_len = h[6];
  if (dim <= 0 || hidden <= 0 || n_layers <= 0 || n_heads <= 0 || n_kv_heads <= 0 || seq_len <= 0 ||
      vocab_raw == 0)
    return bad_header("all fields must be positive (vocab_size may be negative, not zero)");
  if (vocab_raw == std::numeric_limits<std::int32_t>::min())
    return bad_header("vocab_size out of range");
  const std::int32_t vocab = vocab_raw < 0 ? -vocab_raw : vocab_raw;
  if (dim > (1 << 16) || hidden > (1 << 18) || n_layers > 1024 || seq_len > (1 << 20) ||
      vocab > (1 << 22))
    return bad_header("a dimension exceeds the supported limits");
  if (dim % n_heads != 0) return bad_header("dim is not a multiple of n_heads");
  if (n_kv_heads > n_heads || n_heads % n_kv_heads != 0)
    return bad_header("n_heads is not a multiple of n_kv_heads");
  const std::int32_t head_size = dim / n_heads;
  if (head_size % 2 != 0) return bad_header("head_size must be even for RoPE");

  const std::uint64_t D = static_cast<std::uint64_t>(dim), Hd = static_cast<std::uint64_t>(hidden),
                      L = static_cast<std::uint64_t>(n_layers),
                      V = static_cast<std::uint64_t>(vocab),
                      S = static_cast<std::uint64_t>(seq_len),
                      KV = static_cast<std::uint64_t>(n_kv_heads) *
                           static_cast<std::uint64_t>(head_size),
                      HS = static_cast<std::uint64_t>(head_size);
  std::uint64_t n_floats = 0;
  n_floats += V * D;                     // token_embedding
  n_floats += L * D;                     // rms_att
  n_floats += L * D * D;                 // wq
  n_floats += L * KV * D;                // wk
  n_floats += L * KV * D;                // wv
  n_floats += L * D * D;                 // wo
  n_floats += L * D;                     // rms_ffn
  n_floats += L * Hd * D;                // w1
  n_floats += L * D * Hd;                // w2
  n_floats += L * Hd * D;                // w3
  n_floats += D;                         // rms_final
  n_floats += S * HS;                    // freq_cis_real + freq_cis_imag (S * HS/2 each)
  if (vocab_raw < 0) n_floats += V * D;  // separate classifier
  const std::uint64_t expected = kHeaderBytes + n_floats * sizeof(float);
  if (file_size != expected) {
    std::ostringstream os;
    os << "'" << path << "' has " << file_size << " bytes but its header (" << hdr.str()
       << ") implies " << expected << " bytes"
       << (file_size < expected ? " (file truncated?)" : " (trailing data or wrong format)");
    set_error(error, os.str());
    return nullptr;
  }

  std::unique_ptr<Model> m(new (std::nothrow) Model());
  if (!m) {
    set_error(error, "out of memory");
    return nullptr;
  }
  try {
    m->data_.resize(static_cast<std::size_t>(n_floats));
  } catch (const std::bad_alloc&) {
    set_error(error, "out of memory allocating the weights of '" + path + "'");
    return nullptr;
  }
  if (!in.read(reinterpret_cast<char*>(m->data_.data()),
               static_cast<std::streamsize>(n_floats * sizeof(float)))) {
    set_error(error, "short read of the weights of '" + path + "'");
    return nullptr;
  }

  Config& c = m->cfg_;
  c.dim = dim;
  c.hidden_dim = hidden;
  c.n_layers = n_layers;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.vocab_size = vocab;
  c.seq_len = seq_len;
  c.shared_classifier = vocab_raw > 0;

  c.format = "llama2.c";
  c.name = path.substr(path.find_last_of('/') + 1);

  // Float32 matrices [rows][cols], packed one layer after another.
  const float* p = m->data_.data();
  auto take = [&p](int rows, int cols) {
    WeightMatrix w{WeightType::kF32, rows, cols, p};
    p += static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
    return w;
  };
  const int kv = n_kv_heads * head_size;
  m->token_embedding_ = take(vocab, dim);
  m->layers_.resize(static_cast<std::size_t>(n_layers));
  for (auto& lw : m->layers_) lw.rms_att = take(1, dim).f32();
  for (auto& lw : m->layers_) lw.wq = take(dim, dim);
  for (auto& lw : m->layers_) lw.wk = take(kv, dim);
  for (auto& lw : m->layers_) lw.wv = take(kv, dim);
  for (auto& lw : m->layers_) lw.wo = take(dim, dim);
  for (auto& lw : m->layers_) lw.rms_ffn = take(1, dim).f32();
  for (auto& lw : m->layers_) lw.w1 = take(hidden, dim);
  for (auto& lw : m->layers_) lw.w2 = take(dim, hidden);
  for (auto& lw : m->layers_) lw.w3 = take(hidden, dim);
  m->rms_final_ = take(1, dim).f32();
  p += S * HS;  // freq_cis tables (RoPE is computed on the fly, as in run.c)
  m->wcls_ = c.shared_classifier ? m->token_embedding_ : take(vocab, dim);
  return m;
}

std::unique_ptr<Model> Model::load_gguf(const std::string& path, std::string* error) {
  std::unique_ptr<gguf::File> f = gguf::File::open(path, error);
  if (!f) return nullptr;
  const std::string where = "gguf '" + path + "': ";
  std::string arch;
  if (!f->get_string("general.architecture", &arch, error)) return nullptr;
  if (arch != "llama") {
    set_error(error, where + "general.architecture is '" + arch + "', only 'llama' is supported");
    return nullptr;
  }
  std::uint32_t n_layers = 0, dim = 0, hidden = 0, n_heads = 0, n_kv_heads = 0, ctx = 0;
  if (!f->get_u32("llama.block_count", &n_layers, error) ||
      !f->get_u32("llama.embedding_length", &dim, error) ||
      !f->get_u32("llama.feed_forward_length", &hidden, error) ||
      !f->get_u32("llama.attention.head_count", &n_heads, error) ||
      !f->get_u32("llama.context_length", &ctx, error))
    return nullptr;
  n_kv_heads = n_heads;
  if (f->has("llama.attention.head_count_kv") &&
      !f->get_u32("llama.attention.head_count_kv", &n_kv_heads, error))
    return nullptr;
  auto bad = [&](const std::string& why) -> std::unique_ptr<Model> {
    set_error(error, where + why);
    return nullptr;
  };
  if (n_layers == 0 || n_layers > 1024 || dim == 0 || dim > (1u << 16) || hidden == 0 ||
      hidden > (1u << 18) || n_heads == 0 || n_kv_heads == 0 || ctx == 0 || ctx > (1u << 20))
    return bad("a dimension in llama.* is zero or exceeds the supported limits");
  if (dim % n_heads != 0) return bad("llama.embedding_length is not a multiple of head_count");
  if (n_heads % n_kv_heads != 0)
    return bad("llama.attention.head_count is not a multiple of head_count_kv");
  const std::uint32_t hs = dim / n_heads;
  if (hs % 2 != 0) return bad("head size must be even for RoPE");
  if (f->has("llama.rope.dimension_count")) {
    std::uint32_t rd = 0;
    if (!f->get_u32("llama.rope.dimension_count", &rd, error)) return nullptr;
    if (rd != hs)
      return bad("llama.rope.dimension_count " + std::to_string(rd) + " != head size " +
                 std::to_string(hs) + " (partial RoPE is not supported)");
  }
  std::unique_ptr<Model> m(new Model());
  Config& c = m->cfg_;
  c.dim = static_cast<int>(dim);
  c.hidden_dim = static_cast<int>(hidden);
  c.n_layers = static_cast<int>(n_layers);
  c.n_heads = static_cast<int>(n_heads);
  c.n_kv_heads = static_cast<int>(n_kv_heads);
  c.seq_len = static_cast<int>(ctx);
  c.format = "gguf";
  if (f->has("llama.rope.freq_base") && !f->get_f32("llama.rope.freq_base", &c.rope_base, error))
    return nullptr;
  if (!f->get_f32("llama.attention.layer_norm_rms_epsilon", &c.norm_eps, error)) return nullptr;
  if (!(c.rope_base > 1.0f) || !(c.norm_eps > 0.0f) || !(c.norm_eps < 1.0f))
    return bad("llama.rope.freq_base or layer_norm_rms_epsilon out of range");
  if (f->has("general.name") && !f->get_string("general.name", &c.name, error)) return nullptr;

  using TT = gguf::TensorType;
  const std::vector<TT> mat_types = {TT::kF32, TT::kQ4_1, TT::kQ8_0};
  const gguf::TensorInfo* emb = f->tensor("token_embd.weight");
  if (emb == nullptr) return bad("tensor 'token_embd.weight' is missing");
  c.vocab_size = static_cast<int>(std::min<std::uint64_t>(emb->ne[1], 1u << 22));
  const std::uint64_t D = dim, KV = static_cast<std::uint64_t>(n_kv_heads) * hs, H = hidden,
                      V = static_cast<std::uint64_t>(c.vocab_size);
  auto matrix = [&](const std::string& name, std::uint64_t cols, std::uint64_t rows,
                    WeightMatrix* out) {
    const gguf::TensorInfo* t = f->expect(name, cols, rows, mat_types, error);
    if (t == nullptr) return false;
    const WeightType wt = t->type == TT::kF32    ? WeightType::kF32
                          : t->type == TT::kQ4_1 ? WeightType::kQ4_1
                                                 : WeightType::kQ8_0;
    *out = WeightMatrix{wt, static_cast<int>(rows), static_cast<int>(cols), t->data};
    return true;
  };
  auto vec = [&](const std::string& name, const float** out) {
    const gguf::TensorInfo* t = f->expect(name, D, 1, {TT::kF32}, error);
    if (t == nullptr) return false;
    *out = reinterpret_cast<const float*>(t->data);  // data offsets are 32-byte aligned
    return true;
  };
  if (!matrix("token_embd.weight", D, V, &m->token_embedding_)) return nullptr;
  m->layers_.resize(n_layers);
  for (std::uint32_t l = 0; l < n_layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    LayerWeights& lw = m->layers_[l];
    if (!vec(b + "attn_norm.weight", &lw.rms_att) || !matrix(b + "attn_q.weight", D, D, &lw.wq) ||
        !matrix(b + "attn_k.weight", D, KV, &lw.wk) ||
        !matrix(b + "attn_v.weight", D, KV, &lw.wv) ||
        !matrix(b + "attn_output.weight", D, D, &lw.wo) ||
        !vec(b + "ffn_norm.weight", &lw.rms_ffn) || !matrix(b + "ffn_gate.weight", D, H, &lw.w1) ||
        !matrix(b + "ffn_down.weight", H, D, &lw.w2) || !matrix(b + "ffn_up.weight", D, H, &lw.w3))
      return nullptr;
  }
  if (!vec("output_norm.weight", &m->rms_final_)) return nullptr;
  c.shared_classifier = f->tensor("output.weight") == nullptr;
  if (c.shared_classifier)
    m->wcls_ = m->token_embedding_;
  else if (!matrix("output.weight", D, V, &m->wcls_))
    return nullptr;
  m->gguf_ = std::move(f);
  if (detail::have_avx512()) {  // the AVX-512 kernel's layout, packed once
    std::vector<WeightMatrix*> mats;
    for (LayerWeights& lw : m->layers_)
      for (WeightMatrix* w : {&lw.wq, &lw.wk, &lw.wv, &lw.wo, &lw.w1, &lw.w2, &lw.w3})
        mats.push_back(w);
    mats.push_back(&m->wcls_);
    std::size_t total = 0;
    for (const WeightMatrix* w : mats) total += packed_bytes(*w);
    m->packed_.reset(new (std::align_val_t{64}) std::uint8_t[total]);
    std::size_t off = 0;
    for (WeightMatrix* w : mats) {
      if (w->type == WeightType::kF32) continue;
      pack_weights(*w, m->packed_.get() + off);
      w->packed = m->packed_.get() + off;
      off += packed_bytes(*w);
    }
  }
  return m;
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------
bool Model::check_view(const KVView& view, std::string* error) const {
  if (view.n_tokens < 0) {
    set_error(error, "KV view has a negative token count");
    return false;
  }
  if (view.n_tokens == 0) return true;  // layers may be empty or null
  if (static_cast<int>(view.layers.size()) != cfg_.n_layers) {
    std::ostringstream os;
    os << "KV view has " << view.layers.size() << " layers, the model has " << cfg_.n_layers;
    set_error(error, os.str());
    return false;
  }
  const std::size_t kv_dim = static_cast<std::size_t>(cfg_.kv_dim());
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const KVLayerView& lv = view.layers[l];
    if (lv.k == nullptr || lv.v == nullptr) {
      set_error(error, "KV view layer " + std::to_string(l) + " has a null pointer");
      return false;
    }
    if (lv.k_stride < kv_dim || lv.v_stride < kv_dim) {
      set_error(error, "KV view layer " + std::to_string(l) + " has a row stride below kv_dim " +
                           std::to_string(kv_dim));
      return false;
    }
  }
  return true;
}

bool Model::forward(const std::vector<int>& tokens, int start_pos, const KVView& view,
                    KVCache* tail, int logits_rows, std::vector<float>* logits,
                    std::vector<float>* queries, std::string* error, std::vector<float>* att_mass,
                    const std::function<bool(int)>* layer_ready) const {
  const Config& c = cfg_;
  if (tokens.empty()) {
    set_error(error, "no tokens to run");
    return false;
  }
  // tail == nullptr: score_over_view (the keys are the view's rows only).
  const bool over_view = tail == nullptr;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      set_error(error, "token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                           " is outside [0, " + std::to_string(c.vocab_size) + ")");
      return false;
    }
  }
  if (!check_view(view, error)) return false;
  const int T = static_cast<int>(tokens.size());
  const int n_view = view.n_tokens;
  if (over_view) {
    if (start_pos < 0 || static_cast<std::int64_t>(start_pos) + T > n_view) {
      set_error(error, "positions " + std::to_string(start_pos) + ".." +
                           std::to_string(static_cast<std::int64_t>(start_pos) + T - 1) +
                           " are not all in the view's " + std::to_string(n_view) + " tokens");
      return false;
    }
    for (int l = 0; l < c.n_layers; ++l) {
      if (view.layers[l].drop != nullptr && view.layers[l].drop[0] != 0) {
        set_error(error, "KV view layer " + std::to_string(l) +
                             " drops token 0: every query must see a present key");
        return false;
      }
    }
  } else if (tail->n_layers() == 0 && tail->n_tokens() == 0) {
    *tail = make_cache();
  } else if (tail->n_layers() != c.n_layers || tail->kv_dim() != c.kv_dim()) {
    set_error(error, "tail cache shape (" + std::to_string(tail->n_layers()) + " layers, kv_dim " +
                         std::to_string(tail->kv_dim()) + ") does not match the model");
    return false;
  }
  const int n_tail0 = over_view ? 0 : tail->n_tokens();
  if (!over_view && start_pos != n_view + n_tail0) {
    set_error(error, "position " + std::to_string(start_pos) + " != view tokens (" +
                         std::to_string(n_view) + ") + tail tokens (" + std::to_string(n_tail0) +
                         ")");
    return false;
  }
  if (static_cast<std::int64_t>(start_pos) + T > c.seq_len) {
    set_error(error, "positions up to " +
                         std::to_string(static_cast<std::int64_t>(start_pos) + T - 1) +
                         " exceed seq_len " + std::to_string(c.seq_len));
    return false;
  }

  const int dim = c.dim, kv_dim = c.kv_dim(), hidden = c.hidden_dim, hs = c.head_size();
  const int kv_mul = c.kv_group();
  const std::size_t TD = static_cast<std::size_t>(T) * dim;
  Activations x(TD), xb(TD), xb2(TD), q(TD);
  Activations hb(static_cast<std::size_t>(T) * hidden), hb2(hb.size());
  if (queries != nullptr) queries->assign(static_cast<std::size_t>(c.n_layers) * TD, 0.0f);
  // Attention probabilities of this layer, [head][query t][key] (prefill only).
  std::vector<float> probs;
  if (att_mass != nullptr) {
    if (n_view != 0 || n_tail0 != 0) {
      set_error(error, "attention mass is recorded by prefill only");
      return false;
    }
    att_mass->assign(static_cast<std::size_t>(c.n_layers) * c.n_heads * T, 0.0f);
    probs.assign(static_cast<std::size_t>(c.n_heads) * T * T, 0.0f);
  }

  for (int t = 0; t < T; ++t)
    dequantize_row(token_embedding_, tokens[t], &x[static_cast<std::size_t>(t) * dim]);

  // RoPE tables for the positions of this pass (cos/sin of pos * freq, as run.c).
  std::vector<float> rope_cos(static_cast<std::size_t>(T) * (hs / 2)), rope_sin(rope_cos.size());
  for (int t = 0; t < T; ++t) {
    const int pos = start_pos + t;
    for (int i = 0; i < hs; i += 2) {
      const float freq =
          1.0f / std::pow(c.rope_base, static_cast<float>(i) / static_cast<float>(hs));
      const float val = static_cast<float>(pos) * freq;
      rope_cos[static_cast<std::size_t>(t) * (hs / 2) + i / 2] = std::cos(val);
      rope_sin[static_cast<std::size_t>(t) * (hs / 2) + i / 2] = std::sin(val);
    }
  }

  if (!over_view) tail->resize(n_tail0 + T);
  // Keys of query t: the view, the tail rows before this pass and this
  // pass's rows 0..t; over the view, the view's rows 0..start_pos+t.
  const int max_keys = over_view ? start_pos + T : n_view + n_tail0 + T;
  const int n_segs = over_view ? 1 : 2;

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& lw = layers_[static_cast<std::size_t>(l)];
    rmsnorm(xb.data(), x.data(), lw.rms_att, T, dim, c.norm_eps);
    float* kt = over_view ? nullptr : tail->k(l) + static_cast<std::size_t>(n_tail0) * kv_dim;
    float* vt = over_view ? nullptr : tail->v(l) + static_cast<std::size_t>(n_tail0) * kv_dim;
    {
      const WeightMatrix* ws[3] = {&lw.wq, &lw.wk, &lw.wv};
      float* outs[3] = {q.data(), kt, vt};
      matmul_many(ws, outs, over_view ? 1 : 3, xb.data(), T);
    }

#pragma omp parallel for schedule(static) if (T >= 8)
    for (int t = 0; t < T; ++t) {
      float* qr = &q[static_cast<std::size_t>(t) * dim];
      float* kr = over_view ? nullptr : kt + static_cast<std::size_t>(t) * kv_dim;
      const float* cs = &rope_cos[static_cast<std::size_t>(t) * (hs / 2)];
      const float* sn = &rope_sin[static_cast<std::size_t>(t) * (hs / 2)];
      for (int i = 0; i < dim; i += 2) {
        const float fcr = cs[(i % hs) / 2], fci = sn[(i % hs) / 2];
        const int rotn = i < kv_dim && !over_view ? 2 : 1;
        for (int r = 0; r < rotn; ++r) {
          float* vec = r == 0 ? qr : kr;
          const float v0 = vec[i], v1 = vec[i + 1];
          vec[i] = v0 * fcr - v1 * fci;
          vec[i + 1] = v0 * fci + v1 * fcr;
        }
      }
    }
    if (queries != nullptr)
      std::memcpy(queries->data() + static_cast<std::size_t>(l) * TD, q.data(), TD * sizeof(float));

    if (layer_ready != nullptr && n_view > 0 && !(*layer_ready)(l)) {
      set_error(error, "layer " + std::to_string(l) + " of the KV view did not become ready");
      return false;
    }
    const KVLayerView lv = n_view > 0 ? view.layers[l] : KVLayerView{};
    const float* tail_k = over_view ? nullptr : tail->k(l);
    const float* tail_v = over_view ? nullptr : tail->v(l);
    const std::int64_t att_work = static_cast<std::int64_t>(T) * c.n_heads * max_keys * hs;
    const Segment segs_all[2] = {
        {lv.k, lv.v, lv.k_stride, lv.v_stride, n_view, lv.drop},
        {tail_k, tail_v, static_cast<std::size_t>(kv_dim), static_cast<std::size_t>(kv_dim),
         n_tail0 + T},
    };
    if (probs.empty()) {
      // The query heads of one KV head for a chunk of tokens read the keys
      // once (attend_group: the bits of attend_head per query).  A decode
      // step splits each KV head's query heads into two items, so that two
      // threads share the KV heads' queries evenly.
      const int kTokensPerItem = T >= 32 ? 16 : 8;
      const int chunks = (T + kTokensPerItem - 1) / kTokensPerItem;
      const int parts = T == 1 && kv_mul > 1 ? 2 : 1;
      const int per_part = (kv_mul + parts - 1) / parts;
      const std::size_t stride = static_cast<std::size_t>(max_keys) + 8;
#pragma omp parallel if (att_work >= kParallelWork)
      {
        const int nq_max = kTokensPerItem * kv_mul;
        // Scratch the kernel writes before it reads: not zero-filled.
        const std::unique_ptr<float[]> scores(new float[static_cast<std::size_t>(nq_max) * stride]);
        std::vector<const float*> qp(static_cast<std::size_t>(nq_max));
        std::vector<float*> op(static_cast<std::size_t>(nq_max));
        std::vector<int> counts(static_cast<std::size_t>(nq_max));
#pragma omp for collapse(3) schedule(static)
        for (int kh = 0; kh < c.n_kv_heads; ++kh) {
          for (int ch = 0; ch < chunks; ++ch) {
            for (int part = 0; part < parts; ++part) {
              const int h0 = kh * kv_mul + part * per_part;
              const int h1 = std::min((kh + 1) * kv_mul, h0 + per_part);
              int n_q = 0;
              for (int t = ch * kTokensPerItem; t < T && t < (ch + 1) * kTokensPerItem; ++t)
                for (int h = h0; h < h1; ++h, ++n_q) {
                  const std::size_t off =
                      static_cast<std::size_t>(t) * dim + static_cast<std::size_t>(h) * hs;
                  qp[static_cast<std::size_t>(n_q)] = &q[off];
                  op[static_cast<std::size_t>(n_q)] = &xb2[off];
                  counts[static_cast<std::size_t>(n_q)] =
                      over_view ? start_pos + t + 1 : n_view + n_tail0 + t + 1;
                }
              if (n_q > 0)
                detail::attend_group(qp.data(), counts.data(), n_q, hs,
                                     static_cast<std::size_t>(kh) * hs, segs_all, n_segs,
                                     scores.get(), stride, op.data());
            }
          }
        }
      }
    } else {
      // Prefill recording the attention mass (empty view and tail): one
      // head at a time, each query's probabilities kept.
#pragma omp parallel if (att_work >= kParallelWork)
      {
        std::vector<float> scores(static_cast<std::size_t>(max_keys) + 8);
#pragma omp for collapse(2) schedule(static)
        for (int t = 0; t < T; ++t) {
          for (int h = 0; h < c.n_heads; ++h) {
            Segment segs[2] = {segs_all[0], segs_all[1]};
            segs[1].count = t + 1;
            const std::size_t off =
                static_cast<std::size_t>(t) * dim + static_cast<std::size_t>(h) * hs;
            attend_head(&q[off], hs, static_cast<std::size_t>(h / kv_mul) * hs, segs, n_segs,
                        scores.data(), &xb2[off]);
            std::memcpy(&probs[(static_cast<std::size_t>(h) * T + t) * T], scores.data(),
                        static_cast<std::size_t>(t + 1) * sizeof(float));
          }
        }
      }
    }
    if (att_mass != nullptr) {
      // mass[l][h][j] = sum_{t >= j} p(t, j), t ascending: one thread per (h, j).
      float* mass = att_mass->data() + static_cast<std::size_t>(l) * c.n_heads * T;
#pragma omp parallel for collapse(2) schedule(static) if (att_work >= kParallelWork)
      for (int h = 0; h < c.n_heads; ++h) {
        for (int j = 0; j < T; ++j) {
          float sum = 0.0f;
          for (int t = j; t < T; ++t) sum += probs[(static_cast<std::size_t>(h) * T + t) * T + j];
          mass[static_cast<std::size_t>(h) * T + j] = sum;
        }
      }
    }

    matmul(lw.wo, xb2.data(), T, xb.data());
    for (std::size_t i = 0; i < TD; ++i) x[i] += xb[i];

    // SwiGLU feed-forward.
    rmsnorm(xb.data(), x.data(), lw.rms_ffn, T, dim, c.norm_eps);
    {
      const WeightMatrix* ws[2] = {&lw.w1, &lw.w3};
      float* outs[2] = {hb.data(), hb2.data()};
      matmul_many(ws, outs, 2, xb.data(), T);
    }
    detail::swiglu(hb.data(), hb2.data(), hb.size());
    matmul(lw.w2, hb.data(), T, xb.data());
    for (std::size_t i = 0; i < TD; ++i) x[i] += xb[i];
  }

  if (logits != nullptr && logits_rows != 0) {
    const int first = logits_rows == 1 ? T - 1 : 0;
    const int n = T - first;
    rmsnorm(xb.data(), x.data() + static_cast<std::size_t>(first) * dim, rms_final_, n, dim,
            c.norm_eps);
    logits->resize(static_cast<std::size_t>(n) * c.vocab_size);  // matmul writes every element
    matmul(wcls_, xb.data(), n, logits->data());
  }
  return true;
}

bool Model::prefill(const std::vector<int>& tokens, const PrefillOptions& options,
                    PrefillResult* out, std::string* error) const {
  if (out == nullptr) {
    set_error(error, "prefill output is null");
    return false;
  }
  KVCache cache = make_cache();
  std::vector<float> logits, queries;
  std::vector<float> mass;
  if (!forward(tokens, 0, KVView{}, &cache, options.all_logits ? 2 : 1, &logits,
               options.record_queries ? &queries : nullptr, error,
               options.record_attention_mass ? &mass : nullptr))
    return false;
  out->kv = std::move(cache);
  const std::size_t V = static_cast<std::size_t>(cfg_.vocab_size);
  out->last_logits.assign(logits.end() - static_cast<std::ptrdiff_t>(V), logits.end());
  if (options.all_logits)
    out->all_logits = std::move(logits);
  else
    out->all_logits.clear();
  out->queries = std::move(queries);
  out->attention_mass = std::move(mass);
  return true;
}

bool Model::decode_step(int token, int pos, const KVView& view, KVCache* tail,
                        std::vector<float>* logits, std::string* error) const {
  if (tail == nullptr) {
    set_error(error, "tail cache is null");
    return false;
  }
  std::vector<float> tmp;
  if (!forward({token}, pos, view, tail, 1, logits != nullptr ? logits : &tmp, nullptr, error))
    return false;
  return true;
}

bool Model::verify(const std::vector<int>& draft, int start_pos, const KVView& view, KVCache* tail,
                   std::vector<float>* logits, std::string* error) const {
  return verify(draft, start_pos, view, tail, logits, error, nullptr);
}

bool Model::verify(const std::vector<int>& draft, int start_pos, const KVView& view, KVCache* tail,
                   std::vector<float>* logits, std::string* error,
                   const std::function<bool(int)>& layer_ready) const {
  if (tail == nullptr) {
    set_error(error, "tail cache is null");
    return false;
  }
  std::vector<float> tmp;
  return forward(draft, start_pos, view, tail, 2, logits != nullptr ? logits : &tmp, nullptr, error,
                 nullptr, layer_ready ? &layer_ready : nullptr);
}

bool Model::score_over_view(const std::vector<int>& tokens, int start_pos, const KVView& view,
                            std::vector<float>* logits, std::string* error) const {
  if (logits == nullptr) {
    set_error(error, "logits output is null");
    return false;
  }
  return forward(tokens, start_pos, view, nullptr, 2, logits, nullptr, error);
}

bool Model::attention_outputs(const float* queries, int n_q, int q_pos0, const KVView& view,
                              float* out, std::string* error) const {
  if (!check_view(view, error)) return false;
  if (n_q > 0 && static_cast<int>(view.layers.size()) != cfg_.n_layers) {
    set_error(error, "KV view has no layers");
    return false;
  }
  const AttentionShape shape{cfg_.n_heads, cfg_.n_kv_heads, cfg_.head_size()};
  const std::size_t per_layer = static_cast<std::size_t>(n_q > 0 ? n_q : 0) * cfg_.dim;
  for (int l = 0; l < cfg_.n_layers && n_q > 0; ++l) {
    if (!attention(shape, view.layers[l], view.n_tokens, queries + l * per_layer, 0, n_q, q_pos0,
                   out + l * per_layer, error))
      return false;
  }
  return true;
}

// ---------------------------------------------------------------------------
// Free helpers
// ---------------------------------------------------------------------------
bool attention(const AttentionShape& shape, const KVLayerView& kv, int n_kv_tokens, const float* q,
               std::size_t q_stride, int n_q, int q_pos0, float* out, std::string* error) {
  if (shape.n_heads <= 0 || shape.n_kv_heads <= 0 || shape.head_size <= 0 ||
      shape.n_heads % shape.n_kv_heads != 0) {
    set_error(error, "invalid attention shape");
    return false;
  }
  if (n_q < 0 || q_pos0 < 0 || n_kv_tokens < 0 ||
      static_cast<std::int64_t>(q_pos0) + n_q > n_kv_tokens) {
    set_error(error, "queries at positions [" + std::to_string(q_pos0) + ", " +
                         std::to_string(static_cast<std::int64_t>(q_pos0) + n_q) +
                         ") need keys beyond the " + std::to_string(n_kv_tokens) + " available");
    return false;
  }
  if (n_q == 0) return true;
  const std::size_t dq = static_cast<std::size_t>(shape.n_heads) * shape.head_size;
  const std::size_t kv_dim = static_cast<std::size_t>(shape.n_kv_heads) * shape.head_size;
  if (q == nullptr || out == nullptr || kv.k == nullptr || kv.v == nullptr) {
    set_error(error, "attention: null buffer");
    return false;
  }
  if (kv.k_stride < kv_dim || kv.v_stride < kv_dim) {
    set_error(error, "attention: KV row stride below kv_dim");
    return false;
  }
  if (q_stride == 0) q_stride = dq;
  if (q_stride < dq) {
    set_error(error, "attention: query row stride below n_heads*head_size");
    return false;
  }
  const int kv_mul = shape.n_heads / shape.n_kv_heads;
  const int max_keys = q_pos0 + n_q;
  const std::int64_t work =
      static_cast<std::int64_t>(n_q) * shape.n_heads * max_keys * shape.head_size;
#pragma omp parallel if (work >= kParallelWork)
  {
    std::vector<float> scores(static_cast<std::size_t>(max_keys) + 8);
#pragma omp for collapse(2) schedule(dynamic, 4)
    for (int i = 0; i < n_q; ++i) {
      for (int h = 0; h < shape.n_heads; ++h) {
        const Segment seg{kv.k, kv.v, kv.k_stride, kv.v_stride, q_pos0 + i + 1, kv.drop};
        const std::size_t hoff = static_cast<std::size_t>(h) * shape.head_size;
        attend_head(q + static_cast<std::size_t>(i) * q_stride + hoff, shape.head_size,
                    static_cast<std::size_t>(h / kv_mul) * shape.head_size, &seg, 1, scores.data(),
                    out + static_cast<std::size_t>(i) * dq + hoff);
      }
    }
  }
  return true;
}

double vnmse(const float* ref, const float* approx, std::size_t n) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(approx[i]) - static_cast<double>(ref[i]);
    num += d * d;
    den += static_cast<double>(ref[i]) * static_cast<double>(ref[i]);
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return num / den;
}

int argmax(const float* x, std::size_t n) {
  if (n == 0) return -1;
  std::size_t best = 0;
  for (std::size_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return static_cast<int>(best);
}

}  // namespace kvxfer::model
