// Registry of the GPU half of kvxfer_send/recv (device.h).
#include "xfer/device.h"

#include <atomic>

namespace kvxfer::xfer {
namespace {
std::atomic<DeviceCodec*> g_codec{nullptr};
}

DeviceCodec* device_codec() { return g_codec.load(std::memory_order_acquire); }

void register_device_codec(DeviceCodec* c) { g_codec.store(c, std::memory_order_release); }

}  // namespace kvxfer::xfer
