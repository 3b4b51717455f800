// GPU page codec (src/cuda/, src/kernels/) against the CPU reference: encoded sections and
// decoded values must be byte-identical (docs/GPU.md, docs/FORMAT.md section
// 3).  Every test needs a CUDA device and skips itself when there is none;
// ctest label "gpu".  scripts/gpu-check.sh runs them on a GPU machine.
//
// The same file also builds gpu_emu_test (tests/CMakeLists.txt): the kernels
// compiled as C++ and run by a CPU emulation (support/cuda_emu/), which checks their
// indexing and packing where no GPU exists (KVXFER_GPU_EMULATION).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cuda/device_codec.h"
#include "test_util.h"

namespace kvxfer::test {
namespace {

bool gpu_available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = cudaGetErrorString(e);
    cudaGetLastError();  // clear the sticky error
    return false;
  }
  if (n == 0) {
    *why = "cudaGetDeviceCount found 0 devices";
    return false;
  }
  return true;
}

#define CUDA_OK(call) \
  ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

/**
 * Copies n bytes host <-> device in order with the kernels on `stream`:
 * through a pinned staging buffer, by cudaMemcpyAsync on that stream, then
 * waits for it (before the staging buffer goes).  A pageable cudaMemcpy runs
 * on the legacy default stream, which the codec's non-blocking stream does not
 * wait for.
 */
