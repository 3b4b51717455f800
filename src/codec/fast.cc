// Fast CPU page codec: chunks in parallel (OpenMP), rows through SIMD row
// kernels, table lookups instead of threshold searches.  Produces the same
// bytes as codec/reference.cc (tests/codec_test.cc checks it exhaustively).
// resolve_impl picks the path for this CPU.
#include "codec/fast.h"

#include <cpuid.h>
#include <emmintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "common/error.h"
#include "common/params.h"

namespace kvxfer::codec::fast {

bool minmax_channels_scalar(const uint8_t* const* rows, int n, kvxfer_dtype_t dt, int32_t from,
                            int32_t H, float* mn, float* mx) {
  bool ok = true;
  for (int32_t j = from; j < H; ++j) {
    float a = load_elem(rows[0], j, dt), b = a;
    for (int r = 0; r < n; ++r) {
      const float x = load_elem(rows[r], j, dt);
      ok &= !f32_nonfinite(x);
      if (x < a) a = x;
      if (x > b) b = x;
    }
    mn[j] = a;
    mx[j] = b;
  }
  return ok;
}

namespace {

bool chunk_minmax_scalar(const uint8_t* const* rows, int n, kvxfer_dtype_t dt, int32_t H, float* mn,
                         float* mx) {
  return minmax_channels_scalar(rows, n, dt, 0, H, mn, mx);
}

bool chunk_meta_scalar(float* mn, float* mx, int32_t H, bool fp32, float num, uint8_t* meta,
                       float* m, float* d, float* s) {
  bool ok = true;
  for (int32_t c = 0; c < H; ++c) {
    canonical_minmax(&mn[c], &mx[c]);
    Affine a{0.0f, 0.0f};
    ok &= chunk_affine(mn[c], mx[c], fp32, &a);
    put_affine(meta, c, fp32, a);
    m[c] = a.m;
    d[c] = a.d;
    s[c] = code_scale(a.d, num);
  }
  return ok;
}

void load_meta_scalar(const uint8_t* meta, int32_t H, bool fp32, float* m, float* d) {
  for (int32_t c = 0; c < H; ++c) {
    const Affine a = get_affine(meta, c, fp32);
    m[c] = a.m;
    d[c] = a.d;
  }
}

void encode_row_scalar(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                       const float* s, const Codebook& cb, uint8_t* codes) {
  const CodeSpec cs = cb.spec();
  for (int32_t c = 0; c < H; ++c) codes[c] = quantize(cs, load_elem(row, c, dt), m[c], s[c]);
}

void row_sq_errors_scalar(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const uint8_t* codes,
                          const float* m, const float* d, const uint8_t* ok, const float* full,
                          const float* anchor, unsigned R, double* acc_full, double* acc_anchor) {
  for (int32_t c = 0; c < H; ++c) {
    if (!ok[c]) continue;
    const Affine a{m[c], d[c]};
    const double x = load_elem(row, c, dt);
    const double ef = static_cast<double>(denormalise(full[codes[c]], a)) - x;
    const double ea = static_cast<double>(denormalise(anchor[codes[c] >> R], a)) - x;
    acc_full[c % 8] += ef * ef;
    acc_anchor[c % 8] += ea * ea;
  }
}

void decode_row_scalar(const uint8_t* idx, int32_t H, const float* m, const float* d,
                       const Values& v, kvxfer_dtype_t dt, uint8_t* row) {
  for (int32_t c = 0; c < H; ++c)
    store_elem(row, c, dt, denormalise(v.table[idx[c]], Affine{m[c], d[c]}));
}

// Sequential bit-field writer/reader over a byte-aligned region.
struct BitWriter {
  uint8_t* out;
  uint64_t acc = 0;
  unsigned n = 0;
  void put(unsigned v, unsigned w) {
    acc |= static_cast<uint64_t>(v) << n;
    n += w;
    while (n >= 8) {
      *out++ = static_cast<uint8_t>(acc);
      acc >>= 8;
      n -= 8;
    }
  }
  void flush() {
    if (n > 0) *out++ = static_cast<uint8_t>(acc);
  }
};
struct BitReader {
  const uint8_t* in;
  uint64_t acc = 0;
  unsigned n = 0;
  unsigned get(unsigned w) {
    while (n < w) {
      acc |= static_cast<uint64_t>(*in++) << n;
      n += 8;
    }
    const unsigned v = static_cast<unsigned>(acc & ((1u << w) - 1));
    acc >>= w;
    n -= w;
    return v;
  }
};

// The 4+4 nibble layout of docs/FORMAT.md 4.2 (even element in the low
// nibble), 16 elements at a time with SSE2 (baseline on x86-64), then pairs.
// Codes -> anchors (high nibbles) and residuals (low nibbles); H even.
void pack44_row(const uint8_t* codes, int32_t H, uint8_t* pa, uint8_t* pr) {
  int32_t c = 0;
  const __m128i lo8 = _mm_set1_epi16(0x00FF), hi4 = _mm_set1_epi16(0x00F0),
                lo4 = _mm_set1_epi16(0x000F);
  for (; c + 16 <= H; c += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c));
    const __m128i even = _mm_and_si128(v, lo8), odd = _mm_srli_epi16(v, 8);
    const __m128i a = _mm_or_si128(_mm_srli_epi16(even, 4), _mm_and_si128(odd, hi4));
    const __m128i r =
        _mm_or_si128(_mm_and_si128(even, lo4), _mm_slli_epi16(_mm_and_si128(odd, lo4), 4));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(pa + c / 2), _mm_packus_epi16(a, a));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(pr + c / 2), _mm_packus_epi16(r, r));
  }
  for (; c < H; c += 2) {
    pa[c / 2] = static_cast<uint8_t>((codes[c] >> 4) | (codes[c + 1] & 0xF0));
    pr[c / 2] = static_cast<uint8_t>((codes[c] & 0x0F) | (codes[c + 1] << 4));
  }
}

