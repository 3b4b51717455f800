// Quantized matrix products: dispatch, the scalar emulation and the F32
// path; see qmatmul.h.  Built with -ffp-contract=off (CMakeLists.txt), so
// every float operation here is the one written.
#include "models/qmatmul.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "codec/codec_math.h"
#include "models/lanes.h"

namespace kvxfer::model {
namespace {

// Rows dequantized together and reused by every token: the AVX2 tile's 3,
// the AVX-512 tile's 3 row pairs.
constexpr int kPanelRows = 3;
constexpr int kPanelRows512 = 6;
constexpr std::int64_t kParallelWork = 1 << 15;
constexpr int kTokenChunk = 64;  // tokens per product: 64 x 1536 floats fit in L2
constexpr int kMaxMats = 4;      // matmul_many's matrices in one parallel loop

// n floats in *mem, the returned pointer 64-byte aligned.
float* aligned64(std::vector<float>* mem, std::size_t n) {
  mem->resize(n + 16);
  const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(mem->data());
  return reinterpret_cast<float*>((p + 63) & ~static_cast<std::uintptr_t>(63));
}

float half(const std::uint8_t* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return codec::f16_to_f32(h);
}

void panel_products_scalar(const float* panel, int n_rows, int cols, const float* x, int n_tokens,
                           float* out, int out_stride) {
  for (int t = 0; t < n_tokens; ++t) {
    const float* xr = x + static_cast<std::size_t>(t) * cols;
    for (int r = 0; r < n_rows; ++r) {
      const float* wr = panel + static_cast<std::size_t>(r) * cols;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < cols; ++k) acc[k % 8] = std::fma(wr[k], xr[k], acc[k % 8]);
      out[static_cast<std::size_t>(t) * out_stride + r] = detail::lane_sum(acc);
    }
  }
}

void matmul_f32(const WeightMatrix& w, const float* x, int n, float* out) {
  const int rows = w.rows, cols = w.cols;
  const std::int64_t work = static_cast<std::int64_t>(n) * rows * cols;
#pragma omp parallel for collapse(2) schedule(static) if (work >= kParallelWork)
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < rows; ++i) {
      const float* wr = w.f32() + static_cast<std::size_t>(i) * cols;
      const float* xr = x + static_cast<std::size_t>(t) * cols;
      float val = 0.0f;
      for (int j = 0; j < cols; ++j) val += wr[j] * xr[j];
      out[static_cast<std::size_t>(t) * rows + i] = val;
    }
  }
}

}  // namespace

void dequantize_row(const WeightMatrix& w, int row, float* out) {
  const std::uint8_t* p = static_cast<const std::uint8_t*>(w.data);
  const int nb = w.cols / 32;
  switch (w.type) {
    case WeightType::kF32:
      std::memcpy(out, w.f32() + static_cast<std::size_t>(row) * w.cols,
                  static_cast<std::size_t>(w.cols) * sizeof(float));
      return;
    case WeightType::kQ4_1:
      p += static_cast<std::size_t>(row) * nb * 20;
      for (int b = 0; b < nb; ++b, p += 20) {
        const float d = half(p), m = half(p + 2);
        for (int j = 0; j < 16; ++j) {
          const float w0 = d * static_cast<float>(p[4 + j] & 0xF);
          const float w1 = d * static_cast<float>(p[4 + j] >> 4);
          out[b * 32 + j] = w0 + m;
          out[b * 32 + j + 16] = w1 + m;
        }
      }
      return;
    case WeightType::kQ8_0:
      p += static_cast<std::size_t>(row) * nb * 34;
      for (int b = 0; b < nb; ++b, p += 34) {
        const float d = half(p);
        for (int j = 0; j < 32; ++j)
          out[b * 32 + j] = d * static_cast<float>(static_cast<std::int8_t>(p[2 + j]));
      }
      return;
  }
}

namespace detail {

bool have_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return yes;
}

bool have_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return have_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return yes;
}

void matmul_path(Path path, const WeightMatrix& w, const float* x, int n, float* out) {
  const WeightMatrix* ws[1] = {&w};
  float* outs[1] = {out};
  matmul_many_path(path, ws, outs, 1, x, n);
}

