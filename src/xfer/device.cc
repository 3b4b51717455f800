// Registry of the GPU half of kvxfer_send/recv (device.h).
#include "xfer/device.h"

#include <atomic>

#include "common/error.h"

namespace kvxfer::xfer {
namespace {
std::atomic<DeviceCodec*> g_codec{nullptr};
}

DeviceCodec* device_codec() { return g_codec.load(std::memory_order_acquire); }

void register_device_codec(DeviceCodec* c) { g_codec.store(c, std::memory_order_release); }

kvxfer_result_t usable_device_codec(int device, const char* what, DeviceCodec** out) {
  DeviceCodec* dev = device_codec();
  if (dev == nullptr)
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "%s is on CUDA device %d, but this build of kvxfer has no CUDA support "
                     "(docs/GPU.md)",
                     what, device);
  KVXFER_CHECK(dev->check_device(device));
  *out = dev;
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::xfer