void copy_on_stream(void* dst, const void* src, size_t n, cudaMemcpyKind kind,
                    cudaStream_t stream) {
  if (n == 0) return;
  void* pin = nullptr;
  ASSERT_EQ(cudaMallocHost(&pin, n), cudaSuccess);
  const bool up = kind == cudaMemcpyHostToDevice;
  if (up) std::memcpy(pin, src, n);
  EXPECT_EQ(cudaMemcpyAsync(up ? dst : pin, up ? pin : src, n, kind, stream), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  if (!up) std::memcpy(dst, pin, n);
  cudaFreeHost(pin);
}

/**
 * A host PagedBuffer mirrored in device memory: device blocks and a device
 * block table, copied on `stream` (the one the kernels run on).  Each block
 * starts `base_offset` bytes into its allocation (a multiple of the element
 * size): a base that is not 16-byte aligned makes the kernels take their
 * narrower loads and stores.
 */
struct DevicePage {
  std::vector<void*> allocs, blocks;
  void** table = nullptr;
  kvxfer_page_layout_t layout{};
  cudaStream_t stream = nullptr;
  size_t base_offset = 0;

  DevicePage(const PagedBuffer& h, cudaStream_t s, size_t offset = 0)
      : stream(s), base_offset(offset) {
    layout = h.layout;
    for (const auto& st : h.storage) {
      void* d = nullptr;
      EXPECT_EQ(cudaMalloc(&d, st.size() + base_offset), cudaSuccess);
      allocs.push_back(d);
      blocks.push_back(static_cast<uint8_t*>(d) + base_offset);
      copy_on_stream(blocks.back(), st.data(), st.size(), cudaMemcpyHostToDevice, stream);
    }
    EXPECT_EQ(cudaMalloc(&table, blocks.size() * sizeof(void*)), cudaSuccess);
    copy_on_stream(table, blocks.data(), blocks.size() * sizeof(void*), cudaMemcpyHostToDevice,
                   stream);
    layout.blocks = table;
  }
  DevicePage(const DevicePage&) = delete;
  DevicePage& operator=(const DevicePage&) = delete;
  ~DevicePage() {
    for (void* b : allocs) cudaFree(b);
    cudaFree(table);
  }
  /** Copies the device blocks back over h's blocks (same geometry). */
  void download(PagedBuffer* h) const {
    for (size_t b = 0; b < blocks.size(); ++b)
      copy_on_stream(h->storage[b].data(), blocks[b], h->storage[b].size(), cudaMemcpyDeviceToHost,
                     stream);
  }
  /** Device address of channel c of token t (arithmetic only: never dereferenced here). */
  uintptr_t address(int64_t t, int64_t c) const {
    const int64_t u = layout.first_token + t;
    return reinterpret_cast<uintptr_t>(blocks[static_cast<size_t>(u / layout.block_size)]) +
           static_cast<uintptr_t>(((u % layout.block_size) * layout.row_stride + c) *
                                  static_cast<int64_t>(codec::dtype_size(layout.dtype)));
  }
};

/** "byte N: cpu 0x.. gpu 0x.." for the first difference, or "" if equal. */
std::string diff(const std::vector<uint8_t>& cpu, const std::vector<uint8_t>& gpu,
                 size_t from = 0) {
  const long at = first_diff(cpu, gpu);
  if (at < 0) return "";
  size_t i = static_cast<size_t>(at);
  // Sections: name the first payload difference rather than the checksum it causes.
  if (from > 0 && cpu.size() == gpu.size())
    for (size_t j = from; j < cpu.size(); ++j)
      if (cpu[j] != gpu[j]) {
        i = j;
        break;
      }
  char b[200];
  std::snprintf(b, sizeof(b), "first difference at byte %zu of %zu/%zu%s: cpu 0x%02x gpu 0x%02x", i,
                cpu.size(), gpu.size(), from > 0 && i >= from ? " (payload)" : "",
                i < cpu.size() ? cpu[i] : 0, i < gpu.size() ? gpu[i] : 0);
  return b;
}
/** diff() of two sections: payload first (byte 80 on), then the header. */
std::string section_diff(const std::vector<uint8_t>& cpu, const std::vector<uint8_t>& gpu) {
  return diff(cpu, gpu, codec::kHeaderBytes);
}

const char* dtype_name(kvxfer_dtype_t d) {
  return d == KVXFER_DTYPE_BF16 ? "bf16" : d == KVXFER_DTYPE_FP16 ? "fp16" : "fp32";
}
const char* codec_name(kvxfer_codec_t c) {
  return c == KVXFER_CODEC_LYNX   ? "LYNX"
         : c == KVXFER_CODEC_INT8 ? "INT8"
         : c == KVXFER_CODEC_INT4 ? "INT4"
                                  : "BF16";
}

class GpuCodec : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!gpu_available(&why)) GTEST_SKIP() << "no CUDA device (" << why << "): GPU test skipped";
    ASSERT_EQ(cuda::create_anchor_stream(&stream_), KVXFER_SUCCESS) << last_error();
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    scratch_.reset();
  }

  /** Scratch large enough for any codec of a T x H page (raw fp32, or fp32 metadata + codes +
   * table). */
  const cuda::DeviceScratch& scratch(int64_t T, int32_t H) {
    const size_t n = static_cast<size_t>(T) * H;
    const size_t acap = n * 4 + static_cast<size_t>((T + 15) / 16) * H * 8 + 4 * 64 + 8,
                 rcap = n + 8;
    if (scratch_.anchor_cap() < acap || scratch_.residual_cap() < rcap) {
      EXPECT_EQ(scratch_.anchor.alloc(acap), cudaSuccess);
      EXPECT_EQ(scratch_.residual.alloc(rcap), cudaSuccess);
      EXPECT_EQ(scratch_.status_word.alloc(sizeof(cuda::DeviceStatus)), cudaSuccess);
    }
    return scratch_;
  }

  /**
   * Anchor-only decode through the low-level launch_decode alone (none of the
   * host-side checks of decode_page_device); returns the device status flags.
   */
  uint32_t low_level_anchor_decode_status(const std::vector<uint8_t>& anchor,
                                          const codec::PageHeader& h, float alpha,
                                          const DevicePage& dst) {
    const auto& sc = scratch(dst.layout.num_tokens, dst.layout.num_channels);
    copy_on_stream(sc.anchor_payload(), anchor.data() + codec::kHeaderBytes, h.payload_bytes,
                   cudaMemcpyHostToDevice, stream_);
    std::string why;
    cuda::DeviceCodebook dcb;
    EXPECT_EQ(
        cuda::upload_codebook(codec::get_codebook(KVXFER_CODEC_LYNX, alpha, 4, &why).get(), &dcb),
        KVXFER_SUCCESS);
    EXPECT_EQ(cuda::launch_reset_status(sc.status(), stream_), KVXFER_SUCCESS);
    EXPECT_EQ(cuda::launch_decode(h, dcb, sc.anchor_payload(), nullptr, &dst.layout, sc.status(),
                                  stream_),
              KVXFER_SUCCESS);
    cuda::DeviceStatus st{};
    EXPECT_EQ(cuda::read_status(sc.status(), &st, stream_), KVXFER_SUCCESS);
    return st.flags;
  }

  Encoded gpu_encode(const kvxfer_codec_config_t& cfg, const DevicePage& src,
                     kvxfer_page_id_t id = {3, KVXFER_KV_VALUE, 1000, 42}) {
    Encoded e;
    size_t amax = 0, rmax = 0;
    e.rc = codec::max_sizes(&cfg, src.layout.num_tokens, src.layout.num_channels, &amax, &rmax);
    if (e.rc != KVXFER_SUCCESS) return e;
    e.anchor.assign(amax, 0xEE);
    e.residual.assign(rmax, 0xEE);
    size_t al = 0, rl = 0;
    e.rc = cuda::encode_page_device(
        &cfg, &id, &src.layout, scratch(src.layout.num_tokens, src.layout.num_channels),
        e.anchor.data(), amax, &al, e.residual.data(), rmax, &rl, stream_);
    e.anchor.resize(al);
    e.residual.resize(rl);
    return e;
  }

  /** Decodes on the device into `dst` (anchor-only when residual is empty-and-null). */
  kvxfer_result_t gpu_decode(const std::vector<uint8_t>& anchor,
                             const std::vector<uint8_t>* residual, const DevicePage& dst) {
    const kvxfer_result_t rc = cuda::decode_page_device(
        anchor.data(), anchor.size(), residual ? residual->data() : nullptr,
        residual ? residual->size() : 0, nullptr, &dst.layout,
        scratch(dst.layout.num_tokens, dst.layout.num_channels), stream_);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return rc;
  }

  /**
   * The whole check for one page and config: encode on both sides (sections
   * byte-identical), then anchor-only decode and full decode in place, on both
   * sides, into `out_dt` blocks of another geometry (values byte-identical).
   */
  void check(const kvxfer_codec_config_t& cfg, const PagedBuffer& src, kvxfer_dtype_t out_dt,
             kvxfer_page_id_t id = {3, KVXFER_KV_VALUE, 1000, 42}) {
    const Encoded ref = encode(cfg, src, codec::Impl::REFERENCE, id);
    ASSERT_EQ(ref.rc, KVXFER_SUCCESS) << last_error();
    DevicePage dsrc(src, stream_);
    const Encoded gpu = gpu_encode(cfg, dsrc, id);
    ASSERT_EQ(gpu.rc, KVXFER_SUCCESS) << last_error();
    EXPECT_EQ(section_diff(ref.anchor, gpu.anchor), "") << "anchor section";
    EXPECT_EQ(section_diff(ref.residual, gpu.residual), "") << "residual section";

    const int64_t T = src.layout.num_tokens;
    const int32_t H = src.layout.num_channels;
    PagedBuffer cpu_dst(T, H, out_dt, 7, 1, 3), gpu_dst(T, H, out_dt, 7, 1, 3);
    DevicePage ddst(gpu_dst, stream_);
    // Anchor precision first ...
    ASSERT_EQ(codec::decode_page(ref.anchor.data(), ref.anchor.size(), nullptr, 0, nullptr,
                                 &cpu_dst.layout, codec::Impl::REFERENCE),
              KVXFER_SUCCESS)
        << last_error();
    ASSERT_EQ(gpu_decode(ref.anchor, nullptr, ddst), KVXFER_SUCCESS) << last_error();
    ddst.download(&gpu_dst);
    EXPECT_EQ(diff(cpu_dst.bytes(), gpu_dst.bytes()), "")
        << "anchor-only decode to " << dtype_name(out_dt);
    // ... then full precision, in place.
    ASSERT_EQ(
        codec::decode_page(ref.anchor.data(), ref.anchor.size(), ref.residual.data(),
                           ref.residual.size(), nullptr, &cpu_dst.layout, codec::Impl::REFERENCE),
        KVXFER_SUCCESS)
        << last_error();
    ASSERT_EQ(gpu_decode(ref.anchor, &ref.residual, ddst), KVXFER_SUCCESS) << last_error();
    ddst.download(&gpu_dst);
    EXPECT_EQ(diff(cpu_dst.bytes(), gpu_dst.bytes()), "")
        << "full decode to " << dtype_name(out_dt);
  }

  cudaStream_t stream_ = nullptr;
  cuda::DeviceScratch scratch_;
};