void matmul_many_path(Path path, const WeightMatrix* const* ws, float* const* outs, int n_mats,
                      const float* x, int n) {
  if (n <= 0 || n_mats <= 0) return;
  const int cols = ws[0]->cols;
  // One loop over the panels of all the matrices needs block types only.
  bool one_loop = n_mats <= kMaxMats;
  for (int m = 0; m < n_mats; ++m) one_loop = one_loop && ws[m]->type != WeightType::kF32;
  if (!one_loop) {  // one matrix at a time
    for (int m = 0; m < n_mats; ++m)
      if (ws[m]->type == WeightType::kF32)
        matmul_f32(*ws[m], x, n, outs[m]);
      else
        matmul_many_path(path, ws + m, outs + m, 1, x, n);
    return;
  }
  // Prefill-sized batches go in chunks of tokens whose activations stay in L2
  // while every panel reads them (each output still has one fixed order).
  if (n > kTokenChunk) {
    float* part[kMaxMats];
    for (int t0 = 0; t0 < n; t0 += kTokenChunk) {
      for (int m = 0; m < n_mats; ++m)
        part[m] = outs[m] + static_cast<std::size_t>(t0) * ws[m]->rows;
      matmul_many_path(path, ws, part, n_mats, x + static_cast<std::size_t>(t0) * cols,
                       n - t0 < kTokenChunk ? n - t0 : kTokenChunk);
    }
    return;
  }
  // One token on the SIMD paths dequantizes in registers (AVX2, also for
  // the AVX-512 path: the same values and fmas) and needs no panel.
  const bool one = path != Path::kScalar && n == 1;
  const bool wide = path == Path::kAvx512 && n > 1;
  const bool avx2 = path == Path::kAvx2 || (path == Path::kAvx512 && n == 1);
  const int panel_rows = wide ? kPanelRows512 : kPanelRows;
  // The panels of all the matrices in one loop: one join, and the threads
  // share out the rows of all of them.
  int first_panel[kMaxMats + 1] = {};
  std::int64_t work = 0;
  for (int m = 0; m < n_mats; ++m) {
    first_panel[m + 1] = first_panel[m] + (ws[m]->rows + panel_rows - 1) / panel_rows;
    work += static_cast<std::int64_t>(n) * ws[m]->rows * cols;
  }
  const int n_panels = first_panel[n_mats];
  // The batched tiles read x with aligned 32-byte loads: give them aligned rows.
  std::vector<float> x_mem;
  if (path != Path::kScalar && n > 1 && reinterpret_cast<std::uintptr_t>(x) % 32 != 0) {
    const std::size_t len = static_cast<std::size_t>(n) * cols;
    float* xa = aligned64(&x_mem, len);
    std::memcpy(xa, x, len * sizeof(float));
    x = xa;
  }
#pragma omp parallel if (work >= kParallelWork)
  {
    std::vector<float> panel_mem, acc_mem;
    float* panel =
        one ? nullptr : aligned64(&panel_mem, static_cast<std::size_t>(panel_rows) * cols);
    // The products of a panel: [token][row], the AVX-512 tile's [row][token].
    const int ld = (n + 7) / 8 * 8;
    std::vector<float> tile(static_cast<std::size_t>(ld) * panel_rows);
    // The AVX2 accumulators, 8 lanes per (token, row).
    float* acc =
        avx2 && !one ? aligned64(&acc_mem, static_cast<std::size_t>(n) * panel_rows * 8) : nullptr;
    auto run_panel = [&](int pi) {
      int m = 0;
      while (pi >= first_panel[m + 1]) ++m;
      const WeightMatrix& w = *ws[m];
      float* out = outs[m];
      const int rows = w.rows, p = pi - first_panel[m];
      const int r0 = p * panel_rows, nr = rows - r0 < panel_rows ? rows - r0 : panel_rows;
      if (one) {
        rows_one_token_avx2(w, r0, nr, x, tile.data());
      } else if (wide) {
        dequantize_pairs_avx512(w, r0, nr, panel);
        pair_products_avx512(panel, nr, cols, x, n, tile.data(), ld);
        // Token-major, as out is (its token rows may share few cache sets).
        for (int t = 0; t < n; ++t)
          for (int r = 0; r < nr; ++r)
            out[static_cast<std::size_t>(t) * rows + r0 + r] =
                tile[static_cast<std::size_t>(r) * ld + t];
        return;
      } else if (avx2) {
        dequantize_rows_avx2(w, r0, nr, panel);
        panel_products_avx2(panel, nr, cols, x, n, tile.data(), panel_rows, acc);
      } else {
        for (int r = 0; r < nr; ++r)
          dequantize_row(w, r0 + r, panel + static_cast<std::size_t>(r) * cols);
        panel_products_scalar(panel, nr, cols, x, n, tile.data(), panel_rows);
      }
      for (int t = 0; t < n; ++t)
        for (int r = 0; r < nr; ++r)
          out[static_cast<std::size_t>(t) * rows + r0 + r] =
              tile[static_cast<std::size_t>(t) * panel_rows + r];
    };
    // On a shared machine one thread may run slower, so panels are handed out
    // as the threads ask; every output is still computed by one thread in one
    // order.  The AVX-512 tiles prefetch the next panel, so their chunks
    // shrink only towards the end (guided).
    if (wide) {
#pragma omp for schedule(guided, 4)
      for (int pi = 0; pi < n_panels; ++pi) run_panel(pi);
    } else {
#pragma omp for schedule(dynamic, 16)
      for (int pi = 0; pi < n_panels; ++pi) run_panel(pi);
    }
  }
}

}  // namespace detail

namespace {
detail::Path best_path() {
  return detail::have_avx512() ? detail::Path::kAvx512
         : detail::have_avx2() ? detail::Path::kAvx2
                               : detail::Path::kScalar;
}
}  // namespace

void matmul_many(const WeightMatrix* const* ws, float* const* outs, int n_mats, const float* x,
                 int n_tokens) {
  detail::matmul_many_path(best_path(), ws, outs, n_mats, x, n_tokens);
}

void matmul(const WeightMatrix& w, const float* x, int n_tokens, float* out) {
  detail::matmul_path(best_path(), w, x, n_tokens, out);
}

}  // namespace kvxfer::model