// INT4 (4 + 0): codes -> nibbles, even element low; H even.
void pack4_row(const uint8_t* codes, int32_t H, uint8_t* pa) {
  int32_t c = 0;
  const __m128i lo8 = _mm_set1_epi16(0x00FF);
  for (; c + 16 <= H; c += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c));
    const __m128i a = _mm_or_si128(_mm_and_si128(v, lo8), _mm_srli_epi16(v, 4));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(pa + c / 2),
                     _mm_packus_epi16(_mm_and_si128(a, lo8), _mm_and_si128(a, lo8)));
  }
  for (; c < H; c += 2) pa[c / 2] = static_cast<uint8_t>(codes[c] | (codes[c + 1] << 4));
}

// Anchors (+ residuals, or nullptr for anchor-only) -> table indices; H even.
void unpack44_row(const uint8_t* pa, const uint8_t* pr, int32_t H, uint8_t* idx) {
  int32_t c = 0;
  const __m128i lo4 = _mm_set1_epi16(0x000F), hi4 = _mm_set1_epi16(0x00F0);
  for (; c + 16 <= H; c += 16) {
    const __m128i a = _mm_unpacklo_epi8(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(pa + c / 2)), _mm_setzero_si128());
    __m128i even, odd;
    if (pr != nullptr) {
      const __m128i r = _mm_unpacklo_epi8(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(pr + c / 2)), _mm_setzero_si128());
      even = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(a, lo4), 4), _mm_and_si128(r, lo4));
      odd = _mm_or_si128(_mm_and_si128(a, hi4), _mm_srli_epi16(r, 4));
    } else {
      even = _mm_and_si128(a, lo4);
      odd = _mm_srli_epi16(a, 4);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(idx + c),
                     _mm_or_si128(even, _mm_slli_epi16(odd, 8)));
  }
  for (; c < H; c += 2) {
    const uint8_t a = pa[c / 2];
    if (pr != nullptr) {
      const uint8_t r = pr[c / 2];
      idx[c] = static_cast<uint8_t>((a << 4) | (r & 0x0F));
      idx[c + 1] = static_cast<uint8_t>((a & 0xF0) | (r >> 4));
    } else {
      idx[c] = a & 0x0F;
      idx[c + 1] = a >> 4;
    }
  }
}

void encode_params_scalar(const float* m, const float* s, int32_t H, kvxfer_dtype_t,
                          const Codebook&, float* pm, float* ps) {
  std::memcpy(pm, m, sizeof(float) * static_cast<size_t>(H));
  std::memcpy(ps, s, sizeof(float) * static_cast<size_t>(H));
}