// Attention sinks (docs/FORMAT.md 2.7): a page from position 0 carries its
// first sink_tokens rows exactly; the device writes and reads them as the CPU.
// Sink rows far outside their chunk's other rows, which alone set its ranges:
// H 70 takes the fused kernel, H 33 the general ones; 20 sinks fill chunk 0
// and part of chunk 1.
TEST_F(GpuCodec, SinkRowsAreByteIdenticalToTheCpu) {
  for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4})
    for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP32})
      for (int32_t H : {70, 33})
        for (int sinks : {3, 20}) {
          PagedBuffer src(37, H, dt, 16);
          test::fill_kv_like(&src, 31 + codec);
          for (int32_t c = 0; c < H; ++c) {
            src.set(0, c, 300.0f * (c % 2 ? 1.0f : -1.0f));
            src.set(17, c, -200.0f * (c % 3 ? 1.0f : -1.0f));
          }
          kvxfer_codec_config_t cfg = test::config(codec, 0.0f, 16);
          cfg.sink_tokens = sinks;
          SCOPED_TRACE("codec " + std::to_string(codec) + " dtype " + std::to_string(dt) + " H " +
                       std::to_string(H) + " sinks " + std::to_string(sinks));
          check(cfg, src, KVXFER_DTYPE_FP16, kvxfer_page_id_t{0, KVXFER_KV_KEY, 0, 7});
          check(cfg, src, KVXFER_DTYPE_FP32, kvxfer_page_id_t{0, KVXFER_KV_KEY, 1, 7});
        }
}

struct CodecCase {
  kvxfer_codec_t codec;
  float alpha;
  int anchor_bits;
};

std::vector<CodecCase> every_codec() {
  std::vector<CodecCase> v;
  for (float a : {0.0f, 5.0f, 100.0f, 255.0f})
    for (int A = 2; A <= 6; ++A) v.push_back({KVXFER_CODEC_LYNX, a, A});
  for (int A = 2; A <= 6; ++A) v.push_back({KVXFER_CODEC_INT8, 0.0f, A});
  v.push_back({KVXFER_CODEC_INT4, 0.0f, 4});
  return v;
}

