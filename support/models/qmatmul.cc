// Quantized matrix products: dispatch, the scalar emulation and the F32
// path; see qmatmul.h.  Built with -ffp-contract=off (CMakeLists.txt), so
// every float operation here is the one written.
#include "models/qmatmul.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "codec/codec_math.h"

namespace kvxfer::model {
namespace {

constexpr std::int64_t kParallelWork = 1 << 15;
constexpr int kTokenChunk = 64;  // tokens per product: 64 x 1536 floats fit in L2
constexpr int kMaxMats = 4;      // matmul_many's matrices in one parallel loop

float half(const std::uint8_t* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return codec::f16_to_f32(h);
}

// The definition of qmatmul.h, one (row, token) at a time.
void panel_products_scalar(const detail::Panel& p, const detail::QuantizedX& x, int g, int n_lanes,
                           float* out) {
  for (int r = 0; r < detail::kPanelRows; ++r) {
    const std::int16_t* w = &p.w[static_cast<std::size_t>(r) * p.cols];
    for (int t = 0; t < n_lanes; ++t) {
      float acc = 0.0f;
      for (int b = 0; b < p.nb; ++b) {
        std::int32_t isum = 0;
        for (int k = 0; k < 32; ++k) isum += w[b * 32 + k] * x.qrow(g, b, k / 2)[2 * t + k % 2];
        const std::size_t rb = static_cast<std::size_t>(r) * p.nb + b, at = x.at(g, b) + t;
        acc = std::fma(p.d[rb] * x.dx[at], static_cast<float>(isum), acc);
        if (p.q4) acc = std::fma(p.m[rb], x.sx[at], acc);
      }
      out[r * detail::kGroup + t] = acc;
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

std::size_t packed_bytes(const WeightMatrix& w) {
  if (w.type == WeightType::kF32) return 0;
  const std::size_t groups = (static_cast<std::size_t>(w.rows) + kPackRows - 1) / kPackRows;
  return groups * detail::packed_group_bytes(w);
}

void pack_weights(const WeightMatrix& w, std::uint8_t* dst) {
  const int groups = (w.rows + kPackRows - 1) / kPackRows;
  const std::size_t group_bytes = detail::packed_group_bytes(w);
#pragma omp parallel for schedule(static)
  for (int g = 0; g < groups; ++g)
    detail::pack_group(w, g, dst + static_cast<std::size_t>(g) * group_bytes);
}

namespace detail {

void quantize_x(const float* x, int n, int cols, QuantizedX* out) {
  out->prepare(n, cols / 32);
  quantize_tokens(x, cols, 0, n, 0, cols / 32, out);
}

void quantize_tokens(const float* x, int cols, int t0, int t1, int b0, int b1, QuantizedX* out) {
  for (int t = t0; t < t1; ++t) {
    const int g = t / out->group, lane = t % out->group;
    for (int b = b0; b < b1; ++b) {
      const float* xb = x + static_cast<std::size_t>(t) * cols + static_cast<std::size_t>(b) * 32;
      float amax = 0.0f;
      for (int k = 0; k < 32; ++k) amax = std::fabs(xb[k]) > amax ? std::fabs(xb[k]) : amax;
      const float dx = amax / 32767.0f;
      const float id = dx > 0.0f ? 1.0f / dx : 0.0f;
      std::int32_t qsum = 0;
      for (int k = 0; k < 32; ++k) {
        const float v = xb[k] * id;
        const std::int32_t q = v >= 32767.0f    ? 32767
                               : v <= -32767.0f ? -32767
                               : v == v         ? static_cast<std::int32_t>(std::nearbyint(v))
                                                : 0;
        out->qrow_mut(g, b, k / 2)[2 * lane + k % 2] = static_cast<std::int16_t>(q);
        qsum += q;
      }
      const std::size_t at = out->at(g, b) + lane;
      out->dx[at] = dx;
      out->qsum[at] = qsum;
      out->sx[at] = dx * static_cast<float>(qsum);
    }
  }
}

void QuantizedX::prepare(int n_, int nb_, int group_) {
  n = n_;
  nb = nb_;
  group = group_;
  groups = (n_ + group - 1) / group;
  const std::size_t slots = static_cast<std::size_t>(groups) * nb * group;
  if (group == 1) {  // every slot is written by the quantizer
    q.resize(slots * 32);
    dx.resize(slots);
    sx.resize(slots);
    qsum.resize(slots);
    return;
  }
  q.assign(slots * 32, 0);
  dx.assign(slots, 0.0f);
  sx.assign(slots, 0.0f);
  qsum.assign(slots, 0);
}

RowSpan::RowSpan(const WeightMatrix& w, int row0, int n)
    : q4(w.type == WeightType::kQ4_1), nb(w.cols / 32), bb(q4 ? 20 : 34) {
  const std::size_t row_bytes = static_cast<std::size_t>(nb) * bb;
  base = static_cast<const std::uint8_t*>(w.data) + static_cast<std::size_t>(row0) * row_bytes;
  for (int r = 0; r < kOneTokenRows; ++r)
    offs[r] = r < n ? static_cast<std::int32_t>(static_cast<std::size_t>(r) * row_bytes) : 0;
  next = base + static_cast<std::size_t>(kOneTokenRows) * row_bytes;
  lines = (static_cast<std::size_t>(kOneTokenRows) * row_bytes + 63) / 64;
  per_block = (lines + nb - 1) / nb;
}

void Panel::reset(int cols_) {
  cols = cols_;
  nb = cols_ / 32;
  w.resize(static_cast<std::size_t>(kPanelRows) * cols);
  d.resize(static_cast<std::size_t>(kPanelRows) * nb);
  m.resize(d.size());
}

void unpack_panel(const WeightMatrix& w, int row0, int n, Panel* p) {
  const int cols = w.cols, nb = cols / 32;
  p->reset(cols);
  p->q4 = w.type == WeightType::kQ4_1;
  const std::uint8_t* base = static_cast<const std::uint8_t*>(w.data);
  const std::size_t row_bytes = static_cast<std::size_t>(nb) * (p->q4 ? 20 : 34);
  for (int r = 0; r < kPanelRows; ++r) {
    const std::uint8_t* src = base + static_cast<std::size_t>(row0 + (r < n ? r : 0)) * row_bytes;
    std::int16_t* dst = &p->w[static_cast<std::size_t>(r) * cols];
    for (int b = 0; b < nb; ++b) {
      const std::size_t rb = static_cast<std::size_t>(r) * nb + b;
      if (p->q4) {
        const std::uint8_t* blk = src + static_cast<std::size_t>(b) * 20;
        p->d[rb] = half(blk);
        p->m[rb] = half(blk + 2);
        for (int j = 0; j < 16; ++j) {
          dst[b * 32 + j] = blk[4 + j] & 0xF;
          dst[b * 32 + 16 + j] = blk[4 + j] >> 4;
        }
      } else {
        const std::uint8_t* blk = src + static_cast<std::size_t>(b) * 34;
        p->d[rb] = half(blk);
        p->m[rb] = 0.0f;
        for (int j = 0; j < 32; ++j) dst[b * 32 + j] = static_cast<std::int8_t>(blk[2 + j]);
      }
    }
  }
}

std::size_t packed_group_bytes(const WeightMatrix& w) {
  return static_cast<std::size_t>(w.cols / 32) *
         (w.type == WeightType::kQ4_1 ? kPackedQ4_1Block : kPackedQ8_0Block);
}

void pack_group(const WeightMatrix& w, int group, std::uint8_t* dst) {
  const bool q4 = w.type == WeightType::kQ4_1;
  const int nb = w.cols / 32, bb = q4 ? 20 : 34;
  const std::size_t row_bytes = static_cast<std::size_t>(nb) * bb;
  const std::size_t block = q4 ? kPackedQ4_1Block : kPackedQ8_0Block;
  const int scales = q4 ? 64 : 32;
  const std::uint8_t* base = static_cast<const std::uint8_t*>(w.data);
  std::memset(dst, 0, packed_group_bytes(w));
  for (int r = 0; r < kPackRows; ++r) {
    const int row = group * kPackRows + r;
    if (row >= w.rows) break;  // padding rows stay zero
    for (int b = 0; b < nb; ++b) {
      const std::uint8_t* src =
          base + static_cast<std::size_t>(row) * row_bytes + static_cast<std::size_t>(b) * bb;
      std::uint8_t* blk = dst + static_cast<std::size_t>(b) * block;
      std::memcpy(blk + 2 * r, src, 2);                   // d
      if (q4) std::memcpy(blk + 32 + 2 * r, src + 2, 2);  // m
      std::uint8_t* codes = blk + scales;
      if (q4) {
        auto code = [&](int k) { return k < 16 ? src[4 + k] & 0xF : src[4 + k - 16] >> 4; };
        for (int j = 0; j < 4; ++j) {
          std::uint32_t word = 0;
          for (int p = 0; p < 4; ++p)
            word |= static_cast<std::uint32_t>(code(8 * j + 2 * p)) << (4 * p) |
                    static_cast<std::uint32_t>(code(8 * j + 2 * p + 1)) << (16 + 4 * p);
          std::memcpy(codes + 64 * j + 4 * r, &word, 4);
        }
      } else {
        for (int j = 0; j < 8; ++j) {
          const std::uint8_t* c = src + 2 + 4 * j;
          const std::uint8_t bytes[4] = {c[0], c[2], c[1], c[3]};
          std::memcpy(codes + 64 * j + 4 * r, bytes, 4);
        }
      }
    }
  }
}

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
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return yes;
}

void matmul_path(Path path, const WeightMatrix& w, const float* x, int n, float* out) {
  const WeightMatrix* ws[1] = {&w};
  float* outs[1] = {out};
  matmul_many_path(path, ws, outs, 1, x, n);
}

namespace {

// The AVX-512 path: groups of 16 rows of every matrix in one parallel loop,
// each group against every token (group_products_avx512), the activations
// quantized token-major.
void packed_products_avx512(const WeightMatrix* const* ws, float* const* outs, int n_mats,
                            const float* x, int n, bool parallel) {
  const int cols = ws[0]->cols, nb = cols / 32;
  // The calling thread's, reused without refilling; the team reads it
  // through this reference (a thread_local named inside the region would be
  // each thread's own).
  thread_local QuantizedX caller_qx;
  QuantizedX& qx = caller_qx;
  qx.prepare(n, nb, 1);
  if (n <= kFewTokens) quantize_tokens_avx512(x, cols, 0, n, 0, nb, &qx);
  int first[kMaxMats + 1] = {};
  for (int m = 0; m < n_mats; ++m)
    first[m + 1] = first[m] + (ws[m]->rows + kPackRows - 1) / kPackRows;
#pragma omp parallel if (parallel)
  {
    std::vector<std::uint8_t> scratch;  // a group repacked, for a matrix without w.packed
    if (n > kFewTokens) {  // by tokens: each thread writes whole rows (no shared lines)
#pragma omp for schedule(static)
      for (int t = 0; t < n; ++t) quantize_tokens_avx512(x, cols, t, t + 1, 0, nb, &qx);
    }
    // Groups are handed out as the threads ask (one thread may run slower on
    // a shared machine); every output is still computed by one thread in one
    // order.
#pragma omp for schedule(guided, 4)
    for (int gi = 0; gi < first[n_mats]; ++gi) {
      int m = 0;
      while (gi >= first[m + 1]) ++m;
      const WeightMatrix& w = *ws[m];
      const int g = gi - first[m], r0 = g * kPackRows;
      const int nr = w.rows - r0 < kPackRows ? w.rows - r0 : kPackRows;
      const std::size_t group_bytes = packed_group_bytes(w);
      const std::uint8_t* pg = nullptr;
      const std::uint8_t* next = nullptr;
      if (w.packed != nullptr) {
        pg = w.packed + static_cast<std::size_t>(g) * group_bytes;
        if (r0 + kPackRows < w.rows) next = pg + group_bytes;
      } else {
        scratch.resize(group_bytes);
        pack_group(w, g, scratch.data());
        pg = scratch.data();
      }
      group_products_avx512(w.type, pg, next, nr, qx, cols, outs[m] + r0,
                            static_cast<std::size_t>(w.rows));
    }
  }
}

}  // namespace

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
  int first_panel[kMaxMats + 1] = {};
  std::int64_t work = 0;
  for (int m = 0; m < n_mats; ++m) work += static_cast<std::int64_t>(n) * ws[m]->rows * cols;
  if (path == Path::kAvx512) {
    packed_products_avx512(ws, outs, n_mats, x, n, work >= kParallelWork);
    return;
  }
  QuantizedX qx;
  qx.prepare(n, cols / 32);
  auto quantize = [&](int b0, int b1) {
    if (path == Path::kScalar)
      quantize_tokens(x, cols, 0, n, b0, b1, &qx);
    else
      quantize_tokens_avx2(x, cols, 0, n, b0, b1, &qx);
  };
  if (n <= kFewTokens) quantize(0, qx.nb);
  // The panels of all the matrices in one loop: one join, and the threads
  // share out the rows of all of them.
  for (int m = 0; m < n_mats; ++m)
    first_panel[m + 1] = first_panel[m] + (ws[m]->rows + kPanelRows - 1) / kPanelRows;
  const int n_panels = first_panel[n_mats];
  if (path == Path::kAvx2 && n == 1) {
    // An AVX2 decode step: 8 rows at a time, read in place.
    constexpr int per = kOneTokenRows;
    std::vector<float> dx(static_cast<std::size_t>(qx.nb)), sx(dx.size());
    for (int b = 0; b < qx.nb; ++b) {
      dx[b] = qx.dx[qx.at(0, b)];
      sx[b] = qx.sx[qx.at(0, b)];
    }
    std::vector<std::int16_t> xq(static_cast<std::size_t>(cols));
    for (int b = 0; b < qx.nb; ++b)
      for (int k = 0; k < 32; ++k) xq[b * 32 + k] = qx.qrow(0, b, k / 2)[k % 2];
    int first[kMaxMats + 1] = {};
    for (int m = 0; m < n_mats; ++m) first[m + 1] = first[m] + (ws[m]->rows + per - 1) / per;
#pragma omp parallel for schedule(guided, 4) if (work >= kParallelWork)
    for (int pi = 0; pi < first[n_mats]; ++pi) {
      int m = 0;
      while (pi >= first[m + 1]) ++m;
      const int rows = ws[m]->rows, r0 = (pi - first[m]) * per,
                nr = rows - r0 < per ? rows - r0 : per;
      rows_one_token_avx2(*ws[m], r0, nr, xq.data(), dx.data(), sx.data(), outs[m] + r0);
    }
    return;
  }
#pragma omp parallel if (work >= kParallelWork)
  {
    Panel panel;
    float tile[kPanelRows * kGroup];
    if (n > kFewTokens) {  // the threads quantize the blocks, then share out the panels
#pragma omp for schedule(static)
      for (int b = 0; b < qx.nb; ++b) quantize(b, b + 1);
    }
    // On a shared machine one thread may run slower, so panels are handed
    // out as the threads ask; every output is still computed by one thread
    // in one order.  The unpacking prefetches the next panel, so chunks
    // shrink only towards the end (guided).
#pragma omp for schedule(guided, 4)
    for (int pi = 0; pi < n_panels; ++pi) {
      int m = 0;
      while (pi >= first_panel[m + 1]) ++m;
      const WeightMatrix& w = *ws[m];
      float* out = outs[m];
      const int rows = w.rows, r0 = (pi - first_panel[m]) * kPanelRows;
      const int nr = rows - r0 < kPanelRows ? rows - r0 : kPanelRows;
      if (path == Path::kScalar)
        unpack_panel(w, r0, nr, &panel);
      else
        unpack_panel_avx2(w, r0, nr, &panel);
      for (int g = 0; g < qx.groups; ++g) {
        const int lanes = n - g * kGroup < kGroup ? n - g * kGroup : kGroup;
        if (path == Path::kAvx2)
          panel_products_avx2(panel, qx, g, lanes, tile);
        else
          panel_products_scalar(panel, qx, g, lanes, tile);
        for (int t = 0; t < lanes; ++t)
          for (int r = 0; r < nr; ++r)
            out[static_cast<std::size_t>(g * kGroup + t) * rows + r0 + r] = tile[r * kGroup + t];
      }
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