void encode_row_nibbles_scalar(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                               const float* s, const Codebook& cb, uint8_t* pa, uint8_t* pr,
                               uint8_t* codes) {
  uint8_t buf[256];
  for (int32_t c0 = 0; c0 < H; c0 += 256) {
    const int32_t n = std::min<int32_t>(256, H - c0);
    uint8_t* q = codes != nullptr ? codes + c0 : buf;
    encode_row_scalar(row + c0 * dtype_size(dt), dt, n, m + c0, s + c0, cb, q);
    if (pr != nullptr)
      pack44_row(q, n, pa + c0 / 2, pr + c0 / 2);
    else
      pack4_row(q, n, pa + c0 / 2);
  }
}

// A thread's histogram of full codes (FORMAT 2.4): four interleaved 32-bit
// tables, so that runs of equal codes (common near zero) do not serialise on
// one counter's store-to-load forwarding, read eight codes per load.  Counts
// are integers: the sum does not depend on which table or thread counted.
struct CodeHistogram {
  uint32_t bins[4][256] = {};
  uint64_t pending = 0;  // codes in bins since the last flush
  uint64_t total[256] = {};

  /** Makes room for H more codes in bins (flushing first if needed). */
  void reserve(int32_t H) {
    if (pending + static_cast<uint64_t>(H) > UINT32_MAX) flush();
    pending += static_cast<uint64_t>(H);
  }
  void add_row(const uint8_t* codes, int32_t H) {
    reserve(H);
    int32_t c = 0;
    for (; c + 8 <= H; c += 8) {
      uint64_t v;
      std::memcpy(&v, codes + c, 8);
      count8(v, &bins[0][0]);
    }
    for (; c < H; ++c) ++bins[0][codes[c]];
  }
  void flush() {
    for (int c = 0; c < 256; ++c) {
      total[c] += uint64_t{bins[0][c]} + bins[1][c] + bins[2][c] + bins[3][c];
      bins[0][c] = bins[1][c] = bins[2][c] = bins[3][c] = 0;
    }
    pending = 0;
  }
};

// Asks for `bytes` at p to be brought into cache (for writing if `write`):
// the next chunk's rows while this one is coded, so that pass 1 of the next
// chunk finds them there.  A hint only: it changes no result.
inline void prefetch_bytes(const uint8_t* p, size_t bytes, bool write) {
  for (size_t o = 0; o < bytes; o += 64) {
    if (write)
      __builtin_prefetch(p + o, 1, 3);
    else
      __builtin_prefetch(p + o, 0, 2);  // to L2: a chunk ahead would not fit L1
  }
}

// Rows t0 .. t0 + n - 1 of a page: one division for the block of the first,
// then a walk (Layout::row divides for every row).
template <typename P>
void page_rows(const Layout& lay, int64_t t0, int n, P* out) {
  const kvxfer_page_layout_t& l = *lay.l;
  const int64_t u = l.first_token + t0;
  int64_t b = u / l.block_size, o = u % l.block_size;
  const int64_t stride = l.row_stride * static_cast<int64_t>(lay.elem);
  for (int r = 0; r < n; ++r) {
    out[r] = static_cast<uint8_t*>(l.blocks[b]) + o * stride;
    if (++o == l.block_size) {
      o = 0;
      ++b;
    }
  }
}

int thread_count(int requested, int64_t chunks, int64_t elems) {
  if (elems < (1 << 16) || chunks < 2) return 1;  // not worth waking threads
  const int t = requested > 0 ? requested : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t, chunks)));
}

}  // namespace

const RowKernels& scalar_kernels() {
  static const RowKernels k{chunk_minmax_scalar,
                            chunk_meta_scalar,
                            load_meta_scalar,
                            encode_row_scalar,
                            encode_params_scalar,
                            encode_row_nibbles_scalar,
                            row_sq_errors_scalar,
                            decode_row_scalar,
                            nullptr,
                            nullptr,
                            nullptr};
  return k;
}

const RowKernels& kernels_for(Impl impl) {
  if (impl == Impl::AVX512) return avx512_kernels();
  if (impl == Impl::AVX2) return avx2_kernels();
  return scalar_kernels();
}

bool cpu_has_avx2() {
  // F16C through CPUID: clang 14's __builtin_cpu_supports does not know "f16c".
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool f16c_fma =
        __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0 && (c & bit_FMA) != 0;
    return f16c_fma && __builtin_cpu_supports("avx2");
  }();
  return has;
}

bool cpu_has_avx512() {
  static const bool has = cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

void stream_fence() { _mm_sfence(); }

bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}

