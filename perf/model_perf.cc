// model_perf: the speed of the model runner (support/models/, docs/MODEL.md) on
// SmolLM2-135M-Instruct: prefill, a decode step at a context, and batched
// verification passes in decode steps, with a memcpy of the weight bytes in
// the same run as the physical limit of a decode step, and the tokenizer's
// encoding of 10,000 characters against the prefill of the tokens it yields.
//
//   ./build/perf/model_perf                 context 1024, passes of 16 and 64
//   ./build/perf/model_perf -C 2048 -v 8,16,32,64 --model FILE -n 5
//
// Each figure is the median of -n repetitions (after one warm-up); the decode
// step and the passes are timed in turn within each repetition, so that a
// slow minute of a shared machine weighs on both sides of their ratio.  Exit 77
// when the default model has not been fetched (scripts/install-deps.sh).
#include <immintrin.h>
#include <omp.h>
#include <time.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "models/bpe_tokenizer.h"
#include "models/gguf.h"
#include "models/llama2.h"
#include "models/model_paths.h"
#include "models/qmatmul.h"

namespace km = kvxfer::model;

namespace {

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

template <typename F>
double median_time(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const double a = now_s();
    f();
    t.push_back(now_s() - a);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The FMA throughput of one thread: 12 independent chains of 8-lane fmas for
// about `seconds` (AVX2; 0 when the CPU has none).  GFLOP/s, 2 per lane-fma.
__attribute__((target("avx2,fma"))) double fma_gflops_avx2(double seconds) {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(1.0f + 1e-7f * static_cast<float>(i));
  const __m256 b = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
  long iters = 0;
  const double t0 = now_s();
  double t = t0;
  while (t - t0 < seconds) {
    for (int n = 0; n < 100000; ++n)
      for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
    iters += 100000;
    t = now_s();
  }
  float sink = 0;
  for (int i = 0; i < 12; ++i) sink += _mm256_cvtss_f32(a[i]);
  volatile float keep = sink;
  (void)keep;
  return static_cast<double>(iters) * 12 * 16 / (t - t0) / 1e9;
}

// The same with 16-lane fmas (AVX-512F), the path of the runner's batched
// passes where the CPU has it.
__attribute__((target("avx512f"))) double fma_gflops_avx512(double seconds) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(1.0f + 1e-7f * static_cast<float>(i));
  const __m512 b = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
  long iters = 0;
  const double t0 = now_s();
  double t = t0;
  while (t - t0 < seconds) {
    for (int n = 0; n < 100000; ++n)
      for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
    iters += 100000;
    t = now_s();
  }
  float sink = 0;
  for (int i = 0; i < 12; ++i) sink += _mm512_cvtss_f32(a[i]);
  volatile float keep = sink;
  (void)keep;
  return static_cast<double>(iters) * 12 * 32 / (t - t0) / 1e9;
}

// The 16-bit integer product throughput of one thread (vpdpwssd, AVX-512
// VNNI): 12 independent chains for about `seconds`.  GOP/s, 2 per product.
__attribute__((target("avx512f,avx512vnni"))) double vnni_gops(double seconds) {
  __m512i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  const __m512i b = _mm512_set1_epi32(0x00030001), c = _mm512_set1_epi32(0x00020005);
  long iters = 0;
  const double t0 = now_s();
  double t = t0;
  while (t - t0 < seconds) {
    for (int n = 0; n < 100000; ++n)
      for (int i = 0; i < 12; ++i) a[i] = _mm512_dpwssd_epi32(a[i], b, c);
    iters += 100000;
    t = now_s();
  }
  alignas(64) int lanes[16];
  int sink = 0;
  for (int i = 0; i < 12; ++i) {
    _mm512_store_si512(lanes, a[i]);
    sink += lanes[0];
  }
  volatile int keep = sink;
  (void)keep;
  return static_cast<double>(iters) * 12 * 64 / (t - t0) / 1e9;
}

// The FMA peak of the OpenMP threads running at once, on the widest path
// the runner's batched passes use (attention), and the peak of their matrix
// products (vpdpwssd on AVX-512, else the FMA peak: vpmaddwd costs about an
// fma per 16-bit product pair).
double fma_peak_gflops(bool avx512) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
  double total = 0;
#pragma omp parallel reduction(+ : total)
  total += avx512 ? fma_gflops_avx512(0.2) : fma_gflops_avx2(0.2);
  return total;
}
double product_peak_gops(bool avx512, double fma_peak) {
  if (!avx512) return fma_peak;
  double total = 0;
#pragma omp parallel reduction(+ : total)
  total += vnni_gops(0.2);
  return total;
}

// Multiply-adds of one token's forward pass at `keys` keys: the matrices and
// the classifier (integer products), and the attention (q.k and p.v, fmas).
std::string fmt2(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", x);
  return b;
}