// T not a multiple of the chunk or the block, T < chunk, odd H (the general
// kernels), H*A a multiple of 8 (the fused kernel), partial channel groups
// and partial octets.
const std::pair<int64_t, int32_t> kShapes[] = {{1, 1},   {5, 3},     {16, 8},    {31, 7},
                                               {20, 6},  {64, 2},    {33, 64},   {100, 33},
                                               {45, 12}, {130, 256}, {47, 1000}, {200, 520}};

TEST_F(GpuCodec, EncodeAndDecodeAreByteIdenticalToReferenceEverywhere) {
  const kvxfer_dtype_t dtypes[] = {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32};
  int n = 0;
  for (const auto& [T, H] : kShapes)
    for (kvxfer_dtype_t dt : dtypes) {
      // Alternate a misaligned layout (block 16, stride pad 3, offset 5) with
      // an aligned one (block 64, no pad), which takes the vector loads.
      const bool aligned = (n++ & 1) != 0;
      PagedBuffer src(T, H, dt, aligned ? 64 : 16, aligned ? 0 : 3, aligned ? 0 : 5);
      fill_kv_like(&src, 1000 + T * 7 + H);
      int k = 0;
      for (const CodecCase& cc : every_codec())
        for (int chunk : {16, 32, 64, 128}) {
          const kvxfer_dtype_t out_dt = dtypes[k++ % 3];
#ifdef KVXFER_GPU_EMULATION
          if ((k + n) % 4 != 0) continue;  // the CPU emulation runs one chunk size in four
#endif
          SCOPED_TRACE(testing::Message()
                       << codec_name(cc.codec) << " alpha " << cc.alpha << " A " << cc.anchor_bits
                       << " C " << chunk << " T " << T << " H " << H << " " << dtype_name(dt)
                       << (aligned ? " aligned" : " misaligned"));
          check(config(cc.codec, cc.alpha, chunk, cc.anchor_bits), src, out_dt);
          if (HasFatalFailure() || HasNonfatalFailure())
            return;  // one clear failure, not thousands
        }
    }
}

// The kernels pick their access width at run time from the address: a full
// octet of a row goes out (and, encoding, comes in) as one 16-byte access
// where it is 16-byte aligned, else as 8-, 4- or element-size pieces.  Pages
// of every such alignment, by row stride (pad), block offset (first token)
// and a block base 2, 4 or 8 bytes past a 16-byte boundary: encode from them
// and decode into them, byte-identical to the CPU either way.  H 64 and 40
// take the fused encoder, H 33 and 7 the general one.
TEST_F(GpuCodec, AlignedAndUnalignedPagesAreByteIdentical) {
  struct Geometry {
    int32_t block;
    int64_t pad, first;
    size_t base_offset;
  };
  const Geometry geometries[] = {{16, 0, 0, 0}, {16, 0, 0, 8}, {16, 0, 0, 4}, {16, 0, 0, 2},
                                 {16, 4, 0, 0}, {16, 2, 0, 0}, {16, 1, 3, 0}, {5, 8, 2, 0}};
  const CodecCase cases[] = {{KVXFER_CODEC_LYNX, 0.0f, 4},
                             {KVXFER_CODEC_LYNX, 100.0f, 3},
                             {KVXFER_CODEC_INT8, 0.0f, 5},
                             {KVXFER_CODEC_INT4, 0.0f, 4}};
  const int64_t T = 37;
  int aligned16 = 0, unaligned16 = 0;
  for (int32_t H : {64, 40, 33, 7})
    for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32}) {
      PagedBuffer values(T, H, dt);
      fill_kv_like(&values, 4000 + H + dt);
      for (const Geometry& g : geometries) {
        if (g.base_offset % codec::dtype_size(dt) != 0) continue;
        PagedBuffer src(T, H, dt, g.block, g.pad, g.first);
        for (int64_t t = 0; t < T; ++t)
          for (int32_t c = 0; c < H; ++c) src.set(t, c, values.get(t, c));
        DevicePage dsrc(src, stream_, g.base_offset);
        for (int64_t t = 0; t < T; ++t)
          for (int32_t c = 0; c + 8 <= H; c += 8)
            ++((dsrc.address(t, c) & 15u) ? unaligned16 : aligned16);
        for (const CodecCase& cc : cases) {
          SCOPED_TRACE(testing::Message()
                       << codec_name(cc.codec) << " A " << cc.anchor_bits << " H " << H << " "
                       << dtype_name(dt) << " block " << g.block << " pad " << g.pad << " first "
                       << g.first << " base +" << g.base_offset);
          const kvxfer_codec_config_t cfg = config(cc.codec, cc.alpha, 16, cc.anchor_bits);
          const Encoded ref = encode(cfg, values, codec::Impl::REFERENCE);
          ASSERT_EQ(ref.rc, KVXFER_SUCCESS) << last_error();
          const Encoded gpu = gpu_encode(cfg, dsrc);
          ASSERT_EQ(gpu.rc, KVXFER_SUCCESS) << last_error();
          EXPECT_EQ(section_diff(ref.anchor, gpu.anchor), "") << "anchor section";
          EXPECT_EQ(section_diff(ref.residual, gpu.residual), "") << "residual section";
          // Decode (anchor-only, then full) into a page of this geometry, poisoned first.
          PagedBuffer cpu_dst(T, H, dt, g.block, g.pad, g.first);
          PagedBuffer gpu_dst(T, H, dt, g.block, g.pad, g.first);
          DevicePage ddst(gpu_dst, stream_, g.base_offset);
          for (const bool full : {false, true}) {
            const std::vector<uint8_t>* res = full ? &ref.residual : nullptr;
            ASSERT_EQ(codec::decode_page(ref.anchor.data(), ref.anchor.size(),
                                         full ? ref.residual.data() : nullptr,
                                         full ? ref.residual.size() : 0, nullptr, &cpu_dst.layout,
                                         codec::Impl::REFERENCE),
                      KVXFER_SUCCESS)
                << last_error();
            ASSERT_EQ(gpu_decode(ref.anchor, res, ddst), KVXFER_SUCCESS) << last_error();
            ddst.download(&gpu_dst);
            EXPECT_EQ(diff(cpu_dst.bytes(), gpu_dst.bytes()), "")
                << (full ? "full" : "anchor-only") << " decode";
            // Rows' padding and the blocks' unused rows untouched too.
            EXPECT_EQ(cpu_dst.storage, gpu_dst.storage) << "bytes outside the page's elements";
          }
          if (HasFatalFailure() || HasNonfatalFailure()) return;
        }
      }
    }
  // Both access paths were taken (octets of 8 elements, by address).
  EXPECT_GT(aligned16, 0);
  EXPECT_GT(unaligned16, 0);
}