EncodeStatus encode(const EncodeJob& job, Impl impl, int threads) {
  const RowKernels& K = kernels_for(impl);
  const PageHeader& h = *job.hdr;
  const int64_t T = static_cast<int64_t>(h.num_tokens);
  const int32_t H = static_cast<int32_t>(h.num_channels);
  const int C = h.chunk_tokens;
  const unsigned A = job.cb->anchor_bits, R = job.cb->residual_bits;
  const auto dt = static_cast<kvxfer_dtype_t>(h.src_dtype);
  const int64_t chunks = (T + C - 1) / C;
  std::atomic<bool> nonfinite{false}, need_fp32{false};
  std::mutex hist_mu;
  const bool count_hist = has_anchor_table(*job.cb);  // only the anchor table reads it

#pragma omp parallel num_threads(thread_count(threads, chunks, T* H))
  {
    std::vector<float> mn(H), mx(H), m(H), d(H), sc(H), pm(H), ps(H), lo, hi;
    std::vector<uint8_t> clamped(static_cast<size_t>(H) * job.src.elem);
    // Two code buffers: with encode_row_nibbles_ahead a counted row's codes
    // are counted during the next row's call (its `count`), so a counted row
    // writes the one not waiting to be counted.
    std::vector<uint8_t> codes(H), codes2(H);
    // This chunk's rows and the next one's (prefetched during this one's pass 2).
    std::vector<const uint8_t*> rows(static_cast<size_t>(C)), next_rows(static_cast<size_t>(C));
    CodeHistogram hist;
#pragma omp for schedule(static) nowait
    for (int64_t k = 0; k < chunks; ++k) {
      if (nonfinite.load(std::memory_order_relaxed) || need_fp32.load(std::memory_order_relaxed))
        continue;
      const int64_t t0 = k * C, t1 = std::min<int64_t>(T, t0 + C);
      const int n = static_cast<int>(t1 - t0);
      page_rows(job.src, t0, n, rows.data());
      const int n_next = static_cast<int>(std::min<int64_t>(T, t1 + C) - t1);
      page_rows(job.src, t1, n_next, next_rows.data());
      // Pass 1 (while the chunk is in cache): min/max and the non-finite scan,
      // then the range over the rows from r0 (the sink rows left out,
      // docs/FORMAT.md 2.7).
      if (!K.chunk_minmax(rows.data(), n, dt, H, mn.data(), mx.data())) {
        nonfinite = true;
        continue;
      }
      const int64_t r0 = range_row0(t0, t1, static_cast<int64_t>(h.sink_rows));
      if (r0 > t0) {
        K.chunk_minmax(rows.data() + (r0 - t0), static_cast<int>(t1 - r0), dt, H, mn.data(),
                       mx.data());
        lo.assign(mn.begin(), mn.end());  // before chunk_meta: it may canonicalise in place
        hi.assign(mx.begin(), mx.end());
      }
      const size_t entry = job.meta_fp32 ? 8 : 4;
      if (!K.chunk_meta(mn.data(), mx.data(), H, job.meta_fp32, job.cb->scale_num,
                        job.meta + static_cast<size_t>(k) * H * entry, m.data(), d.data(),
                        sc.data()))
        need_fp32 = true;
      if (need_fp32.load(std::memory_order_relaxed)) continue;
      // Pass 2: codes, the sampled histogram, the split and the packing.
      // Chunk k starts at element t0*H; t0 is a multiple of 16, so both bit
      // streams start on a byte boundary here.
      BitWriter wa{job.anchors + (static_cast<uint64_t>(t0) * H * A) / 8};
      BitWriter wr{job.residuals + (static_cast<uint64_t>(t0) * H * R) / 8};
      const bool nibbles = A == 4 && (R == 4 || R == 0) && (H & 1) == 0;
      if (nibbles) K.encode_params(m.data(), sc.data(), H, dt, *job.cb, pm.data(), ps.data());
      const size_t row_bytes = static_cast<size_t>(H) * job.src.elem;
      const bool ahead = nibbles && K.encode_row_nibbles_ahead != nullptr;
      const uint8_t* to_count = nullptr;  // a counted row's codes, for the next row's call
      for (int64_t t = t0; t < t1; ++t) {
        const uint8_t* next = t - t0 < n_next ? next_rows[t - t0] : nullptr;
        if (next != nullptr && !ahead) prefetch_bytes(next, row_bytes, false);
        const bool counted = count_hist && hist_row(t, h.sink_rows);
        const uint8_t* row = rows[t - t0];
        if (t < r0) {  // a sink row: its values clamped to the chunk's range
          for (int32_t c = 0; c < H; ++c)
            store_elem(
                clamped.data(), c, dt,
                clamp_to_range(load_elem(row, c, dt), f_add(lo[c], 0.0f), f_add(hi[c], 0.0f)));
          row = clamped.data();
        }
        if (nibbles) {
          const uint64_t off = (static_cast<uint64_t>(t - t0) * H) / 2;
          // The output of rows a few ahead, for writing: the stores then
          // find their lines instead of waiting for them.
          prefetch_bytes(wa.out + off + 4 * static_cast<uint64_t>(H) / 2, H / 2, true);
          if (R > 0) prefetch_bytes(wr.out + off + 4 * static_cast<uint64_t>(H) / 2, H / 2, true);
          if (ahead) {
            // The last counted row's codes are counted inside this call,
            // between its vectors: counted after their own row, alone, they
            // cost INT8's encode about 7% (perf, codec_perf --dataset synth
            // -t 1, an Intel Xeon with AVX-512), as much as its kernel saves
            // on Lynx's.
            uint8_t* out = to_count == codes.data() ? codes2.data() : codes.data();
            if (to_count != nullptr) hist.reserve(H);
            K.encode_row_nibbles_ahead(row, dt, H, pm.data(), ps.data(), *job.cb, wa.out + off,
                                       R > 0 ? wr.out + off : nullptr, counted ? out : nullptr,
                                       next, to_count, &hist.bins[0][0]);
            to_count = counted ? out : nullptr;
            continue;
          } else
            K.encode_row_nibbles(row, dt, H, pm.data(), ps.data(), *job.cb, wa.out + off,
                                 R > 0 ? wr.out + off : nullptr, counted ? codes.data() : nullptr);
        } else {
          K.encode_row(row, dt, H, m.data(), sc.data(), *job.cb, codes.data());
          for (int32_t c = 0; c < H; ++c) {
            wa.put(codes[c] >> R, A);
            if (R > 0) wr.put(codes[c] & ((1u << R) - 1), R);
          }
        }
        if (counted) hist.add_row(codes.data(), H);
      }
      if (to_count != nullptr) hist.add_row(to_count, H);  // the chunk's last row was counted
      if (nibbles) continue;  // no bit writer state: every row ended on a byte
      wa.flush();
      if (R > 0) wr.flush();
    }
    // Integer counts: the merged histogram does not depend on thread order.
    if (count_hist) {
      hist.flush();
      std::lock_guard<std::mutex> lk(hist_mu);
      for (int c = 0; c < 256; ++c) job.hist[c] += hist.total[c];
    }
  }
  if (nonfinite) return EncodeStatus::NONFINITE;
  if (need_fp32) return EncodeStatus::NEED_FP32;
  return EncodeStatus::OK;
}

