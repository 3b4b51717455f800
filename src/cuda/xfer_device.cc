// The GPU half of kvxfer_send / kvxfer_recv (src/xfer/device.h) on the page
// codec of kernels/: registered at load time wherever this file is linked
// (libkvxfer.so in a CUDA build, the GPU transfer tests).  docs/GPU.md,
// "GPU path of kvxfer_send/recv".
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>

#include "codec/page.h"
#include "common/error.h"
#include "common/log.h"
#include "cuda/cuda_check.h"
#include "cuda/device_codec.h"
#include "xfer/device.h"

namespace kvxfer::cuda {
namespace {

/** Streams and scratch of one device, used by the codec thread only. */
struct DeviceState {
  cudaStream_t anchor_stream = nullptr;    // encode and anchor-only decode: highest priority
  cudaStream_t residual_stream = nullptr;  // full-precision decode: default priority
  DeviceScratch scratch;
  int64_t scratch_tokens = 0;
  int32_t scratch_channels = 0;
};

class CudaDeviceCodec final : public xfer::DeviceCodec {
 public:
  kvxfer_result_t check_device(int device) override {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
      return set_error(KVXFER_ERR_UNSUPPORTED, "the KV is on CUDA device %d, but CUDA reports: %s",
                       device, cudaGetErrorString(e));
    if (device >= n)
      return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                       "the KV is on CUDA device %d, but this process sees %d device(s)", device,
                       n);
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t upload_table(int device, void* const* ptrs, size_t n,
                               std::shared_ptr<void>* table) override {
    KVXFER_CHECK(cuda_result(cudaSetDevice(device), "cudaSetDevice(device)", device));
    // Freed on the device it lives on, whichever thread drops the last reference.
    std::shared_ptr<DeviceBuffer> owner(new DeviceBuffer, [device](DeviceBuffer* b) {
      cudaSetDevice(device);
      delete b;
    });
    KVXFER_CHECK(cuda_result(owner->alloc(n * sizeof(void*)), "cudaMalloc(block table)", device));
    KVXFER_CHECK(cuda_result(cudaMemcpy(owner->p, ptrs, n * sizeof(void*), cudaMemcpyHostToDevice),
                             "cudaMemcpy(block table)", device));
    *table = std::shared_ptr<void>(owner, owner->p);  // owns the buffer, points at the table
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t pin(void* p, size_t len, std::shared_ptr<void>* handle) override {
    if (len == 0) return KVXFER_SUCCESS;
    KVXFER_CUDA_CHECK(cudaHostRegister(p, len, cudaHostRegisterPortable));
    *handle = std::shared_ptr<void>(p, [](void* q) { cudaHostUnregister(q); });
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t encode(int device, const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                         const kvxfer_page_layout_t* src, void* anchor, size_t anchor_cap,
                         size_t* anchor_len, void* residual, size_t residual_cap,
                         size_t* residual_len) override {
    DeviceState* s = nullptr;
    KVXFER_CHECK(state(device, src->num_tokens, src->num_channels, &s));
    return encode_page_device(cfg, id, src, s->scratch, anchor, anchor_cap, anchor_len, residual,
                              residual_cap, residual_len, s->anchor_stream);
  }

  kvxfer_result_t decode(int device, const void* anchor, size_t anchor_len, const void* residual,
                         size_t residual_len, const kvxfer_page_id_t* expect,
                         const kvxfer_page_layout_t* dst) override {
    DeviceState* s = nullptr;
    KVXFER_CHECK(state(device, dst->num_tokens, dst->num_channels, &s));
    cudaStream_t stream = residual == nullptr ? s->anchor_stream : s->residual_stream;
    KVXFER_CHECK(decode_page_device(anchor, anchor_len, residual, residual_len, expect, dst,
                                    s->scratch, stream));
    // The host sections may be reused once this returns, and ANCHOR_READY /
    // COMPLETE promise the values are in dst: read_status waits for the
    // stream, after the decode kernel.
    DeviceStatus st{};
    KVXFER_CHECK(read_status(s->scratch.status(), &st, stream));
    if (st.flags & STATUS_BAD_META)
      return set_error(KVXFER_ERR_CORRUPT,
                       "the device decoder rejected the page's metadata (nothing written)");
    return KVXFER_SUCCESS;
  }

 private:
  /** The codec thread's streams and scratch on `device`, grown to T x H. */
  kvxfer_result_t state(int device, int64_t T, int32_t H, DeviceState** out) {
    KVXFER_CHECK(cuda_result(cudaSetDevice(device), "cudaSetDevice(device)", device));
    DeviceState& s = states_[device];
    if (s.anchor_stream == nullptr) {
      KVXFER_CHECK(create_anchor_stream(&s.anchor_stream));
      KVXFER_CHECK(cuda_result(cudaStreamCreateWithFlags(&s.residual_stream, cudaStreamNonBlocking),
                               "cudaStreamCreateWithFlags(residual stream)", device));
    }
    if (T > s.scratch_tokens || H > s.scratch_channels) {
      s.scratch_tokens = 0;
      // Sized for the worst case of every codec at this shape, so one scratch
      // serves any sender's codec: codec::max_sizes counts the raw fallback
      // in the anchor, and 2 anchor bits leave the largest residual (6 bits).
      kvxfer_codec_config_t worst = KVXFER_CODEC_CONFIG_INITIALIZER;
      worst.codec = KVXFER_CODEC_INT8;
      worst.anchor_bits = 2;
      worst.chunk_tokens = 16;
      worst.nonfinite = KVXFER_NONFINITE_RAW;
      KVXFER_CHECK(alloc_scratch(&worst, T, H, &s.scratch));
      s.scratch_tokens = T;
      s.scratch_channels = H;
    }
    *out = &s;
    return KVXFER_SUCCESS;
  }

  std::map<int, DeviceState> states_;  // codec thread only
};

struct Registrar {
  Registrar() {
    static CudaDeviceCodec codec;
    xfer::register_device_codec(&codec);
  }
};
const Registrar g_registrar;

}  // namespace
}  // namespace kvxfer::cuda
