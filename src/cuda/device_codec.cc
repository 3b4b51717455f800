// Host side of the GPU page codec: codebook upload, scratch, the page-level
// encode/decode for device pages (same contract and bytes as codec/uniform_codec.cc),
// and the high-priority anchor stream.  Headers and checksums are written here
// on the host, with codec::write_header / codec::seal_section, once the
// payloads are in host memory (docs/GPU.md).
#include "cuda/device_codec.h"

#include <cuda_runtime.h>

#include <cinttypes>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "codec/codebook.h"
#include "codec/codec.h"
#include "codec/driver.h"
#include "codec/page.h"
#include "codec/page_codec.h"
#include "common/error.h"
#include "common/log.h"
#include "cuda/cuda_check.h"

namespace kvxfer::cuda {

kvxfer_result_t validate_device_layout(const kvxfer_page_layout_t* l, const char* what) {
  // The host cannot dereference a device block table: shape checks only.
  return codec::validate_layout_shape(l, what);
}

kvxfer_result_t upload_codebook(const codec::Codebook* cb, DeviceCodebook* out) {
  KVXFER_REQUIRE(cb != nullptr && out != nullptr, "NULL codebook");
  int dev = 0;
  KVXFER_CUDA_CHECK(cudaGetDevice(&dev));
  // Keyed by the codebook's identity, never by its address: a host codebook
  // dropped from the CPU cache may be freed and its address reused.
  using Key = std::tuple<int, uint32_t, int, int>;
  uint32_t abits = 0;
  std::memcpy(&abits, &cb->alpha, sizeof(abits));
  const Key key{static_cast<int>(cb->codec), abits, cb->anchor_bits, dev};
  static std::mutex mu;
  static std::map<Key, DeviceCodebook> cache;
  static std::deque<Key> order;
  std::lock_guard<std::mutex> lk(mu);
  auto it = cache.find(key);
  if (it != cache.end()) {
    *out = it->second;
    return KVXFER_SUCCESS;
  }
  // One allocation, the CPU's tables verbatim: recon_full[256] | recon_anchor[64] |
  // anchor_lo[64] | anchor_hi[64] | lut_next[cells] | lut_base[cells].
  constexpr size_t kFixed = 256 + 3 * 64;  // floats before lut_next
  const size_t cells = cb->lut_base.size();
  const size_t bytes = kFixed * sizeof(float) + cells * (sizeof(float) + sizeof(int32_t));
  std::string host(bytes, '\0');
  char* p = host.data();
  std::memcpy(p, cb->recon_full, 256 * sizeof(float));
  std::memcpy(p + 256 * sizeof(float), cb->recon_anchor, 64 * sizeof(float));
  std::memcpy(p + 320 * sizeof(float), cb->anchor_lo, 64 * sizeof(float));
  std::memcpy(p + 384 * sizeof(float), cb->anchor_hi, 64 * sizeof(float));
  std::memcpy(p + kFixed * sizeof(float), cb->lut_next.data(), cells * sizeof(float));
  std::memcpy(p + (kFixed + cells) * sizeof(float), cb->lut_base.data(), cells * sizeof(int32_t));
  auto mem = std::make_shared<DeviceBuffer>();
  KVXFER_CHECK(cuda_result(mem->alloc(bytes), "cudaMalloc(codebook)"));
  // Once per codebook identity and device (warm-up).  A cudaMemcpy from
  // pageable memory may return before the DMA has landed, and the kernels run
  // on non-blocking streams: copy on this thread's stream and wait for it.
  KVXFER_CHECK(
      cuda_result(cudaMemcpyAsync(mem->p, p, bytes, cudaMemcpyHostToDevice, cudaStreamPerThread),
                  "cudaMemcpyAsync(codebook)"));
  KVXFER_CHECK(
      cuda_result(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize(codebook)"));
  const auto* f = reinterpret_cast<const float*>(mem->p);
  DeviceCodebook dc;
  dc.mem = std::move(mem);
  dc.recon_full = f;
  dc.recon_anchor = f + 256;
  dc.anchor_lo = f + 320;
  dc.anchor_hi = f + 384;
  dc.lut_next = f + kFixed;
  dc.lut_base = reinterpret_cast<const int32_t*>(f + kFixed + cells);
  dc.lut_log2 = cb->lut_log2;
  dc.lut_origin = cb->lut_origin;
  dc.sign_magnitude = cb->sign_magnitude ? 1 : 0;
  dc.code_bits = cb->code_bits;
  dc.anchor_bits = cb->anchor_bits;
  dc.residual_bits = cb->residual_bits;
  dc.anchor_table = codec::has_anchor_table(*cb) ? 1 : 0;
  dc.kind = cb->kind;
  dc.max_code = cb->max_code;
  dc.scale_num = cb->scale_num;
  dc.bias = cb->bias;
  cache.emplace(key, dc);
  order.push_back(key);
  if (order.size() > codec::kCodebookCacheSize) {  // bounded, as the CPU cache
    cache.erase(order.front());
    order.pop_front();
  }
  *out = dc;
  return KVXFER_SUCCESS;
}

kvxfer_result_t alloc_scratch(const kvxfer_codec_config_t* cfg, int64_t T, int32_t H,
                              DeviceScratch* out) {
  KVXFER_REQUIRE(out != nullptr, "NULL scratch");
  out->reset();
  size_t a = 0, r = 0;
  KVXFER_CHECK(codec::max_sizes(cfg, T, H, &a, &r));
  cudaError_t e = out->anchor.alloc(a - codec::kHeaderBytes);
  if (e == cudaSuccess) e = out->residual.alloc(r - codec::kHeaderBytes);
  if (e == cudaSuccess) e = out->status_word.alloc(sizeof(DeviceStatus));
  if (e != cudaSuccess) {
    out->reset();
    return cuda_result(e, "cudaMalloc(scratch)");
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t create_anchor_stream(cudaStream_t* out) {
  KVXFER_REQUIRE(out != nullptr, "NULL stream output");
  int least = 0, greatest = 0;
  KVXFER_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  KVXFER_CUDA_CHECK(cudaStreamCreateWithPriority(out, cudaStreamNonBlocking, greatest));
  return KVXFER_SUCCESS;
}

namespace {

/** The CUDA kernels as an EncodeBackend: payloads in device scratch, copied back at the end. */
class DeviceBackend final : public codec::EncodeBackend {
 public:
  DeviceBackend(const kvxfer_page_layout_t* src, const DeviceScratch& scratch, uint8_t* anchor,
                uint8_t* residual, cudaStream_t stream)
      : src_(src), scratch_(scratch), anc_(anchor), res_(residual), stream_(stream) {}

  kvxfer_result_t check_capacity(const codec::PageHeader& h) override {
    const codec::PayloadSizes s = codec::payload_sizes(h);
    if (scratch_.anchor_cap() < s.anchor_payload() || scratch_.residual_cap() < s.residual_codes)
      return set_error(KVXFER_ERR_BUFFER_TOO_SMALL,
                       "page needs %llu anchor and %llu residual payload bytes on the device; "
                       "the scratch holds %zu and %zu (alloc_scratch)",
                       (unsigned long long)s.anchor_payload(), (unsigned long long)s.residual_codes,
                       scratch_.anchor_cap(), scratch_.residual_cap());
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t scan_nonfinite(codec::NonfiniteAt* at) override {
    DeviceStatus st{};
    KVXFER_CHECK(launch_reset_status(scratch_.status(), stream_));
    KVXFER_CHECK(launch_scan_nonfinite(src_, scratch_.status(), stream_));
    KVXFER_CHECK(read_status(scratch_.status(), &st, stream_));
    if (st.flags & STATUS_NONFINITE) locate(st, at);
    return KVXFER_SUCCESS;
  }

  /** The codebook of a quantizing config, uploaded (validated config). */
  kvxfer_result_t use(const kvxfer_codec_config_t& cfg) {
    codec::CodebookRef cb;
    KVXFER_CHECK(codec::codebook_of(cfg, &cb));
    return upload_codebook(cb.get(), &dcb_);
  }

  kvxfer_result_t quantize(const codec::PageHeader& h, codec::EncodeStatus* status,
                           codec::NonfiniteAt* at) override {
    const DeviceCodebook& dcb = dcb_;
    DeviceStatus st{};
    KVXFER_CHECK(launch_reset_status(scratch_.status(), stream_));
    KVXFER_CHECK(launch_encode(dcb, src_, h.chunk_tokens, static_cast<int64_t>(h.sink_rows),
                               (h.flags & codec::FLAG_META_FP32) != 0, scratch_.anchor_payload(),
                               scratch_.residual_payload(), scratch_.status(), stream_));
    KVXFER_CHECK(read_status(scratch_.status(), &st, stream_));
    if (st.flags & STATUS_NONFINITE) {  // decides, whatever else
      *status = codec::EncodeStatus::NONFINITE;
      locate(st, at);
    } else if (st.flags == STATUS_NEED_FP32) {
      *status = codec::EncodeStatus::NEED_FP32;
    } else if (st.flags != 0) {
      return set_error(KVXFER_ERR_INTERNAL, "encoder returned status 0x%x", st.flags);
    } else {
      *status = codec::EncodeStatus::OK;
    }
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t pack_values(const codec::PageHeader&, kvxfer_dtype_t dtype) override {
    return launch_pack_values(src_, dtype, scratch_.anchor_payload(), stream_);
  }

  kvxfer_result_t pack_sinks(const codec::PageHeader& h) override {
    // The first sink_rows rows, as the BF16 passthrough packs a page (docs/FORMAT.md 2.7).
    const codec::PayloadSizes s = codec::payload_sizes(h);
    kvxfer_page_layout_t rows = *src_;
    rows.num_tokens = h.sink_rows;
    uint8_t* out = scratch_.anchor_payload() + s.sink_offset();
    if (s.sink_pad > 0)
      KVXFER_CUDA_CHECK(cudaMemsetAsync(out - s.sink_pad, 0, s.sink_pad, stream_));
    return launch_pack_values(&rows, codec::sink_dtype(h), out, stream_);
  }

  kvxfer_result_t finish(const codec::PageHeader& h) override {
    // Payloads to the host; headers and checksums are sealed there.
    const codec::PayloadSizes s = codec::payload_sizes(h);
    if (s.anchor_payload() > 0)
      KVXFER_CUDA_CHECK(cudaMemcpyAsync(anc_ + codec::kHeaderBytes, scratch_.anchor_payload(),
                                        s.anchor_payload(), cudaMemcpyDeviceToHost, stream_));
    if (s.residual_codes > 0)
      KVXFER_CUDA_CHECK(cudaMemcpyAsync(res_ + codec::kHeaderBytes, scratch_.residual_payload(),
                                        s.residual_codes, cudaMemcpyDeviceToHost, stream_));
    KVXFER_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return KVXFER_SUCCESS;
  }

 private:
  // DeviceStatus::first_bad = (t * H + c) << 1 | is_inf, the first in token-major order.
  void locate(const DeviceStatus& st, codec::NonfiniteAt* at) const {
    const uint64_t e = st.first_bad >> 1;
    at->found = true;
    at->t = static_cast<int64_t>(e / static_cast<uint64_t>(src_->num_channels));
    at->c = static_cast<int32_t>(e % static_cast<uint64_t>(src_->num_channels));
    at->is_nan = (st.first_bad & 1) == 0;
  }

  const kvxfer_page_layout_t* src_;
  const DeviceScratch& scratch_;
  uint8_t* anc_;
  uint8_t* res_;
  cudaStream_t stream_;
  DeviceCodebook dcb_;
};

}  // namespace

kvxfer_result_t encode_page_device(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                                   const kvxfer_page_layout_t* src, const DeviceScratch& scratch,
                                   void* anchor, size_t anchor_cap, size_t* anchor_len,
                                   void* residual, size_t residual_cap, size_t* residual_len,
                                   cudaStream_t stream) {
  KVXFER_CHECK(codec::check_encode_args(cfg, id, src, anchor, anchor_len, residual, residual_len));
  KVXFER_REQUIRE(scratch.anchor_payload() != nullptr && scratch.residual_payload() != nullptr &&
                     scratch.status() != nullptr,
                 "device scratch not allocated (alloc_scratch)");
  if (cfg->codec == KVXFER_CODEC_LYNX && cfg->alpha == KVXFER_ALPHA_AUTO)
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "alpha=auto is not available on the GPU path; calibrate on the host "
                     "(kvxfer_codec_calibrate_alpha) and pass the chosen alpha");
  if (cfg->value_groups == KVXFER_VALUE_GROUPS_TOKEN && id->kind == KVXFER_KV_VALUE)
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "value_groups=token is not available on the GPU path (docs/FORMAT.md 2.8); "
                     "use channel or auto (channel on the GPU)");
  // AUTO: make_header sets token groups for TOKEN only, so the page is channel-grouped.
  auto* anc = static_cast<uint8_t*>(anchor);
  auto* res = static_cast<uint8_t*>(residual);
  DeviceBackend be(src, scratch, anc, res, stream);
  if (cfg->codec != KVXFER_CODEC_BF16) KVXFER_CHECK(be.use(*cfg));
  return codec::encode_with(*cfg, *id, *src, anc, anchor_cap, anchor_len, res, residual_cap,
                            residual_len, &be, 1);
}

kvxfer_result_t decode_page_device(const void* anchor, size_t anchor_len, const void* residual,
                                   size_t residual_len, const kvxfer_page_id_t* expect,
                                   const kvxfer_page_layout_t* dst, const DeviceScratch& scratch,
                                   cudaStream_t stream, DeviceCodebook* keep) {
  codec::DecodePlan plan;
  KVXFER_CHECK(codec::plan_decode(anchor, anchor_len, residual, residual_len, expect, dst, &plan));
  const codec::PageHeader& ah = plan.anchor;
  if (ah.flags & codec::FLAG_TOKEN_GROUPS)
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "layer %u V page with token groups: the GPU path decodes channel groups only "
                     "(docs/FORMAT.md 2.8); decode it on the host",
                     ah.layer);
  KVXFER_REQUIRE(scratch.anchor_payload() != nullptr && scratch.residual_payload() != nullptr &&
                     scratch.status() != nullptr,
                 "device scratch not allocated (alloc_scratch)");
  const codec::PayloadSizes& s = plan.sizes;
  if (scratch.anchor_cap() < s.anchor_payload() ||
      (residual != nullptr && scratch.residual_cap() < s.residual_codes))
    return set_error(KVXFER_ERR_BUFFER_TOO_SMALL,
                     "page needs %llu anchor and %llu residual payload bytes on the device; the "
                     "scratch holds %zu and %zu",
                     (unsigned long long)s.anchor_payload(), (unsigned long long)s.residual_codes,
                     scratch.anchor_cap(), scratch.residual_cap());

  const uint8_t* payload = plan.payload;
  if (plan.cb == nullptr) {  // raw fallback or BF16
    const kvxfer_dtype_t sdt = (ah.flags & codec::FLAG_RAW)
                                   ? static_cast<kvxfer_dtype_t>(ah.src_dtype)
                                   : KVXFER_DTYPE_BF16;
    if (s.anchor_payload() > 0)
      KVXFER_CUDA_CHECK(cudaMemcpyAsync(scratch.anchor_payload(), payload, s.anchor_payload(),
                                        cudaMemcpyHostToDevice, stream));
    return launch_unpack_values(scratch.anchor_payload(), sdt, dst, stream);
  }

  const codec::CodebookRef& cb = plan.cb;
  DeviceCodebook dcb;
  KVXFER_CHECK(upload_codebook(cb.get(), &dcb));
  if (keep != nullptr) *keep = dcb;
  if (s.anchor_payload() > 0)
    KVXFER_CUDA_CHECK(cudaMemcpyAsync(scratch.anchor_payload(), payload, s.anchor_payload(),
                                      cudaMemcpyHostToDevice, stream));
  if (residual != nullptr && s.residual_codes > 0)
    KVXFER_CUDA_CHECK(cudaMemcpyAsync(scratch.residual_payload(),
                                      static_cast<const uint8_t*>(residual) + codec::kHeaderBytes,
                                      s.residual_codes, cudaMemcpyHostToDevice, stream));
  KVXFER_CHECK(launch_reset_status(scratch.status(), stream));
  KVXFER_CHECK(launch_decode(ah, dcb, scratch.anchor_payload(),
                             residual != nullptr ? scratch.residual_payload() : nullptr, dst,
                             scratch.status(), stream));
  if (ah.sink_rows == 0) return KVXFER_SUCCESS;
  // The sink rows over their decoded codes, in stream order (docs/FORMAT.md 2.7).
  kvxfer_page_layout_t rows = *dst;
  rows.num_tokens = ah.sink_rows;
  return launch_unpack_values(scratch.anchor_payload() + s.sink_offset(), codec::sink_dtype(ah),
                              &rows, stream);
}

}  // namespace kvxfer::cuda
