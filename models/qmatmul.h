// Matrix products of the model runner with weights in ggml's block formats,
// read in place from the mapped checkpoint.
//
// Definition (one for every CPU path; docs/MODEL.md):
//   out[t][i] = sum over k of w[i][k] * x[t][k], where
//   * w[i][k] is the dequantized weight, exactly as dequantize_row writes it
//     (Q4_1: d*q + m, Q8_0: d*q; d, m from fp16; one float32 multiply and one
//     float32 add, no fma);
//   * F32 matrices keep llama2.c run.c's order: one float32 accumulator, k
//     ascending, v += w*x (no fma), so llama2.c checkpoints keep run.c's bits;
//   * Q4_1/Q8_0 matrices use 8 float32 accumulators: element k goes to lane
//     k mod 8 by fma in ascending k, and the lanes are summed as
//     ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
// out[t][i] depends only on weight row i and activation row t: not on the
// number of tokens, the tile it falls in, the thread count or the CPU path
// (AVX-512, AVX2+FMA+F16C or the scalar emulation).  That is what makes a batched pass
// (prefill, speculative verification) bit-identical to decoding one token at
// a time.
//
// Threading: matmul parallelises over panels of rows with OpenMP; every
// output element is computed by one thread.  Safe to call concurrently with
// distinct outputs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvxfer::model {

enum class WeightType { kF32, kQ4_1, kQ8_0 };

// A rows x cols matrix, row-major; each row is cols/32 blocks (Q4_1: 20
// bytes, Q8_0: 34 bytes; ggml-common.h block_q4_1 / block_q8_0) or cols
// floats.  cols must be a multiple of 32 for the block types.  Does not own
// the data, which need not be aligned.
struct WeightMatrix {
  WeightType type = WeightType::kF32;
  int rows = 0;
  int cols = 0;
  const void* data = nullptr;
  const float* f32() const { return static_cast<const float*>(data); }
};

// out[t * w.rows + i] = row i of w times row t of x, for t < n_tokens.
// x: float32 [n_tokens][w.cols]; out: float32 [n_tokens][w.rows]; neither
// may alias the other.
void matmul(const WeightMatrix& w, const float* x, int n_tokens, float* out);

// matmul of n_mats matrices with the same cols on the same x: outs[m] as
// out above for ws[m], with matmul's bits.  Up to 4 matrices share one
// parallel loop over their panels (one join, the rows of all of them shared
// out), as the runner does for q/k/v and for the two feed-forward inputs.
void matmul_many(const WeightMatrix* const* ws, float* const* outs, int n_mats, const float* x,
                 int n_tokens);

// Row `row` of w as float32 [w.cols] (the w[i][k] of the definition above).
void dequantize_row(const WeightMatrix& w, int row, float* out);

namespace detail {
// Exposed for the tests: the same product on a chosen path.
enum class Path { kScalar, kAvx2, kAvx512 };
bool have_avx2();
bool have_avx512();  // AVX-512 F, DQ and VL, and have_avx2()
void matmul_path(Path path, const WeightMatrix& w, const float* x, int n_tokens, float* out);
void matmul_many_path(Path path, const WeightMatrix* const* ws, float* const* outs, int n_mats,
                      const float* x, int n_tokens);
// AVX2 kernels (qmatmul_avx2.cc): dequantize `n` rows starting at `row0`
// into panel[n][cols] (32-byte aligned), and the lane-ordered products of a
// panel.
void dequantize_rows_avx2(const WeightMatrix& w, int row0, int n, float* panel);
// One token against rows [row0, row0 + n), n <= 4: out[r] = row r0+r times x,
// the weights dequantized in registers (the bits of the panel path).
void rows_one_token_avx2(const WeightMatrix& w, int row0, int n, const float* x, float* out);
// n_rows <= 3; acc: scratch of n_tokens * n_rows * 8 floats, 32-byte aligned.
void panel_products_avx2(const float* panel, int n_rows, int cols, const float* x, int n_tokens,
                         float* out, int out_stride, float* acc);
// AVX-512 kernels (qmatmul_avx512.cc), for passes of 2 or more tokens:
// dequantize rows [row0, row0 + n), n <= 6, as row pairs into
// panel[(n + 1) / 2][cols / 8][16] (64-byte aligned; pair p's group g holds
// row 2p's elements 8g.. then row 2p+1's, an odd last row paired with
// itself), and the lane-ordered products of such a panel with x (32-byte
// aligned rows): out[r * ld + t] for r < n_rows rounded up to even and
// t < n_tokens rounded up to 8 (the padding is scratch), ld >= that.
void dequantize_pairs_avx512(const WeightMatrix& w, int row0, int n, float* panel);
void pair_products_avx512(const float* panel, int n_rows, int cols, const float* x, int n_tokens,
                          float* out, int ld);
}  // namespace detail

}  // namespace kvxfer::model
