// Matrix products of the model runner with weights in ggml's block formats,
// read in place from the mapped checkpoint.
//
// Definition (one for every CPU path; docs/MODEL.md):
//   * F32 matrices keep llama2.c run.c's order: one float32 accumulator, k
//     ascending, v += w*x (no fma), so llama2.c checkpoints keep run.c's bits;
//   * Q4_1/Q8_0 matrices take x quantized per block of 32 elements to int16
//     (quantize_x below; ggml's Q8_1 with 16-bit codes, because 8-bit codes
//     changed SmolLM2's greedy answers), and sum integer products per block:
//       isum[b] = sum over k in block b of qw[k] * qx[k]    (exact, int32)
//     with qw the block's 4-bit code (Q4_1) or int8 code (Q8_0).  Then, per
//     (row, token), blocks ascending, acc starting at +0:
//       acc = fma(RN(dw[b] * dx[b]), RN(float(isum[b])), acc)
//       acc = fma(mw[b], sx[b], acc)                          (Q4_1 only)
//     where dw, mw are the block's fp16 scale and minimum as float32 and dx,
//     sx the activation block's scale and dx * sum(qx) (quantize_x).  This is
//     ggml's vec_dot_q4_1_q8_1 / q8_0_q8_0 with 16-bit activation codes
//     and one rounding order fixed.
// The integer sums are exact, so out[t][i] depends only on weight row i and
// activation row t: not on the number of tokens, the tile it falls in, the
// thread count or the CPU path (AVX-512 VNNI, AVX2 or scalar).  That is what
// makes a batched pass (prefill, speculative verification) bit-identical to
// decoding one token at a time.
//
// Kernels: AVX-512 VNNI reads 16 rows at a time from a packed copy of the
// matrix (pack_weights; one lane per row, up to 8 tokens per pass over the
// group); AVX2 unpacks 8-row panels to int16 (one lane per token) and reads
// the blocks in place for one token; the scalar path is the definition.
// Threading: matmul parallelises over groups or panels of rows with OpenMP;
// every output element is computed by one thread.  Safe to call concurrently with
// distinct outputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

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
  // Optional: the same matrix in the AVX-512 kernel's layout (pack_weights),
  // owned by the caller; nullptr: the kernel repacks 16 rows at a time.
  const std::uint8_t* packed = nullptr;
  const float* f32() const { return static_cast<const float*>(data); }
};

// The AVX-512 kernel's layout of a Q4_1/Q8_0 matrix.  Rows in groups of
// kPackRows (the last group padded with zero rows); a group is its cols/32
// blocks in order; a block holds the 16 rows' block b:
//   Q4_1, kPackedQ4_1Block bytes: d[16] fp16, m[16] fp16 (row r at index r),
//     then 4 chunks of 64 bytes.  Chunk j holds columns 8j..8j+7 of the
//     block; row r is the little-endian word at byte 4r, with the code of
//     column 8j + 2p in bits 4p..4p+3 and that of 8j + 2p + 1 in bits
//     16+4p..19+4p (p = 0..3), so (word >> 4p) & 0x000F000F is the pair as
//     two int16.
//   Q8_0, kPackedQ8_0Block bytes: d[16] fp16, then 8 chunks of 64 bytes.
//     Chunk j holds columns 4j..4j+3; row r's 4 bytes are the codes of
//     columns (4j, 4j+2, 4j+1, 4j+3), so the int16 words' low bytes are the
//     pair (4j, 4j+1) and their high bytes the pair (4j+2, 4j+3).
// The bytes are the matrix's own codes and fp16 scales, moved: the products
// (and their bits) are those of the block format.
constexpr int kPackRows = 16;
constexpr std::size_t kPackedQ4_1Block = 320, kPackedQ8_0Block = 544;
// Bytes of w packed: groups x cols/32 x the block size; 0 for F32.
std::size_t packed_bytes(const WeightMatrix& w);
// Packs every group of w (a Q4_1/Q8_0 matrix) into dst[packed_bytes(w)]
// (parallel over groups, OpenMP).  Use the result as w.packed.
void pack_weights(const WeightMatrix& w, std::uint8_t* dst);

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
bool have_avx512();  // AVX-512 F, DQ, BW, VL and VNNI, and have_avx2()
void matmul_path(Path path, const WeightMatrix& w, const float* x, int n_tokens, float* out);
void matmul_many_path(Path path, const WeightMatrix* const* ws, float* const* outs, int n_mats,
                      const float* x, int n_tokens);

// Tokens per group of quantized activations (the AVX2 and scalar kernels;
// the AVX-512 kernel takes groups of 1), and weight rows per panel.
constexpr int kGroup = 16;
constexpr int kPanelRows = 8;

