#include "perf/common/codec_bound.h"

#include <immintrin.h>
#include <xxh_x86dispatch.h>
#include <xxhash.h>

#include <cstring>

namespace kvxfer::perf {

namespace {

uint64_t hash_all(const std::vector<Span>& sections) {
  uint64_t h = 0;
  for (const Span& s : sections) h ^= XXH3_64bits(s.p, s.n);
  return h;
}

}  // namespace

__attribute__((target("avx2"))) uint64_t bound_encode(const std::vector<Span>& src,
                                                      const std::vector<Span>& sections) {
  size_t si = 0, so = 0;  // where the next 64 bytes go
  __m256i acc = _mm256_setzero_si256();
  uint8_t tail = 0;
  for (const Span& b : src) {
    size_t i = 0;
    for (; i + 128 <= b.n; i += 128) {
      const __m256i x0 =
          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<__m256i*>(b.p + i)),
                           _mm256_loadu_si256(reinterpret_cast<__m256i*>(b.p + i + 32)));
      const __m256i x1 =
          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<__m256i*>(b.p + i + 64)),
                           _mm256_loadu_si256(reinterpret_cast<__m256i*>(b.p + i + 96)));
      while (si < sections.size() && so == sections[si].n) {
        ++si;
        so = 0;
      }
      if (si == sections.size()) {  // every section written: the rest is only read
        acc = _mm256_xor_si256(acc, _mm256_xor_si256(x0, x1));
        continue;
      }
      const Span& s = sections[si];
      if (so + 64 <= s.n) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.p + so), x0);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.p + so + 32), x1);
        so += 64;
      } else {
        alignas(32) uint8_t buf[64];
        _mm256_store_si256(reinterpret_cast<__m256i*>(buf), x0);
        _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 32), x1);
        std::memcpy(s.p + so, buf, s.n - so);
        so = s.n;
      }
    }
    for (; i < b.n; ++i) tail ^= b.p[i];
  }
  for (; si < sections.size(); ++si, so = 0)  // more section bytes than half the source
    std::memset(sections[si].p + so, tail, sections[si].n - so);
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  return hash_all(sections) ^ lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3] ^ tail;
}

namespace {

// The next `step` bytes of the sections, cycling through them (each holds at
// least one step).
struct SectionCursor {
  const std::vector<Span>& in;
  size_t step, si = 0, so = 0;
  const uint8_t* next() {
    if (so + step > in[si].n) {
      si = (si + 1) % in.size();
      so = 0;
    }
    const uint8_t* p = in[si].p + so;
    so += step;
    return p;
  }
};

// 64-byte non-temporal stores where the CPU has AVX-512 (as the decoder's).
__attribute__((target("avx512f,avx512bw"))) void expand_avx512(SectionCursor* cur,
                                                               const std::vector<Span>& dst) {
  for (const Span& d : dst) {
    size_t o = 0;
    for (; o + 64 <= d.n; o += 64) {
      const uint8_t* p = cur->next();
      __m512i v;
      if (cur->step == 64)  // a copy
        v = _mm512_loadu_si512(p);
      else if (cur->step == 32)
        v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      else
        v = _mm512_cvtepu8_epi16(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d.p + o), v);
    }
    if (o < d.n) std::memset(d.p + o, 0, d.n - o);
  }
  _mm_sfence();
}

// The same with two 32-byte stores (AVX2).
__attribute__((target("avx2"))) void expand_avx2(SectionCursor* cur, const std::vector<Span>& dst) {
  for (const Span& d : dst) {
    size_t o = 0;
    for (; o + 64 <= d.n; o += 64) {
      const uint8_t* p = cur->next();
      __m256i lo, hi;
      if (cur->step == 64) {
        lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      } else {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m128i b = cur->step == 32
                              ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))
                              : _mm_srli_si128(a, 8);
        lo = _mm256_cvtepu8_epi16(a);
        hi = _mm256_cvtepu8_epi16(b);
      }
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d.p + o), lo);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d.p + o + 32), hi);
    }
    if (o < d.n) std::memset(d.p + o, 0, d.n - o);
  }
  _mm_sfence();
}

}  // namespace

uint64_t bound_decode(const std::vector<Span>& sections, const std::vector<Span>& dst,
                      int in_per_out) {
  const uint64_t h = hash_all(sections);
  const size_t step = in_per_out == 16 ? 16 : in_per_out == 32 ? 32 : 64;
  std::vector<Span> in;  // the sections a step fits in
  for (const Span& s : sections)
    if (s.n >= step) in.push_back(s);
  if (in.empty()) return h;
  SectionCursor cur{in, step};
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
    expand_avx512(&cur, dst);
  else
    expand_avx2(&cur, dst);
  return h;
}

}  // namespace kvxfer::perf
