// Framing of one page_decode_fuzz input, shared by the fuzz target, the seed
// generator (fuzz/make_seeds.cc) and the regression replay in
// tests/format_test.cc:
//
//   byte 0        mode (see FuzzMode)
//   bytes 1..4    anchor length n, uint32 little-endian (clamped to what is left)
//   next n bytes  anchor section
//   the rest      residual section (none if empty)
//
// Header-only, no dependency beyond the C++ standard library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvxfer::fuzz {

/** Bits of the mode byte. */
enum FuzzMode : uint8_t {
  MODE_DTYPE_MASK = 0x03,       // destination dtype: 0 BF16, 1 FP16, 2/3 FP32
  MODE_RESEAL_ANCHOR = 0x04,    // recompute the anchor's checksum before decoding
  MODE_RESEAL_RESIDUAL = 0x08,  // set the residual's link to the anchor's checksum, reseal it
  MODE_EXPECT = 0x10,           // pass the anchor's own page id as `expect`
  MODE_SMALL_BLOCKS = 0x20,     // destination blocks of 3 tokens (else 16), first_token 2
  MODE_THREADS = 0x40,          // decode with 2 threads (else 1)
  MODE_RESERVED = 0x80,
};

struct FuzzInput {
  uint8_t mode = 0;
  std::vector<uint8_t> anchor;
  std::vector<uint8_t> residual;
  bool has_residual = false;
};

/** Splits `data` as described above.  Never fails: short inputs give empty parts. */
inline FuzzInput split_fuzz_input(const uint8_t* data, size_t size) {
  FuzzInput in;
  if (size == 0) return in;
  in.mode = data[0];
  ++data;
  --size;
  uint32_t n = 0;
  for (int i = 0; i < 4 && size > 0; ++i, ++data, --size)
    n |= static_cast<uint32_t>(*data) << (8 * i);
  const size_t alen = n < size ? n : size;
  in.anchor.assign(data, data + alen);
  in.residual.assign(data + alen, data + size);
  in.has_residual = size > alen;
  return in;
}

/** The inverse of split_fuzz_input. */
inline std::vector<uint8_t> join_fuzz_input(uint8_t mode, const std::vector<uint8_t>& anchor,
                                            const std::vector<uint8_t>& residual) {
  std::vector<uint8_t> out;
  out.push_back(mode);
  const uint32_t n = static_cast<uint32_t>(anchor.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(n >> (8 * i)));
  out.insert(out.end(), anchor.begin(), anchor.end());
  out.insert(out.end(), residual.begin(), residual.end());
  return out;
}

}  // namespace kvxfer::fuzz