// x [n][cols] (cols a multiple of 32) quantized per 32-element block:
//   amax = max |x[k]|, dx = amax / 32767, id = dx > 0 ? 1 / dx : 0,
//   qx[k] = nearbyint(x[k] * id) (ties to even) clamped to [-32767, 32767]
//   (NaN -> 0), qsum = sum qx[k], sx = dx * float(qsum).
// Stored for the kernels in groups of `group` tokens (the last padded with
// zeros): q [g][block][k / 2][token][2] int16, so with group 16 one 64-byte
// row holds 2 consecutive codes of 16 tokens, and with group 1 the codes are
// [token][cols]; dx, sx, qsum [g][block][token].
struct QuantizedX {
  int n = 0, nb = 0, group = kGroup, groups = 0;
  std::vector<std::int16_t> q;
  std::vector<float> dx, sx;
  std::vector<std::int32_t> qsum;
  const std::int16_t* qrow(int g, int b, int k2) const {
    return q.data() + ((static_cast<std::size_t>(g) * nb + b) * 16 + k2) * 2 * group;
  }
  std::int16_t* qrow_mut(int g, int b, int k2) { return const_cast<std::int16_t*>(qrow(g, b, k2)); }
  std::size_t at(int g, int b) const { return (static_cast<std::size_t>(g) * nb + b) * group; }
  // Sizes the arrays; group is kGroup or 1 (the AVX-512 quantizer and
  // kernel take 1).  With group kGroup the padding
  // lanes are zero; with group 1 there are none, and the arrays keep their
  // old contents until quantized (a reused QuantizedX is not refilled).
  void prepare(int n_, int nb_, int group_ = kGroup);
};
void quantize_x(const float* x, int n, int cols, QuantizedX* out);       // scalar
void quantize_x_avx2(const float* x, int n, int cols, QuantizedX* out);  // the same bits
// Tokens [t0, t1) and blocks [b0, b1) only, into an out already prepare()d
// (threads may quantize disjoint block ranges at once: they share no cache
// line).
void quantize_tokens(const float* x, int cols, int t0, int t1, int b0, int b1, QuantizedX* out);
void quantize_tokens_avx2(const float* x, int cols, int t0, int t1, int b0, int b1,
                          QuantizedX* out);
// out prepared with group 1; requires have_avx512().
void quantize_tokens_avx512(const float* x, int cols, int t0, int t1, int b0, int b1,
                            QuantizedX* out);

// Up to kPanelRows weight rows unpacked for the kernels: w [kPanelRows][cols]
// codes as int16 (Q4_1: 0..15; Q8_0: -128..127), d and m [kPanelRows][nb]
// float32 (m 0 for Q8_0).  Rows past n repeat row row0 (their products are
// dropped).
struct Panel {
  int cols = 0, nb = 0;
  bool q4 = true;
  std::vector<std::int16_t> w;
  std::vector<float> d, m;
  void reset(int cols_);
};
void unpack_panel(const WeightMatrix& w, int row0, int n, Panel* p);       // scalar
void unpack_panel_avx2(const WeightMatrix& w, int row0, int n, Panel* p);  // the same bytes

// out[r * kGroup + t] for the panel's kPanelRows rows and group g's tokens
// t < n_lanes (n_lanes <= kGroup; out has kPanelRows * kGroup floats, the
// lanes past n_lanes are scratch): the definition above.
void panel_products_avx2(const Panel& p, const QuantizedX& x, int g, int n_lanes, float* out);
// One token (an AVX2 decode step): rows [row0, row0 + n), n <= kOneTokenRows,
// read in place.  xq [cols] the token's codes in order, dx and sx [nb] its
// block scales (from a QuantizedX).  out[r] for r < n: the definition above.
constexpr int kOneTokenRows = 8;
// Token counts up to which the activations are quantized by one thread.
constexpr int kFewTokens = 4;
// Bytes of one packed group of w (a Q4_1/Q8_0 matrix): cols/32 blocks.
std::size_t packed_group_bytes(const WeightMatrix& w);
// Group `group` of a Q4_1/Q8_0 matrix in the packed layout above, into
// dst[packed_group_bytes(w)] (scalar).
void pack_group(const WeightMatrix& w, int group, std::uint8_t* dst);
// The AVX-512 kernel: the first n_rows (<= 16) rows of one packed group
// against every token of x (prepared with group 1): out[t * out_stride + r].
// Tokens go kTileTokens at a time, so a group's blocks are read from L1 by
// every tile after the first; the last tile prefetches `next` (the group
// likely to come next; nullptr: none).
constexpr int kTileTokens = 8;
void group_products_avx512(WeightType type, const std::uint8_t* group, const std::uint8_t* next,
                           int n_rows, const QuantizedX& x, int cols, float* out,
                           std::size_t out_stride);
// Rows [row0, row0 + n) of a Q4_1/Q8_0 matrix as the one-token kernel reads
// them in place, kOneTokenRows rows at a time: each row's byte offset from
// base (rows past n repeat row0; their products are dropped), and the lines
// of the next kOneTokenRows rows, prefetched a share per block.
struct RowSpan {
  RowSpan(const WeightMatrix& w, int row0, int n);
  const std::uint8_t* block(int r, int b) const {
    return base + offs[r] + static_cast<std::size_t>(b) * bb;
  }
  void prefetch_next(int b) const {
    for (std::size_t l = b * per_block; l < (b + 1) * per_block && l < lines; ++l)
      __builtin_prefetch(next + 64 * l, 0, 3);
  }
  bool q4;
  int nb, bb;  // blocks per row, bytes per block
  const std::uint8_t* base;
  alignas(64) std::int32_t offs[kOneTokenRows];
  const std::uint8_t* next;
  std::size_t lines, per_block;
};
void rows_one_token_avx2(const WeightMatrix& w, int row0, int n, const std::int16_t* xq,
                         const float* dx, const float* sx, float* out);
}  // namespace detail

}  // namespace kvxfer::model