TEST_F(GpuCodec, LargePageWithPinnedBuffers) {
  const int64_t T = 4096 + 17;
  const int32_t H = 1024;
  for (auto [dt, A] : {std::pair{KVXFER_DTYPE_BF16, 4}, std::pair{KVXFER_DTYPE_FP16, 3}}) {
    PagedBuffer src(T, H, dt, 16, 0, 0);
    fill_kv_like(&src, 77);
    const kvxfer_codec_config_t cfg = config(KVXFER_CODEC_LYNX, 0.0f, 32, A);
    const Encoded ref = encode(cfg, src, codec::Impl::REFERENCE);
    ASSERT_EQ(ref.rc, KVXFER_SUCCESS);
    DevicePage dsrc(src, stream_);
    size_t amax = 0, rmax = 0, al = 0, rl = 0;
    ASSERT_EQ(codec::max_sizes(&cfg, T, H, &amax, &rmax), KVXFER_SUCCESS);
    uint8_t *pa = nullptr, *pr = nullptr;
    CUDA_OK(cudaMallocHost(&pa, amax));
    CUDA_OK(cudaMallocHost(&pr, rmax));
    cuda::DeviceScratch sc;
    ASSERT_EQ(cuda::alloc_scratch(&cfg, T, H, &sc), KVXFER_SUCCESS) << last_error();
    const kvxfer_page_id_t id{3, KVXFER_KV_VALUE, 1000, 42};
    ASSERT_EQ(cuda::encode_page_device(&cfg, &id, &dsrc.layout, sc, pa, amax, &al, pr, rmax, &rl,
                                       stream_),
              KVXFER_SUCCESS)
        << last_error();
    const std::vector<uint8_t> ga(pa, pa + al), gr(pr, pr + rl);
    EXPECT_EQ(section_diff(ref.anchor, ga), "") << "anchor section " << dtype_name(dt);
    EXPECT_EQ(section_diff(ref.residual, gr), "") << "residual section " << dtype_name(dt);
    cudaFreeHost(pa);
    cudaFreeHost(pr);
  }
}

TEST_F(GpuCodec, HugeValuesUseFp32MetadataLikeTheCpu) {
  for (kvxfer_dtype_t dt : {KVXFER_DTYPE_FP32, KVXFER_DTYPE_BF16}) {
    PagedBuffer src(70, 24, dt);
    fill_kv_like(&src, 5, 1e5f);  // ranges beyond binary16
    src.set(3, 1, 3.0e38f);
    src.set(4, 1, -3.0e38f);
    for (const CodecCase& cc :
         {CodecCase{KVXFER_CODEC_LYNX, 0.0f, 4}, CodecCase{KVXFER_CODEC_LYNX, 100.0f, 5},
          CodecCase{KVXFER_CODEC_INT8, 0.0f, 3}, CodecCase{KVXFER_CODEC_INT4, 0.0f, 4}}) {
      SCOPED_TRACE(testing::Message() << codec_name(cc.codec) << " " << dtype_name(dt));
      const kvxfer_codec_config_t cfg = config(cc.codec, cc.alpha, 32, cc.anchor_bits);
      DevicePage dsrc(src, stream_);
      const Encoded gpu = gpu_encode(cfg, dsrc);
      ASSERT_EQ(gpu.rc, KVXFER_SUCCESS) << last_error();
      EXPECT_TRUE(gpu.anchor[10] & codec::FLAG_META_FP32)
          << "flags 0x" << std::hex << int(gpu.anchor[10]);
      check(cfg, src, dt);
    }
  }
}