namespace {

// Whether a chunk with binary16 metadata may decode beyond +-65504 (an FP16
// row then clamps, f32_to_f16_sat): |x| <= |m| + |d| (every z value is in
// [-1, 1]), and both below 16384 keep it below 32768.  Conservative: a
// clamp where none is needed changes no value.
bool f16_chunk_may_saturate(const uint8_t* meta, int32_t H) {
  uint16_t top = 0;
  for (int32_t i = 0; i < 2 * H; ++i) {
    uint16_t h;
    std::memcpy(&h, meta + 2 * i, 2);
    top = std::max<uint16_t>(top, h & 0x7FFFu);
  }
  return top >= 0x7400u;  // 16384
}

}  // namespace

void decode(const DecodeJob& job, Impl impl, int threads) {
  const RowKernels& K = kernels_for(impl);
  const PageHeader& h = *job.hdr;
  const int64_t T = static_cast<int64_t>(h.num_tokens);
  const int32_t H = static_cast<int32_t>(h.num_channels);
  const int C = h.chunk_tokens;
  const unsigned A = job.cb->anchor_bits, R = job.cb->residual_bits;
  const bool full = job.residuals != nullptr;
  Values v;
  v.table = full ? job.cb->recon_full : job.anchor_table;
  v.entries = 1 << (full ? job.cb->code_bits : static_cast<int>(A));
  v.linear_kind = full ? job.cb->kind : CODE_LUT;  // recon_full of a linear codebook is its formula
  v.step = job.cb->recon_step;
  v.clamp = job.meta_fp32;  // binary16 metadata: |m| + d <= 2 * 65504, nothing to clamp
  v.stream =
      static_cast<uint64_t>(T) * static_cast<uint64_t>(H) * job.dst.elem >= kStreamStoreBytes;
  v.tiny = false;
  for (int i = 0; i < v.entries; ++i) {
    const float a = f32_abs(v.table[i]);
    v.tiny |= a > 0.0f && a < 0x1p-79f;
  }
  const int64_t chunks = (T + C - 1) / C;

#pragma omp parallel num_threads(thread_count(threads, chunks, T* H))
  {
    std::vector<float> m(H), d(H);
    std::vector<uint8_t> idx(H);
    std::vector<uint8_t*> out(static_cast<size_t>(C));
    const bool nibbles = A == 4 && (H & 1) == 0 && (!full || R == 4 || R == 0);
    // 4-bit fields straight to values where the kernels can (no index array).
    const bool fused = nibbles && K.decode_row_nibbles != nullptr;
#pragma omp for schedule(static)
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t t0 = k * C, t1 = std::min<int64_t>(T, t0 + C);
      const uint8_t* meta = job.meta + static_cast<size_t>(k) * H * (job.meta_fp32 ? 8 : 4);
      Values vc = v;
      if (!vc.clamp && job.dst.l->dtype == KVXFER_DTYPE_FP16)
        vc.clamp = f16_chunk_may_saturate(meta, H);
      if (fused)
        K.decode_params(meta, H, job.meta_fp32, vc, full, m.data(), d.data());
      else
        K.load_meta(meta, H, job.meta_fp32, m.data(), d.data());
      BitReader ra{job.anchors + (static_cast<uint64_t>(t0) * H * A) / 8};
      BitReader rr{full ? job.residuals + (static_cast<uint64_t>(t0) * H * R) / 8 : nullptr};
      page_rows(job.dst, t0, static_cast<int>(t1 - t0), out.data());
      for (int64_t t = t0; t < t1; ++t) {
        if (nibbles) {
          const uint8_t* pa = ra.in + (static_cast<uint64_t>(t - t0) * H) / 2;
          const uint8_t* pr =
              full && R > 0 ? rr.in + (static_cast<uint64_t>(t - t0) * H) / 2 : nullptr;
          if (fused) {
            K.decode_row_nibbles(pa, pr, H, m.data(), d.data(), vc, job.dst.l->dtype, out[t - t0]);
            continue;
          }
          unpack44_row(pa, pr, H, idx.data());
        } else {
          for (int32_t c = 0; c < H; ++c) {
            const unsigned a = ra.get(A);
            idx[c] = static_cast<uint8_t>(full ? (a << R) | (R > 0 ? rr.get(R) : 0u) : a);
          }
        }
        K.decode_row(idx.data(), H, m.data(), d.data(), vc, job.dst.l->dtype, out[t - t0]);
      }
    }
    // Non-temporal stores are weakly ordered: drained before the values are
    // seen as written (by this thread's caller or after the barrier).
    if (fused && v.stream) _mm_sfence();
  }
}

}  // namespace kvxfer::codec::fast

namespace kvxfer::codec {

kvxfer_result_t resolve_impl(Impl requested, Impl* out) {
  Impl impl = requested;
  if (impl == Impl::AUTO) {
    switch (params::CodecImpl()) {
      case params::CodecPath::kAuto: impl = Impl::AUTO; break;
      case params::CodecPath::kAvx2: impl = Impl::AVX2; break;
      case params::CodecPath::kAvx512: impl = Impl::AVX512; break;
      case params::CodecPath::kScalar: impl = Impl::SCALAR; break;
      case params::CodecPath::kReference: impl = Impl::REFERENCE; break;
    }
    if (impl == Impl::AUTO)
      impl = fast::cpu_has_avx512() ? Impl::AVX512
             : fast::cpu_has_avx2() ? Impl::AVX2
                                    : Impl::SCALAR;
  }
  if (impl == Impl::AVX2 && !fast::cpu_has_avx2())
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "the AVX2 codec path was requested but this CPU "
                     "lacks AVX2/F16C");
  if (impl == Impl::AVX512 && !fast::cpu_has_avx512())
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "the AVX-512 codec path was requested but this CPU "
                     "lacks AVX-512 F/BW/VL/DQ");
  *out = impl;
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::codec
