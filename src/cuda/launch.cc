// The low-level launches of src/cuda/device_codec.h: argument checks and the
// translation of layouts and codebooks for kernels/codec_kernels.h, whose
// launch outcome becomes a kvxfer_result_t here.
#include <cuda_runtime.h>

#include <cstdint>

#include "codec/codebook.h"
#include "codec/format.h"
#include "common/error.h"
#include "cuda/device_codec.h"

namespace kvxfer::cuda {

using kernels::KCodebook;
using kernels::KLayout;

namespace {

KLayout klayout(const kvxfer_page_layout_t* l) {
  KLayout k;
  k.blocks = l->blocks;
  k.block_size = l->block_size;
  k.row_stride_bytes = l->row_stride * static_cast<int64_t>(codec::dtype_size(l->dtype));
  k.first_token = l->first_token;
  k.T = l->num_tokens;
  k.H = l->num_channels;
  k.dtype = l->dtype;
  return k;
}

KCodebook kcodebook(const DeviceCodebook& d) {
  return KCodebook{d.lut_base,      d.lut_next, d.recon_full, d.recon_anchor,   d.anchor_lo,
                   d.anchor_hi,     d.lut_log2, d.lut_origin, d.sign_magnitude, d.anchor_bits,
                   d.residual_bits, d.kind,     d.max_code,   d.scale_num,      d.bias};
}

kvxfer_result_t result(kernels::Launched l) {
  if (l.error != cudaSuccess)
    return set_error(KVXFER_ERR_SYSTEM, "CUDA launch of %s failed: %s", l.kernel,
                     cudaGetErrorString(l.error));
  return KVXFER_SUCCESS;
}

/** The kernels are instantiated for these dtypes only. */
kvxfer_result_t check_dtype(kvxfer_dtype_t dt) {
  if (dt == KVXFER_DTYPE_BF16 || dt == KVXFER_DTYPE_FP16 || dt == KVXFER_DTYPE_FP32)
    return KVXFER_SUCCESS;
  return set_error(KVXFER_ERR_INVALID_ARGUMENT, "bad dtype %d", static_cast<int>(dt));
}

bool aligned8(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

}  // namespace

kvxfer_result_t launch_reset_status(DeviceStatus* status, cudaStream_t stream) {
  KVXFER_REQUIRE(status != nullptr && aligned8(status), "device status is NULL or misaligned");
  return result(kernels::reset_status(status, stream));
}

kvxfer_result_t read_status(const DeviceStatus* status, DeviceStatus* out, cudaStream_t stream) {
  cudaError_t e =
      cudaMemcpyAsync(out, status, sizeof(DeviceStatus), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess)
    return set_error(KVXFER_ERR_SYSTEM, "reading the device status failed: %s",
                     cudaGetErrorString(e));
  return KVXFER_SUCCESS;
}

kvxfer_result_t launch_encode(const DeviceCodebook& cb, const kvxfer_page_layout_t* src,
                              int chunk_tokens, int64_t sink_rows, bool meta_fp32,
                              uint8_t* anchor_payload, uint8_t* residual_payload,
                              DeviceStatus* status, cudaStream_t stream) {
  KVXFER_CHECK(validate_device_layout(src, "source"));
  KVXFER_REQUIRE(codec::valid_chunk_tokens(chunk_tokens), "chunk_tokens %d", chunk_tokens);
  KVXFER_REQUIRE(cb.lut_base != nullptr, "device codebook not uploaded");
  KVXFER_REQUIRE(anchor_payload != nullptr && aligned8(anchor_payload),
                 "anchor payload is NULL or not 8-byte aligned");
  KVXFER_REQUIRE(cb.residual_bits == 0 || (residual_payload != nullptr),
                 "residual payload is NULL");
  KVXFER_REQUIRE(status != nullptr && aligned8(status), "device status is NULL or misaligned");
  KVXFER_REQUIRE(sink_rows >= 0, "sink_rows %lld is negative", static_cast<long long>(sink_rows));
  const int64_t T = src->num_tokens;
  const int32_t H = src->num_channels;
  const int64_t chunks = (T + chunk_tokens - 1) / chunk_tokens;
  KVXFER_REQUIRE(chunks <= 0x7FFFFFFF, "too many chunks");
  const int A = cb.anchor_bits;
  const uint64_t meta_bytes = static_cast<uint64_t>(chunks) * H * (meta_fp32 ? 8 : 4);
  const uint64_t anchor_codes = (static_cast<uint64_t>(T) * H * A + 7) / 8;
  uint8_t* meta = anchor_payload;
  uint8_t* anchors = anchor_payload + meta_bytes;
  const KCodebook K = kcodebook(cb);
  if (T > 0) {
    KVXFER_CHECK(check_dtype(src->dtype));
    KVXFER_CHECK(result(kernels::encode(klayout(src), K, chunk_tokens, chunks, sink_rows, meta_fp32,
                                        meta, anchors, residual_payload, status, stream)));
  }
  // Split codecs with a table (codec::has_anchor_table): the per-page anchor
  // table, after the codes (also for T = 0, where it holds the bin centres).
  if (cb.anchor_table)
    KVXFER_CHECK(result(kernels::anchor_table(K, anchors + anchor_codes, status, stream)));
  return KVXFER_SUCCESS;
}

kvxfer_result_t launch_scan_nonfinite(const kvxfer_page_layout_t* src, DeviceStatus* status,
                                      cudaStream_t stream) {
  KVXFER_CHECK(validate_device_layout(src, "source"));
  if (src->num_tokens == 0) return KVXFER_SUCCESS;
  KVXFER_CHECK(check_dtype(src->dtype));
  return result(kernels::scan_nonfinite(klayout(src), status, stream));
}

kvxfer_result_t launch_pack_values(const kvxfer_page_layout_t* src, kvxfer_dtype_t out_dtype,
                                   uint8_t* payload, cudaStream_t stream) {
  KVXFER_CHECK(validate_device_layout(src, "source"));
  KVXFER_REQUIRE(out_dtype == src->dtype || out_dtype == KVXFER_DTYPE_BF16,
                 "values are packed as the source dtype or as bf16");
  KVXFER_REQUIRE(payload != nullptr && aligned8(payload), "payload is NULL or misaligned");
  if (src->num_tokens == 0) return KVXFER_SUCCESS;
  KVXFER_CHECK(check_dtype(src->dtype));
  return result(kernels::pack_values(klayout(src), out_dtype, payload, stream));
}

kvxfer_result_t launch_unpack_values(const uint8_t* payload, kvxfer_dtype_t in_dtype,
                                     const kvxfer_page_layout_t* dst, cudaStream_t stream) {
  KVXFER_CHECK(validate_device_layout(dst, "destination"));
  KVXFER_REQUIRE(payload != nullptr && aligned8(payload), "payload is NULL or misaligned");
  if (dst->num_tokens == 0) return KVXFER_SUCCESS;
  KVXFER_CHECK(check_dtype(dst->dtype));
  KVXFER_CHECK(check_dtype(in_dtype));
  return result(kernels::unpack_values(payload, in_dtype, klayout(dst), stream));
}

kvxfer_result_t launch_decode(const codec::PageHeader& h, const DeviceCodebook& cb,
                              const uint8_t* anchor_payload, const uint8_t* residual_payload,
                              const kvxfer_page_layout_t* dst, DeviceStatus* status,
                              cudaStream_t stream) {
  KVXFER_CHECK(validate_device_layout(dst, "destination"));
  KVXFER_REQUIRE(cb.lut_base != nullptr, "device codebook not uploaded");
  KVXFER_REQUIRE(static_cast<uint64_t>(dst->num_tokens) == h.num_tokens &&
                     static_cast<uint32_t>(dst->num_channels) == h.num_channels,
                 "destination is not the page's shape");
  KVXFER_REQUIRE(h.anchor_bits == cb.anchor_bits && h.code_bits == cb.code_bits,
                 "codebook does not match the header");
  KVXFER_REQUIRE(!(h.flags & codec::FLAG_RAW) && h.codec != KVXFER_CODEC_BF16,
                 "raw and BF16 sections decode with launch_unpack_values");
  KVXFER_REQUIRE(anchor_payload != nullptr && aligned8(anchor_payload),
                 "anchor payload is NULL or not 8-byte aligned");
  KVXFER_REQUIRE(status != nullptr && aligned8(status), "device status is NULL or misaligned");
  const int64_t T = dst->num_tokens;
  const int32_t H = dst->num_channels;
  if (T == 0) return KVXFER_SUCCESS;
  const bool fp32 = (h.flags & codec::FLAG_META_FP32) != 0;
  const codec::PayloadSizes s = codec::payload_sizes(h);
  const uint64_t entries = (static_cast<uint64_t>(T) + h.chunk_tokens - 1) / h.chunk_tokens * H;
  const uint8_t* table = s.table_bytes > 0 ? anchor_payload + s.table_offset() : nullptr;
  const KLayout L = klayout(dst);
  const KCodebook K = kcodebook(cb);
  KVXFER_CHECK(check_dtype(dst->dtype));
  return result(kernels::decode(L, K, static_cast<int>(h.chunk_tokens), fp32, entries,
                                anchor_payload, anchor_payload + s.meta_bytes, residual_payload,
                                table, status, stream));
}

}  // namespace kvxfer::cuda