TEST_F(GpuCodec, ConstantZeroSignedZeroAndDenormalChannels) {
  for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32}) {
    PagedBuffer src(50, 16, dt);
    fill_kv_like(&src, 9);
    for (int64_t t = 0; t < 50; ++t) {
      src.set(t, 0, 1.5f);                               // constant: d = 0
      src.set(t, 1, (t & 1) ? -0.0f : 0.0f);             // -0 / +0
      src.set(t, 2, static_cast<float>(t) * 1e-41f);     // fp32 denormals
      src.set(t, 3, static_cast<float>(t % 5) * 6e-8f);  // fp16 subnormal range
      src.set(t, 4, t == 20 ? 65504.0f : -65504.0f);     // edge of binary16
    }
    SCOPED_TRACE(dtype_name(dt));
    check(config(KVXFER_CODEC_LYNX, 20.0f, 16, 4), src, dt);
    check(config(KVXFER_CODEC_INT8, 0.0f, 32, 5), src, KVXFER_DTYPE_FP32);
  }
}

TEST_F(GpuCodec, NonFiniteErrorNamesTheFirstElementAndRawFallbackMatches) {
  for (kvxfer_codec_t codec :
       {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4, KVXFER_CODEC_BF16})
    for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP32})
      for (float bad :
           {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
            -std::numeric_limits<float>::infinity()}) {
        SCOPED_TRACE(testing::Message()
                     << codec_name(codec) << " " << dtype_name(dt) << " " << bad);
        PagedBuffer src(90, 13, dt);
        fill_kv_like(&src, 11);
        src.set(70, 1, bad);  // later chunk
        src.set(40, 9, bad);  // the first in token-major order
        src.set(41, 0, bad);
        src.set(33, 5, 1e6f);  // a chunk that also needs fp32 metadata
        kvxfer_codec_config_t cfg = config(codec, 5.0f, 32, 4);
        DevicePage dsrc(src, stream_);
        const Encoded ref = encode(cfg, src, codec::Impl::REFERENCE);
        const std::string ref_err = last_error();
        const Encoded gpu = gpu_encode(cfg, dsrc);
        const std::string gpu_err = last_error();
        EXPECT_EQ(ref.rc, KVXFER_ERR_NONFINITE);
        EXPECT_EQ(gpu.rc, KVXFER_ERR_NONFINITE);
        EXPECT_EQ(gpu_err, ref_err);
        EXPECT_NE(gpu_err.find("token 1040, channel 9"), std::string::npos) << gpu_err;

        cfg.nonfinite = KVXFER_NONFINITE_RAW;
        check(cfg, src, dt);
      }
}

TEST_F(GpuCodec, Bf16PassthroughAndEmptyPages) {
  for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32}) {
    PagedBuffer src(37, 9, dt);
    fill_kv_like(&src, 3);
    SCOPED_TRACE(dtype_name(dt));
    check(config(KVXFER_CODEC_BF16), src, KVXFER_DTYPE_FP32);
    check(config(KVXFER_CODEC_BF16), src, dt);
  }
  for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT4, KVXFER_CODEC_BF16}) {
    PagedBuffer empty(0, 8, KVXFER_DTYPE_BF16);
    check(config(codec), empty, KVXFER_DTYPE_BF16);
  }
}

TEST_F(GpuCodec, HostileMetadataWritesNothing) {
  PagedBuffer src(40, 16, KVXFER_DTYPE_BF16);
  fill_kv_like(&src, 4);
  const kvxfer_codec_config_t cfg = config(KVXFER_CODEC_LYNX, 0.0f, 16, 4);
  Encoded ref = encode(cfg, src, codec::Impl::REFERENCE);
  ASSERT_EQ(ref.rc, KVXFER_SUCCESS);
  // d of entry 17 := NaN (binary16 0x7E00), then re-seal: checksum-valid but hostile.
  ref.anchor[codec::kHeaderBytes + 17 * 4 + 2] = 0x00;
  ref.anchor[codec::kHeaderBytes + 17 * 4 + 3] = 0x7E;
  codec::seal_section(ref.anchor.data());
  PagedBuffer before(40, 16, KVXFER_DTYPE_BF16, 7, 1, 3), after(40, 16, KVXFER_DTYPE_BF16, 7, 1, 3);
  DevicePage ddst(before, stream_);
  EXPECT_EQ(gpu_decode(ref.anchor, nullptr, ddst), KVXFER_ERR_CORRUPT);
  EXPECT_NE(std::string(last_error()).find("metadata entry 17"), std::string::npos) << last_error();
  ddst.download(&after);
  EXPECT_EQ(diff(before.bytes(), after.bytes()), "");

  // The low-level path checks on the device: STATUS_BAD_META, nothing written.
  codec::PageHeader h;
  ASSERT_EQ(codec::parse_section(ref.anchor.data(), ref.anchor.size(), &h), KVXFER_SUCCESS);
  EXPECT_EQ(low_level_anchor_decode_status(ref.anchor, h, 0.0f, ddst), cuda::STATUS_BAD_META);
  ddst.download(&after);
  EXPECT_EQ(diff(before.bytes(), after.bytes()), "");
}

