// codec_perf --gpu: the CUDA kernels (src/cuda/device_codec.h) on one device
// page (docs/PERFORMANCE.md, "codec_perf --gpu").  Built when CMake found CUDA
// (KVXFER_HAVE_CUDA defines KVXFER_CODEC_PERF_GPU); elsewhere --gpu only
// prints why it skipped.
#include <cinttypes>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "perf/codec_perf.h"
#ifdef KVXFER_CODEC_PERF_GPU
#include "cuda/cuda_check.h"
#include "cuda/device_codec.h"
#endif

namespace codec_perf {

// ---------------------------------------------------------------------------
// --gpu: the CUDA kernels (src/cuda/device_codec.h) on one device page
// (docs/PERFORMANCE.md, "codec_perf --gpu").  Built when CMake found CUDA
// (KVXFER_HAVE_CUDA defines KVXFER_CODEC_PERF_GPU); elsewhere --gpu only
// prints why it skipped.
// ---------------------------------------------------------------------------
#ifdef KVXFER_GPU_EMULATION
constexpr const char* kGpuTimerName = "steady_clock (CPU emulation)";
#else
constexpr const char* kGpuTimerName = "CUDA events, L2 flushed before each";
#endif
constexpr double kHbmTarget = 0.8;  // the target: >= 80% of HBM bandwidth

/** The "# skipped" line (and JSON file) of --gpu without a usable device; exit status 0. */
int gpu_skip(const Options& o, const std::string& why) {
  std::printf("# skipped: no CUDA device (%s)\n", why.c_str());
  if (!o.common.json_path.empty()) {
    json j = {{"tool", "codec_perf"},
              {"mode", "gpu"},
              {"kvxfer_version", KVXFER_VERSION_CODE},
              {"machine", kp::to_json(kp::machine_info())},
              {"skipped", why}};
    if (kp::emit_json("codec_perf", o.common.json_path, j) != 0) return 2;
  }
  return 0;
}

#ifdef KVXFER_CODEC_PERF_GPU
namespace kcu = kvxfer::cuda;

/** A CUDA runtime result through kcu::cuda_result; prints a failure and returns false. */
bool cuda_ok(cudaError_t e, const char* what) {
  const kvxfer_result_t r = kcu::cuda_result(e, what);
  return r >= 0 || report_failure(what, r);
}
#define CODEC_PERF_KV(call)                       \
  do {                                            \
    const kvxfer_result_t r_ = (call);            \
    if (r_ < 0) return report_failure(#call, r_); \
  } while (0)

using DevBuf = kvxfer::cuda::DeviceBuffer;  // src/cuda/device_buffer.h

/** DevBuf::alloc, printing a failure; returns false then. */
bool alloc(DevBuf* b, size_t bytes) { return cuda_ok(b->alloc(bytes), "cudaMalloc"); }

/**
 * Copies n bytes host <-> device in order with the work on stream s: through a
 * pinned staging buffer, by cudaMemcpyAsync on s, then waits for s (before the
 * staging buffer goes).  A pageable cudaMemcpy runs on the legacy default
 * stream, which s (non-blocking) does not wait for: an upload might not have
 * landed when the next kernel on s starts.
 */
bool copy_on_stream(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s,
                    const char* what) {
  if (n == 0) return true;
  kvxfer::cuda::PinnedBuffer pin;
  if (!cuda_ok(pin.alloc(n), "cudaMallocHost")) return false;
  const bool up = kind == cudaMemcpyHostToDevice;
  if (up) std::memcpy(pin.p, src, n);
  if (!cuda_ok(cudaMemcpyAsync(up ? dst : pin.p, up ? pin.p : src, n, kind, s), what) ||
      !cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize"))
    return false;
  if (!up) std::memcpy(dst, pin.p, n);
  return true;
}

/**
 * A one-page host Pool mirrored in device memory: the same bytes, the same
 * pseudo-random block order, and the block table itself in device memory
 * (src/cuda/device_codec.h, "Device layouts"), as a vLLM runtime holds it.
 */
struct DevicePool {
  DevBuf storage, table;
  kvxfer_page_layout_t layout{};
  cudaStream_t stream = nullptr;  // the stream of the kernels: every copy is ordered on it
  bool init(const Pool& h, cudaStream_t s) {
    stream = s;
    if (!alloc(&storage, h.storage.size())) return false;
    std::vector<void*> blocks;
    for (void* b : h.blocks[0])
      blocks.push_back(storage.p + (static_cast<uint8_t*>(b) - h.storage.data()));
    if (!alloc(&table, blocks.size() * sizeof(void*))) return false;
    if (!copy_on_stream(table.p, blocks.data(), blocks.size() * sizeof(void*),
                        cudaMemcpyHostToDevice, stream, "cudaMemcpyAsync(block table)"))
      return false;
    layout = h.layouts[0];
    layout.blocks = reinterpret_cast<void* const*>(table.p);
    return true;
  }
  bool upload(const Pool& h) {
    return copy_on_stream(storage.p, h.storage.data(), h.storage.size(), cudaMemcpyHostToDevice,
                          stream, "cudaMemcpyAsync(upload)");
  }
  bool download(Pool* h) const {
    return copy_on_stream(h->storage.data(), storage.p, h->storage.size(), cudaMemcpyDeviceToHost,
                          stream, "cudaMemcpyAsync(download)");
  }
};

/**
 * Times work enqueued on one stream.  Each of the w + n iterations: the L2
 * cache is flushed (a cudaMemsetAsync of twice its size, not timed), then a
 * CUDA event is recorded before and after the work, and the iteration's time
 * is cudaEventElapsedTime of the pair.  Under the CPU emulation of the
 * kernels (KVXFER_GPU_EMULATION, target codec_perf_emu) there are no events
 * and no cache: steady_clock around the (synchronous) work.
 */
class GpuTimer {
 public:
  GpuTimer() = default;
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;
  ~GpuTimer() {
#ifndef KVXFER_GPU_EMULATION
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
#endif
  }
  bool init(cudaStream_t s, size_t l2_bytes) {
    stream_ = s;
#ifndef KVXFER_GPU_EMULATION
    if (!cuda_ok(cudaEventCreate(&start_), "cudaEventCreate")) return false;
    if (!cuda_ok(cudaEventCreate(&stop_), "cudaEventCreate")) return false;
    if (l2_bytes > 0 && !alloc(&flush_, 2 * l2_bytes)) return false;
#else
    (void)l2_bytes;
#endif
    return true;
  }
  /** Runs `enqueue` w + n times; *out summarises the last n (median etc., as kp::time_loop). */
  bool loop(int w, int n, const std::function<bool()>& enqueue, kp::Stats* out) {
    std::vector<double> us;
    for (int i = 0; i < w + n; ++i) {
#ifndef KVXFER_GPU_EMULATION
      if (flush_.n > 0 &&
          !cuda_ok(cudaMemsetAsync(flush_.p, i & 0xff, flush_.n, stream_), "cudaMemsetAsync"))
        return false;
      if (!cuda_ok(cudaEventRecord(start_, stream_), "cudaEventRecord")) return false;
      if (!enqueue()) return false;
      if (!cuda_ok(cudaEventRecord(stop_, stream_), "cudaEventRecord")) return false;
      if (!cuda_ok(cudaEventSynchronize(stop_), "cudaEventSynchronize")) return false;
      float ms = 0;
      if (!cuda_ok(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime")) return false;
      if (i >= w) us.push_back(1e3 * static_cast<double>(ms));
#else
      const auto t0 = std::chrono::steady_clock::now();
      if (!enqueue()) return false;
      if (!cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize")) return false;
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= w) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
#endif
    }
    *out = kp::summarize(std::move(us));
    return true;
  }

 private:
  cudaStream_t stream_ = nullptr;
#ifndef KVXFER_GPU_EMULATION
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  DevBuf flush_;
#endif
};

/** One row of the --gpu table: one kernel operation of one codec. */
struct GpuRow {
  GpuRow(std::string o, uint64_t r, uint64_t w) : op(std::move(o)), read(r), written(w) {}
  std::string op;             // encode | dec_anchor | dec_full
  uint64_t read = 0;          // bytes the operation must read from device memory
  uint64_t written = 0;       // bytes it must write
  kp::Stats t;                // the operation
  uint64_t memcpy_bytes = 0;  // (read + written) / 2, copied device to device
  kp::Stats mc;               // that cudaMemcpyAsync
  int64_t wrong = -1;         // -1: not checked
};

/** Times a device-to-device cudaMemcpyAsync of `bytes` (moving 2 x bytes). */
bool gpu_memcpy(const Options& o, GpuTimer* timer, cudaStream_t s, uint64_t bytes, kp::Stats* out) {
  DevBuf a, b;
  if (!alloc(&a, bytes) || !alloc(&b, bytes)) return false;
  if (!cuda_ok(cudaMemcpyAsync(a.p, b.p, bytes, cudaMemcpyDeviceToDevice, s),
               "cudaMemcpyAsync(touch)"))
    return false;
  return timer->loop(
      o.common.warmup, o.common.iters,
      [&] {
        return cuda_ok(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s),
                       "cudaMemcpyAsync(device to device)");
      },
      out);
}

/** Status after a launch sequence; false (with a message) on anything but `allowed` flags. */
bool gpu_status(const kcu::DeviceScratch& sc, cudaStream_t s, uint32_t allowed, uint32_t* flags,
                const char* what) {
  kcu::DeviceStatus st{};
  CODEC_PERF_KV(kcu::read_status(sc.status(), &st, s));
  *flags = st.flags;
  if ((st.flags & ~allowed) != 0) {
    std::fprintf(stderr, "codec_perf: %s: device status 0x%x (%s%s%s)\n", what, st.flags,
                 st.flags & kcu::STATUS_NEED_FP32 ? "need fp32 metadata " : "",
                 st.flags & kcu::STATUS_NONFINITE ? "non-finite input " : "",
                 st.flags & kcu::STATUS_BAD_META ? "bad metadata" : "");
    return false;
  }
  return true;
}

/**
 * Measures one codec on one device page: encode, anchor-only decode and (for
 * the split codecs) full decode, each against a D2D memcpy of the same bytes,
 * and with -c 1 compares the GPU's payloads and decoded pages with the CPU
 * codec's (`ref` path) byte for byte.  The decodes read the payloads the GPU
 * encode just wrote.
 */
bool gpu_codec(const Options& o, const CodecCase& cc, kc::Impl ref, const Pool& hsrc, Pool* hdst,
               const DevicePool& dsrc, DevicePool* ddst, GpuTimer* timer, cudaStream_t s,
               bool* meta_fp32, std::vector<GpuRow>* rows) {
  // The kernels alone: a page past the attention-sink rows, which the encode
  // driver packs with the BF16 passthrough's kernel (docs/FORMAT.md 2.7).
  const kvxfer_page_id_t id{0, KVXFER_KV_KEY, int64_t{1} << 20, 0};
  const int64_t T = hsrc.T;
  const int32_t H = hsrc.H;
  const uint64_t page = hsrc.page_bytes();
  const bool check = o.common.check != 0;

  // CPU: sections and decoded pages (-c 1).
  std::vector<uint8_t> canc, cres, cpu_anchor, cpu_full;
  size_t cal = 0, crl = 0;
  if (check) {
    size_t amax = 0, rmax = 0;
    CODEC_PERF_KV(kc::max_sizes(&cc.cfg, T, H, &amax, &rmax));
    canc.resize(amax);
    cres.resize(rmax);
    CODEC_PERF_KV(kc::encode_page(&cc.cfg, &id, &hsrc.layouts[0], canc.data(), amax, &cal,
                                  cres.data(), rmax, &crl, ref, 0));
    hdst->poison();
    CODEC_PERF_KV(kc::decode_page(canc.data(), cal, nullptr, 0, &id, &hdst->layouts[0], ref, 0));
    cpu_anchor = hdst->gather(0);
    hdst->poison();
    CODEC_PERF_KV(
        kc::decode_page(canc.data(), cal, cres.data(), crl, &id, &hdst->layouts[0], ref, 0));
    cpu_full = hdst->gather(0);
  }

  // GPU: codebook, scratch, metadata precision (fp16 first, as the CPU codec).
  std::string why;
  const kc::CodebookRef cb = kc::get_codebook(cc.cfg.codec, cc.cfg.alpha, cc.cfg.anchor_bits, &why);
  if (cb == nullptr) {
    std::fprintf(stderr, "codec_perf: no codebook for %s %s: %s\n", cc.name.c_str(),
                 cc.params.c_str(), why.c_str());
    return false;
  }
  kcu::DeviceCodebook dcb;
  CODEC_PERF_KV(kcu::upload_codebook(cb.get(), &dcb));
  kcu::DeviceScratch sc;
  CODEC_PERF_KV(kcu::alloc_scratch(&cc.cfg, T, H, &sc));
  kc::PageHeader h = kc::make_header(cc.cfg, id, T, H, hsrc.dtype);
  bool fp32 = false;
  auto encode = [&] {
    const kvxfer_result_t r1 = kcu::launch_reset_status(sc.status(), s);
    if (r1 < 0) return report_failure("launch_reset_status", r1);
    const kvxfer_result_t r2 = kcu::launch_encode(
        dcb, &dsrc.layout, cc.cfg.chunk_tokens, static_cast<int64_t>(h.sink_rows), fp32,
        sc.anchor_payload(), sc.residual_payload(), sc.status(), s);
    return r2 < 0 ? report_failure("launch_encode", r2) : true;
  };
  uint32_t flags = 0;
  if (!encode() || !gpu_status(sc, s, kcu::STATUS_NEED_FP32, &flags, "encode")) return false;
  if (flags & kcu::STATUS_NEED_FP32) {
    fp32 = true;
    h.flags = kc::FLAG_META_FP32;
  }
  *meta_fp32 = fp32;
  const kc::PayloadSizes ps = kc::payload_sizes(h);
  const uint64_t apay = ps.anchor_payload(), rpay = ps.residual_codes;
  std::vector<uint8_t> tmp;
  auto count = [&](const uint8_t* dev, uint64_t n, const std::vector<uint8_t>& cpu, size_t cpu_len,
                   uint64_t* wrong) {
    tmp.resize(n);
    if (!copy_on_stream(tmp.data(), dev, n, cudaMemcpyDeviceToHost, s, "cudaMemcpyAsync"))
      return false;
    *wrong += count_wrong(tmp.data(), n, cpu.data() + kc::kHeaderBytes, cpu_len - kc::kHeaderBytes);
    return true;
  };

  // encode
  GpuRow enc{"encode", page, apay + rpay};
  if (!timer->loop(o.common.warmup, o.common.iters, encode, &enc.t)) return false;
  if (!gpu_status(sc, s, 0, &flags, "encode")) return false;
  if (check) {
    uint64_t w = 0;
    if (!count(sc.anchor_payload(), apay, canc, cal, &w) ||
        !count(sc.residual_payload(), rpay, cres, crl, &w))
      return false;
    enc.wrong = static_cast<int64_t>(w);
  }
  rows->push_back(enc);

  // decodes, from the payloads just encoded on the device
  auto decode = [&](bool full, GpuRow* row) {
    hdst->poison();  // 0xA5 everywhere: a row the kernel skipped cannot match
    if (!ddst->upload(*hdst)) return false;
    auto run = [&] {
      const kvxfer_result_t r1 = kcu::launch_reset_status(sc.status(), s);
      if (r1 < 0) return report_failure("launch_reset_status", r1);
      const kvxfer_result_t r2 =
          kcu::launch_decode(h, dcb, sc.anchor_payload(), full ? sc.residual_payload() : nullptr,
                             &ddst->layout, sc.status(), s);
      return r2 < 0 ? report_failure("launch_decode", r2) : true;
    };
    if (!timer->loop(o.common.warmup, o.common.iters, run, &row->t)) return false;
    if (!gpu_status(sc, s, 0, &flags, full ? "full decode" : "anchor decode")) return false;
    if (check) {
      if (!ddst->download(hdst)) return false;
      const std::vector<uint8_t> got = hdst->gather(0);
      const std::vector<uint8_t>& want = full ? cpu_full : cpu_anchor;
      row->wrong =
          static_cast<int64_t>(count_wrong(got.data(), got.size(), want.data(), want.size()));
    }
    return true;
  };
  GpuRow da{"dec_anchor", apay, page};
  if (!decode(false, &da)) return false;
  rows->push_back(da);
  if (rpay > 0) {  // INT4 has no residual: its full decode is the anchor decode
    GpuRow df{"dec_full", apay + rpay, page};
    if (!decode(true, &df)) return false;
    rows->push_back(df);
  }
  return true;
}

#endif  // KVXFER_CODEC_PERF_GPU

int run_gpu(const Options& o, const std::vector<kvxfer_dtype_t>& dtypes,
            const std::vector<CodecCase>& cases) {
  const kp::MachineInfo mach = kp::machine_info();
  const std::vector<kp::Setting> settings = kp::kvxfer_settings();
  kp::print_preamble(stdout, "codec_perf", mach, settings);
  std::string dts;
  for (kvxfer_dtype_t d : dtypes) dts += std::string(dts.empty() ? "" : ",") + dtype_name(d);
  std::printf("# Options: --gpu -w %d -n %d -c %d -d %s --codec %s --tokens %" PRId64
              "%s | time = median of -n iterations, %s | "
              "block %d tokens\n",
              o.common.warmup, o.common.iters, o.common.check, dts.c_str(), o.codecs.c_str(),
              o.tokens, o.common.quick ? " --quick" : "", kGpuTimerName, kBlockSize);
  std::fflush(stdout);
#ifndef KVXFER_CODEC_PERF_GPU
  (void)cases;
  return gpu_skip(o, "this codec_perf was built without CUDA (KVXFER_HAVE_CUDA OFF)");
#else
  int ndev = 0;
  const cudaError_t de = cudaGetDeviceCount(&ndev);
  if (de != cudaSuccess)
    return gpu_skip(o, kp::strprintf("cudaGetDeviceCount: %s", cudaGetErrorString(de)));
  if (ndev == 0) return gpu_skip(o, "cudaGetDeviceCount found 0 devices");
  int dev = 0;
  if (!cuda_ok(cudaGetDevice(&dev), "cudaGetDevice")) return 2;
  json jgpu;
  size_t l2 = 0;
  double peak_gbps = 0;
#ifndef KVXFER_GPU_EMULATION
  cudaDeviceProp prop{};
  if (!cuda_ok(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties")) return 2;
  int mem_khz = 0;
  if (cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess) mem_khz = 0;
  // DDR: two transfers per clock over memoryBusWidth bits.
  peak_gbps = 2.0 * mem_khz * 1e3 * (prop.memoryBusWidth / 8.0) / 1e9;
  l2 = static_cast<size_t>(prop.l2CacheSize);
  std::printf(
      "# GPU %d: %s | sm_%d%d | %d SMs | %.1f GiB | L2 %.0f MiB | memory %d-bit at %d MHz "
      "= %.0f GB/s peak (2 x clock x width)\n",
      dev, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
      static_cast<double>(prop.totalGlobalMem) / (1 << 30), static_cast<double>(l2) / (1 << 20),
      prop.memoryBusWidth, mem_khz / 1000, peak_gbps);
  jgpu = {{"device", dev},
          {"name", prop.name},
          {"sm", prop.major * 10 + prop.minor},
          {"multiprocessors", prop.multiProcessorCount},
          {"total_bytes", prop.totalGlobalMem},
          {"l2_bytes", prop.l2CacheSize},
          {"memory_bus_bits", prop.memoryBusWidth},
          {"memory_clock_khz", mem_khz},
          {"peak_gbps", peak_gbps}};
#else
  std::printf(
      "# GPU %d: CPU emulation of the kernels (support/cuda_emu/): checks the bytes, "
      "times are not GPU figures\n",
      dev);
  jgpu = {{"device", dev}, {"name", "emulation"}};
#endif
  kc::Impl ref = kc::Impl::REFERENCE;
  if (o.gpu_ref == "fast" && kc::resolve_impl(kc::Impl::AUTO, &ref) < 0) {
    report_failure("resolve_impl", KVXFER_ERR_INTERNAL);
    return 2;
  }

  // Data: layer 0's K of the synthetic Llama-3-8B-like KV (make_synth), T tokens.
  Dataset ds;
  if (!make_synth(o, o.tokens, &ds, /*k_only=*/true)) return 2;
  std::printf("# Dataset synth: %s\n", ds.description.c_str());
  std::printf("# Check: GPU payloads and decoded pages against the CPU %s path, byte for byte%s\n",
              impl_name(ref), o.common.check ? "" : " (off: -c 0)");
  std::printf("#\n");

  cudaStream_t stream = nullptr;
  if (!cuda_ok(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, 0),
               "cudaStreamCreateWithPriority"))
    return 2;
  std::unique_ptr<std::remove_pointer_t<cudaStream_t>, void (*)(cudaStream_t)> stream_guard(
      stream, [](cudaStream_t st) { cudaStreamDestroy(st); });
  GpuTimer timer;
  if (!timer.init(stream, l2)) return 2;

  kp::Table table({{"codec", 5},
                   {"params", 9},
                   {"tokens", 6},
                   {"H", 5},
                   {"dtype", 5},
                   {"meta", 4},
                   {"op", 10},
                   {"read(B)", 10},
                   {"written(B)", 10},
                   {"time(us)", 8},
                   {"rw_GB/s", 7},
                   {"memcpy_GB/s", 7},
                   {"rw/memcpy", 6},
                   {"#wrong", 6}});
  std::printf("%s\n", table.header().c_str());
  std::fflush(stdout);

  json jrows = json::array();
  uint64_t total_wrong = 0;
  std::map<std::string, std::pair<double, int>> sum;  // op -> (sum of rw/memcpy, rows)
  int met = 0, nrows = 0;
  bool ok = true;
  for (kvxfer_dtype_t dt : dtypes) {
    Pool hsrc(1, ds.T, ds.H, dt, 0x5eed0001), hdst(1, ds.T, ds.H, dt, 0x5eed0002);
    hsrc.fill(0, ds.pages[0].data);
    DevicePool dsrc, ddst;
    if (!dsrc.init(hsrc, stream) || !dsrc.upload(hsrc) || !ddst.init(hdst, stream)) {
      ok = false;
      break;
    }
    for (const CodecCase& cc : cases) {
      std::vector<GpuRow> rows;
      bool fp32 = false;
      if (!gpu_codec(o, cc, ref, hsrc, &hdst, dsrc, &ddst, &timer, stream, &fp32, &rows)) {
        ok = false;
        break;
      }
      for (GpuRow& r : rows) {
        r.memcpy_bytes = (r.read + r.written + 1) / 2;
        if (!gpu_memcpy(o, &timer, stream, r.memcpy_bytes, &r.mc)) {
          ok = false;
          break;
        }
        const double bw = kp::gbps(static_cast<double>(r.read + r.written), r.t.median_us);
        const double mbw = kp::gbps(2.0 * static_cast<double>(r.memcpy_bytes), r.mc.median_us);
        const double ratio = mbw > 0 ? bw / mbw : 0;
        std::printf("%s\n", table
                                .row({cc.name, cc.params, std::to_string(ds.T),
                                      std::to_string(ds.H), dtype_name(dt), fp32 ? "fp32" : "fp16",
                                      r.op, std::to_string(r.read), std::to_string(r.written),
                                      kp::strprintf("%.1f", r.t.median_us), fmt2(bw), fmt2(mbw),
                                      fmt4(ratio), r.wrong < 0 ? "N/A" : std::to_string(r.wrong)})
                                .c_str());
        std::fflush(stdout);
        if (r.wrong > 0) total_wrong += static_cast<uint64_t>(r.wrong);
        sum[r.op].first += ratio;
        sum[r.op].second += 1;
        met += ratio >= kHbmTarget;
        ++nrows;
        json params = {{"alpha", cc.cfg.alpha},
                       {"chunk_tokens", cc.cfg.chunk_tokens},
                       {"anchor_bits", cc.cfg.anchor_bits}};
        jrows.push_back({{"codec", cc.name},
                         {"params", cc.params},
                         {"config", params},
                         {"dtype", dtype_name(dt)},
                         {"tokens", ds.T},
                         {"channels", ds.H},
                         {"meta_fp32", fp32},
                         {"op", r.op},
                         {"read_bytes", r.read},
                         {"written_bytes", r.written},
                         {"time", kp::to_json(r.t)},
                         {"rw_gbps", bw},
                         {"memcpy_bytes", r.memcpy_bytes},
                         {"memcpy", kp::to_json(r.mc)},
                         {"memcpy_gbps", mbw},
                         {"ratio", ratio},
                         {"peak_ratio", peak_gbps > 0 ? json(bw / peak_gbps) : json(nullptr)},
                         {"wrong", r.wrong < 0 ? json(nullptr) : json(r.wrong)}});
      }
      if (!ok) break;
    }
    if (!ok) break;
  }

  const bool exact = ok && total_wrong == 0;
  std::printf("# Wrong bytes : %" PRIu64 " %s\n", total_wrong,
              o.common.check == 0 ? "(not checked)"
              : total_wrong == 0  ? "OK"
                                  : "FAILED");
  std::printf("# Bit-exact   : %s\n",
              o.common.check == 0 ? "not checked (-c 0)"
              : !ok               ? "not established (a call failed)"
              : exact             ? "yes, every GPU payload and decoded page equals the CPU codec's"
                                  : "NO, the GPU differs from the CPU codec");
  json javg = json::object();
  for (const char* op : {"encode", "dec_anchor", "dec_full"}) {
    auto it = sum.find(op);
    if (it == sum.end()) continue;
    const double avg = it->second.first / it->second.second;
    javg[op] = avg;
    std::printf("# Avg rw/memcpy %-10s: %.3f  (mean over %d rows)\n", op, avg, it->second.second);
  }
  std::printf("# Rows at rw/memcpy >= %.2f (target): %d of %d\n", kHbmTarget, met, nrows);
  std::printf("#\n");
  std::fflush(stdout);

  if (!o.common.json_path.empty()) {
    json j = {{"tool", "codec_perf"},
              {"mode", "gpu"},
              {"kvxfer_version", KVXFER_VERSION_CODE},
              {"machine", kp::to_json(mach)},
              {"gpu", jgpu},
              {"settings", kp::to_json(settings)},
              {"options",
               {{"warmup_iters", o.common.warmup},
                {"iters", o.common.iters},
                {"check", o.common.check},
                {"check_path", impl_name(ref)},
                {"dtype", dts},
                {"codec", o.codecs},
                {"tokens", o.tokens},
                {"quick", o.common.quick},
                {"block_size", kBlockSize},
                {"time_statistic", "median"},
                {"timer", kGpuTimerName},
                {"l2_flush_bytes", 2 * l2}}},
              {"dataset", ds.info},
              {"rows", jrows},
              {"summary",
               {{"ok", exact},
                {"wrong_bytes", total_wrong},
                {"avg_ratio", javg},
                {"target_ratio", kHbmTarget},
                {"rows_at_target", met},
                {"rows", nrows}}}};
    if (kp::emit_json("codec_perf", o.common.json_path, j) != 0) return 2;
  }
  if (!ok) return 2;
  return total_wrong > 0 ? 1 : 0;
#endif
}

}  // namespace codec_perf
