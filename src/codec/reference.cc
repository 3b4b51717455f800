// Reference page codec: plain loops, one element at a time, in the order the
// definition reads (docs/FORMAT.md).  It defines the bytes; the fast CPU path
// and the CUDA kernels must reproduce them exactly (tests/codec_test.cc).
#include <algorithm>

#include "codec/page.h"

namespace kvxfer::codec::reference {

EncodeStatus encode(const EncodeJob& job) {
  const PageHeader& h = *job.hdr;
  const int64_t T = static_cast<int64_t>(h.num_tokens);
  const int32_t H = static_cast<int32_t>(h.num_channels);
  const int C = h.chunk_tokens;
  const unsigned R = job.cb->residual_bits, A = job.cb->anchor_bits;
  const auto dt = static_cast<kvxfer_dtype_t>(h.src_dtype);
  const PayloadSizes sizes = payload_sizes(h);
  std::fill(job.anchors, job.anchors + sizes.anchor_codes, 0);
  if (R > 0) std::fill(job.residuals, job.residuals + sizes.residual_codes, 0);

  for (int64_t t0 = 0, k = 0; t0 < T; t0 += C, ++k) {
    const int64_t t1 = std::min<int64_t>(T, t0 + C);
    for (int32_t c = 0; c < H; ++c) {
      // Lynx Alg. 1 lines 2-5: per-(chunk, channel) affine normalisation,
      // over the rows from r0 (the sink rows left out, FORMAT.md 2.7).
      const int64_t r0 = range_row0(t0, t1, static_cast<int64_t>(h.sink_rows));
      float mn = load_elem(job.src.row(r0), c, dt), mx = mn;
      for (int64_t t = t0; t < t1; ++t) {
        const float x = load_elem(job.src.row(t), c, dt);
        if (!std::isfinite(x)) return EncodeStatus::NONFINITE;
        if (t < r0) continue;
        if (x < mn) mn = x;
        if (x > mx) mx = x;
      }
      canonical_minmax(&mn, &mx);
      Affine a;
      if (!chunk_affine(mn, mx, job.meta_fp32, &a)) return EncodeStatus::NEED_FP32;
      put_affine(job.meta, k * H + c, job.meta_fp32, a);
      // Lines 6-9: companding, 8-bit code, anchor/residual split.
      const float s = job.cb->scale(a.d);
      for (int64_t t = t0; t < t1; ++t) {
        float x = load_elem(job.src.row(t), c, dt);
        if (t < r0) x = clamp_to_range(x, mn, mx);
        const uint8_t code = job.cb->encode(x, a.m, s);
        if (hist_row(t, h.sink_rows)) ++job.hist[code];
        const uint64_t e = static_cast<uint64_t>(t) * H + c;
        put_bits(job.anchors, e * A, A, code >> R);
        if (R > 0) put_bits(job.residuals, e * R, R, code & ((1u << R) - 1));
      }
    }
  }
  return EncodeStatus::OK;
}

void decode(const DecodeJob& job) {
  const PageHeader& h = *job.hdr;
  const int64_t T = static_cast<int64_t>(h.num_tokens);
  const int32_t H = static_cast<int32_t>(h.num_channels);
  const int C = h.chunk_tokens;
  const unsigned R = job.cb->residual_bits, A = job.cb->anchor_bits;
  const auto dt = job.dst.l->dtype;
  for (int64_t t = 0; t < T; ++t) {
    uint8_t* row = job.dst.row(t);
    for (int32_t c = 0; c < H; ++c) {
      const Affine a = get_affine(job.meta, (t / C) * H + c, job.meta_fp32);
      const uint64_t e = static_cast<uint64_t>(t) * H + c;
      const unsigned anchor = get_bits(job.anchors, e * A, A);
      float r;
      if (job.residuals != nullptr) {
        const unsigned code = (anchor << R) | (R > 0 ? get_bits(job.residuals, e * R, R) : 0u);
        r = job.cb->recon_full[code];
      } else {
        r = job.anchor_table[anchor];
      }
      store_elem(row, c, dt, denormalise(r, a));
    }
  }
}

}  // namespace kvxfer::codec::reference