TEST_F(GpuCodec, AnchorTableOutsideItsBinWritesNothing) {
  PagedBuffer src(40, 16, KVXFER_DTYPE_BF16);
  fill_kv_like(&src, 6);
  const kvxfer_codec_config_t cfg = config(KVXFER_CODEC_LYNX, 5.0f, 16, 4);
  Encoded ref = encode(cfg, src, codec::Impl::REFERENCE);
  ASSERT_EQ(ref.rc, KVXFER_SUCCESS);
  codec::PageHeader h;
  ASSERT_EQ(codec::parse_section(ref.anchor.data(), ref.anchor.size(), &h), KVXFER_SUCCESS);
  const codec::PayloadSizes s = codec::payload_sizes(h);
  ASSERT_EQ(s.table_bytes, 64u);
  // Entry 3 := 2.0 (outside every bin), then re-seal: checksum-valid but hostile.
  codec::put_f32_le(ref.anchor.data() + codec::kHeaderBytes + s.table_offset() + 12, 2.0f);
  codec::seal_section(ref.anchor.data());
  PagedBuffer before(40, 16, KVXFER_DTYPE_FP32, 7, 1, 3), after(40, 16, KVXFER_DTYPE_FP32, 7, 1, 3);
  EXPECT_EQ(codec::decode_page(ref.anchor.data(), ref.anchor.size(), nullptr, 0, nullptr,
                               &after.layout, codec::Impl::REFERENCE),
            KVXFER_ERR_CORRUPT);
  const std::string cpu_err = last_error();
  DevicePage ddst(before, stream_);
  EXPECT_EQ(gpu_decode(ref.anchor, nullptr, ddst), KVXFER_ERR_CORRUPT);
  EXPECT_EQ(std::string(last_error()), cpu_err);
  ddst.download(&after);
  EXPECT_EQ(diff(before.bytes(), after.bytes()), "");

  // The low-level path checks the table on the device.
  EXPECT_EQ(low_level_anchor_decode_status(ref.anchor, h, 5.0f, ddst), cuda::STATUS_BAD_META);
  ddst.download(&after);
  EXPECT_EQ(diff(before.bytes(), after.bytes()), "");
}

TEST_F(GpuCodec, ErrorsMatchTheCpuApi) {
  PagedBuffer src(20, 8, KVXFER_DTYPE_BF16);
  fill_kv_like(&src, 1);
  DevicePage dsrc(src, stream_);
  kvxfer_codec_config_t cfg = config(KVXFER_CODEC_LYNX);
  cfg.alpha = KVXFER_ALPHA_AUTO;
  EXPECT_EQ(gpu_encode(cfg, dsrc).rc, KVXFER_ERR_UNSUPPORTED);
  cfg = config(KVXFER_CODEC_LYNX);
  std::vector<uint8_t> a(100), r(100);
  size_t al = 0, rl = 0;
  const kvxfer_page_id_t id{3, KVXFER_KV_VALUE, 1000, 42};
  EXPECT_EQ(cuda::encode_page_device(&cfg, &id, &dsrc.layout, scratch(20, 8), a.data(), a.size(),
                                     &al, r.data(), r.size(), &rl, stream_),
            KVXFER_ERR_BUFFER_TOO_SMALL);
  cfg.chunk_tokens = 48;
  EXPECT_EQ(gpu_encode(cfg, dsrc).rc, KVXFER_ERR_INVALID_ARGUMENT);
}

