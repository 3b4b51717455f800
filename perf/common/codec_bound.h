// The least a CPU page codec must do to memory, with no arithmetic: the
// `bound` row of codec_perf (docs/PERFORMANCE.md, "Bound").  Each function
// moves the bytes its operation has to move, in the order the codec's
// contract allows, on the same buffers, so that op / memcpy can be read
// against bound / memcpy measured in the same run.
//
// - encode: every source byte read once and the sections written (cached
//   stores, as the encoder writes them), then XXH3-64 of each section (the
//   checksum the encoder seals them with, docs/FORMAT.md).
// - decode: XXH3-64 of every section it is given first (kvxfer.h: both
//   checksums are verified before anything is written to the destination),
//   then the sections read again while every destination byte is written
//   with non-temporal stores, 64 bytes at a time where the CPU has AVX-512
//   (as the decoder writes pages of at least codec::fast::kStreamStoreBytes).
//
// Not thread-safe on the same buffers; no state.  x86-64 with AVX2 only
// (codec_perf's bound row exists where fast::cpu_has_avx2()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvxfer::perf {

/** A byte range: a section, or a block of a page. */
struct Span {
  uint8_t* p;
  size_t n;
};

/**
 * Reads every byte of `src` (blocks, any size) and writes every byte of
 * `sections`, 64 bytes out per 128 bytes in while both last, then XXH3-64
 * of each section.  Returns the hashes folded together (keeps the work
 * observable).
 */
uint64_t bound_encode(const std::vector<Span>& src, const std::vector<Span>& sections);

/**
 * XXH3-64 of each of `sections`, then every destination byte written with
 * non-temporal stores (dst blocks 64-byte aligned), each 64 bytes from the
 * next `in_per_out` (16, 32 or 64: a copy) section bytes, cycling through the
 * sections.  Returns the hashes folded together.
 */
uint64_t bound_decode(const std::vector<Span>& sections, const std::vector<Span>& dst,
                      int in_per_out);

}  // namespace kvxfer::perf