double matrix_macs(const km::Config& c) {
  const double d = c.dim, kv = c.kv_dim(), h = c.hidden_dim;
  return c.n_layers * (d * d * 2 + 2 * kv * d + 3 * d * h) + static_cast<double>(c.vocab_size) * d;
}
double attention_macs(const km::Config& c, double keys) {
  return c.n_layers * 2.0 * c.n_heads * c.head_size() * keys;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"model_perf: prefill, decode and verification speed of the model runner"};
  std::string model_path;
  int ctx = 1024, reps = 5, threads = 0;
  std::vector<int> passes = {16, 64};
  app.add_option("--model", model_path,
                 "GGUF or llama2.c checkpoint (default: the fetched SmolLM2)");
  // The peaks are sums over threads running at once: more threads than
  // usable CPUs would add up time slices, not throughput.
  const int cpus = omp_get_num_procs();
  app.add_option("-C,--context", ctx, "prompt tokens before the decode step and the passes")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("-v,--verify", passes, "tokens of the verification passes")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("-n,--iters", reps, "timed iterations (the median is reported)")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("-t,--threads", threads,
                 "OpenMP threads, at most the usable CPUs (0 = OpenMP's default)")
      ->check(CLI::Range(0, cpus))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (model_path.empty()) {
    model_path = km::smollm2_gguf_path();
    if (!std::ifstream(model_path).good()) {
      std::printf("# model_perf: %s absent (scripts/install-deps.sh fetches it): skipped\n",
                  model_path.c_str());
      return 77;
    }
  }
  if (threads > 0) omp_set_num_threads(threads);
  std::string err;
  const std::unique_ptr<km::Model> m = km::Model::load(model_path, &err);
  if (!m) {
    std::fprintf(stderr, "model_perf: %s\n", err.c_str());
    return 1;
  }
  const km::Config& c = m->config();
  int max_pass = 0;
  for (int v : passes) max_pass = std::max(max_pass, v);
  if (ctx < 1 || ctx + max_pass > c.seq_len) {
    std::fprintf(stderr, "model_perf: context %d + pass %d exceeds seq_len %d\n", ctx, max_pass,
                 c.seq_len);
    return 2;
  }
  std::printf(
      "# model_perf: %s (%s, %d layers, dim %d, vocab %d), %d OpenMP threads, median of %d\n",
      model_path.c_str(), c.format.c_str(), c.n_layers, c.dim, c.vocab_size, omp_get_max_threads(),
      reps);
  std::FILE* la = std::fopen("/proc/loadavg", "r");
  if (la != nullptr) {
    char b[128] = {};
    if (std::fgets(b, sizeof b, la) != nullptr) std::printf("# load average: %s", b);
    std::fclose(la);
  }

  // A fixed token sequence (deterministic, every id valid).
  std::vector<int> prompt(static_cast<size_t>(ctx));
  for (int i = 0; i < ctx; ++i)
    prompt[static_cast<size_t>(i)] = 100 + (i * 7919) % (c.vocab_size - 200);
  km::PrefillResult pr;
  const double t_prefill = median_time(1, [&] {
    if (!m->prefill(prompt, {}, &pr, &err)) std::fprintf(stderr, "%s\n", err.c_str());
  });
  const km::KVView view = pr.kv.view();
  std::vector<float> logits;
  // The decode step and the passes, in turn: sample [0] is the step, [1 + i]
  // pass i; one warm-up round first.
  const int n_items = 1 + static_cast<int>(passes.size());
  std::vector<std::vector<double>> samples(static_cast<std::size_t>(n_items));
  for (int r = 0; r <= reps; ++r) {
    for (int i = 0; i < n_items; ++i) {
      const double a = now_s();
      km::KVCache tail;
      if (i == 0) {
        m->decode_step(5, ctx, view, &tail, &logits, &err);
      } else {
        const std::vector<int> draft(
            static_cast<std::size_t>(passes[static_cast<std::size_t>(i - 1)]), 7);
        m->verify(draft, ctx, view, &tail, &logits, &err);
      }
      if (r > 0) samples[static_cast<std::size_t>(i)].push_back(now_s() - a);
    }
  }
  auto median_of = [&](int i) {
    std::vector<double>& t = samples[static_cast<std::size_t>(i)];
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const double t_step = median_of(0);

  // The weight bytes of the file's tensors, copied once: the physical limit
  // of a decode step, which reads each of them once.
  std::uint64_t weight_bytes = 0;
  double t_copy = 0;
  if (m->gguf_file() != nullptr) {
    for (const auto& t : m->gguf_file()->tensors()) weight_bytes += t.n_bytes;
    std::vector<char> dst(weight_bytes);
    t_copy = median_time(reps, [&] {
      char* o = dst.data();
      for (const auto& t : m->gguf_file()->tensors()) {
        std::memcpy(o, t.data, t.n_bytes);
        o += t.n_bytes;
      }
    });
  }

  const bool avx512 = km::detail::have_avx512();
  const double peak = fma_peak_gflops(avx512);
  const double ppeak = product_peak_gops(avx512, peak);
  // The definition's ceiling on the AVX-512 products (docs/MODEL.md): per
  // block and (16 rows, token), 16 vpdpwssd beside a multiply and an fma
  // (Q8_0) or two (Q4_1) on the same pipes.  Weighted by each type's
  // multiply-adds: every element of a matrix is one multiply-add per token.
  double ceil_factor = 0;
  if (avx512 && m->gguf_file() != nullptr) {
    double q41 = 0, q80 = 0;
    for (const auto& t : m->gguf_file()->tensors()) {
      if (t.n_dims != 2) continue;
      if (t.type == km::gguf::TensorType::kQ4_1) q41 += static_cast<double>(t.n_elements());
      if (t.type == km::gguf::TensorType::kQ8_0) q80 += static_cast<double>(t.n_elements());
    }
    if (q41 + q80 > 0) ceil_factor = (q41 * 19.0 / 16 + q80 * 18.0 / 16) / (q41 + q80);
  }
  std::printf("#%10s %8s %12s %12s %10s %12s %11s\n", "what", "tokens", "time_ms", "per_token",
              "steps", "floor_steps", "ceil_steps");
  std::printf(" %10s %8d %12.1f %12.3f %10s %12s %11s\n", "prefill", ctx, t_prefill * 1e3,
              t_prefill * 1e3 / ctx, "-", "-", "-");
  std::printf(" %10s %8d %12.2f %12.2f %10.2f %12s %11s\n", "decode", 1, t_step * 1e3, t_step * 1e3,
              1.0, "-", "-");
  for (std::size_t i = 0; i < passes.size(); ++i) {
    const int v = passes[i];
    const double t = median_of(static_cast<int>(i) + 1);
    // The pass at the peaks: v tokens at ctx + 1 .. ctx + v keys.
    const double t_mat = peak > 0 ? 2 * v * matrix_macs(c) / (ppeak * 1e9) : 0.0;
    const double t_att =
        peak > 0 ? 2 * v * attention_macs(c, ctx + (v + 1) / 2.0) / (peak * 1e9) : 0.0;
    const std::string ceil = ceil_factor > 0 ? fmt2((t_mat * ceil_factor + t_att) / t_step) : "-";
    std::printf(" %10s %8d %12.2f %12.3f %10.2f %12.2f %11s\n", "verify", v, t * 1e3, t * 1e3 / v,
                t / t_step, (t_mat + t_att) / t_step, ceil.c_str());
  }
  std::printf("# prefill %.0f tokens/s at %d tokens; decode step at context %d: %.2f ms (TPOT)\n",
              ctx / t_prefill, ctx, ctx, t_step * 1e3);
  if (peak > 0)
    std::printf(
        "# peaks of the %d threads in the same run: FMA (%s, attention) %.1f GFLOP/s, 16-bit "
        "products (%s, the matrices) %.1f GOP/s; floor_steps = the pass's multiply-adds at "
        "those peaks, in decode steps; ceil_steps = the same with the products at the "
        "definition's ceiling (16/19 of the peak for Q4_1, 16/18 for Q8_0) and nothing else "
        "(norms, softmax, quantizer, joins) costing time\n",
        omp_get_max_threads(), avx512 ? "AVX-512" : "AVX2", peak, avx512 ? "vpdpwssd" : "as FMA",
        ppeak);
  if (t_copy > 0)
    std::printf(
        "# memcpy of the %.1f MB of tensors in the same run: %.2f ms = %.3f of a decode step\n",
        static_cast<double>(weight_bytes) / 1e6, t_copy * 1e3, t_copy / t_step);

  // The tokenizer (GGUF models only): 10,000 characters of English prose and
  // a run of 10,000 spaces (the longest pre-token there is), each against the
  // prefill of as many tokens as it yields, at this run's prefill speed.
  if (m->gguf_file() != nullptr) {
    const auto tok = km::BpeTokenizer::from_gguf(*m->gguf_file(), &err);
    std::ifstream in(KVXFER_DATA_DIR "/apache-2.0.txt", std::ios::binary);
    std::string prose((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!tok || prose.size() < 10000) {
      std::fprintf(stderr, "model_perf: tokenizer or text unavailable: %s\n", err.c_str());
      return 1;
    }
    prose.resize(10000);
    for (const auto& [what, text] : {std::pair<const char*, std::string>{"prose", prose},
                                     {"spaces", std::string(10000, ' ')}}) {
      std::vector<std::int32_t> ids;
      const double t = median_time(reps, [&] {
        ids.clear();
        if (!tok->encode(text, false, &ids, &err)) std::fprintf(stderr, "%s\n", err.c_str());
      });
      std::printf(
          "# tokenizer, %zu characters of %s: %.2f ms for %zu tokens = %.2g of their "
          "prefill\n",
          text.size(), what, t * 1e3, ids.size(), t / (t_prefill / ctx * ids.size()));
    }
  }
  return 0;
}