// Token-grouped V pages (docs/FORMAT.md 2.8) are a host format: the device
// refuses to make one, AUTO makes the channel page, K pages are unaffected,
// and a token-grouped page from the host is refused before anything is
// written.
TEST_F(GpuCodec, TokenGroupsAreRefusedAndAutoIsChannel) {
  PagedBuffer src(40, 16, KVXFER_DTYPE_BF16);
  fill_kv_like(&src, 5);
  DevicePage dsrc(src, stream_);
  kvxfer_codec_config_t cfg = config(KVXFER_CODEC_LYNX, 0.0f);
  cfg.value_groups = KVXFER_VALUE_GROUPS_TOKEN;
  EXPECT_EQ(gpu_encode(cfg, dsrc).rc, KVXFER_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(last_error()).find("value_groups=token"), std::string::npos);
  const kvxfer_page_id_t key{3, KVXFER_KV_KEY, 1000, 42};
  kvxfer_codec_config_t chan = cfg;
  chan.value_groups = KVXFER_VALUE_GROUPS_CHANNEL;
  EXPECT_EQ(gpu_encode(cfg, dsrc, key).anchor,
            encode(chan, src, codec::Impl::REFERENCE, key).anchor);
  kvxfer_codec_config_t autoc = cfg;
  autoc.value_groups = KVXFER_VALUE_GROUPS_AUTO;
  const Encoded g = gpu_encode(autoc, dsrc);
  ASSERT_EQ(g.rc, KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(g.anchor, encode(chan, src, codec::Impl::REFERENCE).anchor);

  const Encoded host = encode(cfg, src, codec::Impl::REFERENCE);
  ASSERT_EQ(host.rc, KVXFER_SUCCESS) << last_error();
  PagedBuffer out(40, 16, KVXFER_DTYPE_BF16);
  DevicePage dout(out, stream_);
  EXPECT_EQ(gpu_decode(host.anchor, &host.residual, dout), KVXFER_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(last_error()).find("token groups"), std::string::npos);
  PagedBuffer back(40, 16, KVXFER_DTYPE_BF16);
  dout.download(&back);
  EXPECT_EQ(back.bytes(), out.bytes()) << "nothing written";
}

// An error left pending by earlier work is reported as such by the next
// launch call, which launches nothing, and is not blamed on its kernel; the
// call after it succeeds (src/kernels/codec_kernels.h, Launched).
TEST_F(GpuCodec, PendingErrorIsNotBlamedOnTheNextLaunch) {
#ifdef KVXFER_GPU_EMULATION
  GTEST_SKIP() << "the emulated runtime has no error state";
#endif
  const auto& sc = scratch(4, 8);
  void* p = nullptr;
  ASSERT_NE(cudaMalloc(&p, size_t{1} << 62), cudaSuccess);  // leaves an error pending
  EXPECT_EQ(cuda::launch_reset_status(sc.status(), stream_), KVXFER_ERR_SYSTEM);
  EXPECT_NE(std::string(last_error()).find("earlier work (an error pending before reset_status)"),
            std::string::npos)
      << last_error();
  EXPECT_EQ(cuda::launch_reset_status(sc.status(), stream_), KVXFER_SUCCESS) << last_error();
  cuda::DeviceStatus st{};
  EXPECT_EQ(cuda::read_status(sc.status(), &st, stream_), KVXFER_SUCCESS);
  EXPECT_EQ(st.first_bad, ~0ull);
}

TEST_F(GpuCodec, AnchorStreamHasTheGreatestPriority) {
  int least = 0, greatest = 0, prio = 0;
  CUDA_OK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  CUDA_OK(cudaStreamGetPriority(stream_, &prio));
  EXPECT_EQ(prio, greatest);
}

#ifdef KVXFER_GPU_EMULATION
extern "C" int kvxfer_emu_allocs, kvxfer_emu_frees;
#endif

// Moving a CudaBuffer hands its memory over, size included, and leaves the
// source empty; a move-assignment frees the target's memory first; every
// allocation is freed once.
TEST_F(GpuCodec, CudaBuffersMoveTheirMemoryAndSize) {
#ifdef KVXFER_GPU_EMULATION
  const int allocs0 = kvxfer_emu_allocs, frees0 = kvxfer_emu_frees;
#endif
  {
    cuda::DeviceBuffer a;
    CUDA_OK(a.alloc(100));
    uint8_t* const pa = a.p;
    ASSERT_NE(pa, nullptr);
    cuda::DeviceBuffer b(std::move(a));
    EXPECT_EQ(b.p, pa);
    EXPECT_EQ(b.n, 100u);
    EXPECT_EQ(a.p, nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is the point
    EXPECT_EQ(a.n, 0u);

    cuda::PinnedBuffer h, g;
    CUDA_OK(h.alloc(24));
    CUDA_OK(g.alloc(1000));
    uint8_t* const ph = h.p;
    std::memset(ph, 0x5a, 24);
    g = std::move(h);
    EXPECT_EQ(g.p, ph);
    EXPECT_EQ(g.n, 24u);
    EXPECT_EQ(g.p[23], 0x5a);
    EXPECT_EQ(h.p, nullptr);  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(h.n, 0u);
#ifdef KVXFER_GPU_EMULATION
    EXPECT_EQ(kvxfer_emu_allocs - allocs0, 3);
    EXPECT_EQ(kvxfer_emu_frees - frees0, 1);  // g's 1000 bytes
#endif
  }
#ifdef KVXFER_GPU_EMULATION
  EXPECT_EQ(kvxfer_emu_frees - frees0, 3);  // b and g, once each; a and h held nothing
#endif
}

}  // namespace
}  // namespace kvxfer::test
