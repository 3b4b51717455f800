// The body of the page_decode_fuzz target, header-only so that
// tests/format_test.cc replays the committed corpus through exactly the same
// code (without sanitizers) as the fuzzer runs (with them).
//
// For one framed input (fuzz/fuzz_input.h) it
//   - optionally reseals the sections, so mutations get past the checksum and
//     reach the metadata validation and the decoders;
//   - inspects both sections;
//   - decodes anchor-only, then anchor + residual, with every CPU path
//     (reference, scalar, AVX2 when the CPU has it), into a paged destination
//     sized from the anchor header (about T*H <= 1 << 20, else a 1 x 1
//     destination that must be refused with MISMATCH);
// and checks the properties the API promises:
//   - the result is a known kvxfer_result_t; an error leaves a message;
//   - inspect and decode agree on whether the anchor section is valid;
//   - every path returns the same result and, on success, the same bytes;
//   - a failed decode leaves the destination unchanged (every byte of every
//     block); a successful one writes only the page's rows;
//   - SpectrumKV pages (docs/FORMAT.md section 6): the precision map can be
//     read (get_page_tiers) whenever inspect accepts the anchor; DROP tokens
//     decode to +0 at both precisions; INT4 tokens, and every token of a raw
//     page, are complete in the anchor (full == anchor-only); an FP16 token's
//     anchor-only value is fp16_anchor_value of the high byte of its full
//     value (checked where the destination holds binary16 exactly: fp16, fp32).
// A violated property is returned as text; memory errors and UB are the
// sanitizers' business.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "codec/format.h"
#include "codec/page.h"
#include "codec/tiered_format.h"
#include "common/error.h"
#include "fuzz_input.h"

namespace kvxfer::fuzz {

constexpr uint64_t kMaxDstElements = 1u << 20;

/** A heap buffer of exactly `n` bytes (so ASan sees any access past the end). */
struct ExactBuf {
  std::unique_ptr<uint8_t[]> p;
  size_t n = 0;
  explicit ExactBuf(const std::vector<uint8_t>& v)
      : p(new uint8_t[v.size() ? v.size() : 1]), n(v.size()) {
    if (n) std::memcpy(p.get(), v.data(), n);
  }
  uint8_t* data() { return p.get(); }
};

/** A destination page in separately allocated blocks with padding between rows. */
struct FuzzDst {
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<void*> ptrs;
  kvxfer_page_layout_t layout{};

  FuzzDst(int64_t T, int32_t H, kvxfer_dtype_t dt, int32_t block_size, int64_t first_token) {
    layout.dtype = dt;
    layout.num_tokens = T;
    layout.num_channels = H;
    layout.block_size = block_size;
    layout.row_stride = H + 1;
    layout.first_token = first_token;
    // An empty page needs no block at all (the layout is not dereferenced).
    const int64_t nb = T == 0 ? 0 : (first_token + T + block_size - 1) / block_size;
    const size_t bytes =
        static_cast<size_t>(block_size) * layout.row_stride * codec::dtype_size(dt);
    for (int64_t b = 0; b < nb; ++b) {
      blocks.emplace_back(bytes);
      for (size_t i = 0; i < bytes; ++i)
        blocks.back()[i] = static_cast<uint8_t>(0xA5 ^ (i * 7) ^ b);
    }
    for (auto& b : blocks) ptrs.push_back(b.data());
    layout.blocks = ptrs.data();
    layout.num_blocks = static_cast<int64_t>(blocks.size());
  }
  FuzzDst(const FuzzDst& o) : blocks(o.blocks), layout(o.layout) {
    for (auto& b : blocks) ptrs.push_back(b.data());
    layout.blocks = ptrs.data();
  }
  FuzzDst& operator=(const FuzzDst&) = delete;

  /** Row of page token t (0 <= t < num_tokens). */
  const uint8_t* row(int64_t t) const {
    const int64_t u = layout.first_token + t;
    const size_t es = codec::dtype_size(layout.dtype);
    return blocks[static_cast<size_t>(u / layout.block_size)].data() +
           static_cast<size_t>(u % layout.block_size) * layout.row_stride * es;
  }

  /** True if byte `i` of block `b` belongs to a row of the page. */
  bool in_page(size_t b, size_t i) const {
    const size_t es = codec::dtype_size(layout.dtype);
    const size_t row_bytes = static_cast<size_t>(layout.row_stride) * es;
    const int64_t u =
        static_cast<int64_t>(b) * layout.block_size + static_cast<int64_t>(i / row_bytes);
    const int64_t t = u - layout.first_token;
    return t >= 0 && t < layout.num_tokens && (i % row_bytes) < layout.num_channels * es;
  }
};

inline bool known_result(kvxfer_result_t r) {
  return r == KVXFER_SUCCESS || (r <= KVXFER_ERR_INVALID_ARGUMENT && r >= KVXFER_RESULT_MIN);
}

/** Compares two destinations; `only_outside_page` ignores the page's rows. */
inline std::string diff_dst(const FuzzDst& a, const FuzzDst& b, bool only_outside_page) {
  for (size_t k = 0; k < a.blocks.size(); ++k) {
    if (a.blocks[k] == b.blocks[k]) continue;
    for (size_t i = 0; i < a.blocks[k].size(); ++i)
      if (a.blocks[k][i] != b.blocks[k][i] && !(only_outside_page && a.in_page(k, i))) {
        char buf[128];
        std::snprintf(buf, sizeof(buf), "block %zu byte %zu: 0x%02x vs 0x%02x%s", k, i,
                      a.blocks[k][i], b.blocks[k][i],
                      a.in_page(k, i) ? " (page row)" : " (outside the page)");
        return buf;
      }
  }
  return "";
}

inline uint64_t rd64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

/** Reseals a section in place if its header's payload_bytes fits in `len`. */
inline void maybe_reseal(uint8_t* s, size_t len) {
  if (len < codec::kHeaderBytes) return;
  const uint64_t payload = rd64(s + 56);
  if (payload <= len - codec::kHeaderBytes) codec::seal_section(s);
}

/**
 * Decodes (anchor, residual-or-null) into a copy of `before` with every
 * path.  On agreement returns "" and stores the result and the decoded
 * destination; otherwise describes the violation.
 */
inline std::string decode_all_paths(const uint8_t* anc, size_t alen, const uint8_t* res,
                                    size_t rlen, const kvxfer_page_id_t* expect,
                                    const FuzzDst& before, int threads, kvxfer_result_t* rc_out,
                                    std::unique_ptr<FuzzDst>* after_out, const char* what) {
  std::vector<codec::Impl> impls{codec::Impl::REFERENCE, codec::Impl::SCALAR};
  if (codec::fast::cpu_has_avx2()) impls.push_back(codec::Impl::AVX2);
  std::unique_ptr<FuzzDst> first;
  kvxfer_result_t first_rc = KVXFER_SUCCESS;
  for (size_t k = 0; k < impls.size(); ++k) {
    auto dst = std::make_unique<FuzzDst>(before);
    clear_error();
    const kvxfer_result_t rc =
        codec::decode_page(anc, alen, res, rlen, expect, &dst->layout, impls[k], threads);
    const std::string where = std::string(what) + " decode, path " + std::to_string(k);
    if (!known_result(rc)) return where + ": unknown result " + std::to_string(rc);
    if (rc != KVXFER_SUCCESS) {
      if (last_error()[0] == '\0')
        return where + ": error " + std::to_string(rc) + " without a message";
      const std::string d = diff_dst(*dst, before, false);
      if (!d.empty())
        return where + ": failed with " + std::to_string(rc) + " but wrote the destination: " + d;
    } else {
      const std::string d = diff_dst(*dst, before, true);
      if (!d.empty()) return where + ": wrote outside the page: " + d;
    }
    if (k == 0) {
      first_rc = rc;
      first = std::move(dst);
      continue;
    }
    if (rc != first_rc)
      return where + ": result " + std::to_string(rc) + " differs from the reference's " +
             std::to_string(first_rc);
    const std::string d = diff_dst(*dst, *first, false);
    if (!d.empty()) return where + ": bytes differ from the reference: " + d;
  }
  *rc_out = first_rc;
  *after_out = std::move(first);
  return "";
}

/**
 * The SpectrumKV properties of a decoded page (docs/FORMAT.md 6.1, 6.2):
 * `anc` is an anchor section that decoded into `a` (anchor only) and, if
 * `f` is not null, into `f` (anchor + residual).  Returns "" or the violation.
 */
inline std::string check_spectrum(const uint8_t* anc, size_t alen, const FuzzDst& a,
                                  const FuzzDst* f, bool raw) {
  const int64_t T = a.layout.num_tokens;
  const int32_t H = a.layout.num_channels;
  const kvxfer_dtype_t dt = a.layout.dtype;
  const size_t row_bytes = static_cast<size_t>(H) * codec::dtype_size(dt);
  std::vector<uint8_t> tiers(static_cast<size_t>(T) + 1);
  clear_error();
  if (codec::get_page_tiers(anc, alen, tiers.data(), T) != KVXFER_SUCCESS)
    return std::string("get_page_tiers failed on a decodable SpectrumKV anchor: ") + last_error();
  for (int64_t t = 0; t < T; ++t) {
    auto at = [&] {
      return "SpectrumKV token " + std::to_string(t) + " (tier " +
             std::to_string(tiers[static_cast<size_t>(t)]) + ")";
    };
    const uint8_t* ra = a.row(t);
    const uint8_t* rf = f != nullptr ? f->row(t) : nullptr;
    switch (tiers[static_cast<size_t>(t)]) {
      case KVXFER_TIER_DROP:
        for (size_t i = 0; i < row_bytes; ++i)
          if (ra[i] != 0 || (rf != nullptr && rf[i] != 0))
            return at() + ": a DROP token does not decode to +0";
        break;
      case KVXFER_TIER_INT4:
        if (rf != nullptr && std::memcmp(ra, rf, row_bytes) != 0)
          return at() + ": an INT4 token differs between anchor-only and full decode";
        break;
      case KVXFER_TIER_FP16:
        if (rf == nullptr || raw || dt == KVXFER_DTYPE_BF16) break;
        for (int32_t c = 0; c < H; ++c) {
          // The full value is a binary16 value, exactly held by fp16 and fp32.
          const uint16_t bits = codec::f32_to_f16(codec::load_elem(rf, c, dt));
          uint8_t want[4];
          codec::store_elem(want, 0, dt, codec::fp16_anchor_value(static_cast<uint8_t>(bits >> 8)));
          if (std::memcmp(want, ra + c * codec::dtype_size(dt), codec::dtype_size(dt)) != 0)
            return at() + " channel " + std::to_string(c) +
                   ": the anchor-only value is not the midpoint of the full value's high byte";
        }
        break;
      default: break;
    }
    if (raw && rf != nullptr && std::memcmp(ra, rf, row_bytes) != 0)
      return at() + ": a raw page differs between anchor-only and full decode";
  }
  return "";
}

/** Runs one framed input; returns "" or the violated property. */
inline std::string check_page_decode(const uint8_t* data, size_t size) {
  const FuzzInput in = split_fuzz_input(data, size);
  ExactBuf anc(in.anchor), res(in.residual);
  if (in.mode & MODE_RESEAL_ANCHOR) maybe_reseal(anc.data(), anc.n);
  if ((in.mode & MODE_RESEAL_RESIDUAL) && res.n >= codec::kHeaderBytes &&
      anc.n >= codec::kHeaderBytes) {
    std::memcpy(res.data() + 64, anc.data() + 72, 8);  // link = the anchor's checksum
    maybe_reseal(res.data(), res.n);
  }

  // Inspect: must agree with the decoder on the anchor's validity.
  kvxfer_page_info_t ai{}, ri{};
  clear_error();
  const kvxfer_result_t ra = codec::inspect_section(anc.data(), anc.n, &ai);
  if (!known_result(ra)) return "inspect anchor: unknown result " + std::to_string(ra);
  if (ra != KVXFER_SUCCESS && last_error()[0] == '\0')
    return "inspect anchor: error without a message";
  if (ra == KVXFER_SUCCESS && ai.section_bytes != anc.n)
    return "inspect anchor: section_bytes differs from its length";
  if (in.has_residual) {
    const kvxfer_result_t rr = codec::inspect_section(res.data(), res.n, &ri);
    if (!known_result(rr)) return "inspect residual: unknown result " + std::to_string(rr);
  }

  int64_t T = 1;
  int32_t H = 1;
  // Destination bytes ~ (T + block) * (H + 1) elements: cap that, not just T*H.
  if (ra == KVXFER_SUCCESS &&
      (static_cast<uint64_t>(ai.num_tokens) + 16) * (static_cast<uint64_t>(ai.num_channels) + 1) <=
          kMaxDstElements) {
    T = ai.num_tokens;
    H = ai.num_channels;
  }
  const int dt_bits = in.mode & MODE_DTYPE_MASK;
  const kvxfer_dtype_t dt = dt_bits == 0   ? KVXFER_DTYPE_BF16
                            : dt_bits == 1 ? KVXFER_DTYPE_FP16
                                           : KVXFER_DTYPE_FP32;
  const bool small = (in.mode & MODE_SMALL_BLOCKS) != 0;
  const FuzzDst pristine(T, H, dt, small ? 3 : 16, small ? 2 : 0);
  const kvxfer_page_id_t* expect =
      (in.mode & MODE_EXPECT) && ra == KVXFER_SUCCESS ? &ai.id : nullptr;
  const int threads = (in.mode & MODE_THREADS) ? 2 : 1;

  kvxfer_result_t rc_a = KVXFER_SUCCESS;
  std::unique_ptr<FuzzDst> after_a;
  std::string v = decode_all_paths(anc.data(), anc.n, nullptr, 0, expect, pristine, threads, &rc_a,
                                   &after_a, "anchor-only");
  if (!v.empty()) return v;
  // Both parse the anchor first; only decode looks inside the payload (metadata
  // -> CORRUPT) and at the destination and the section kind (-> MISMATCH).
  if (ra != KVXFER_SUCCESS
          ? rc_a != ra
          : !(rc_a == KVXFER_SUCCESS || rc_a == KVXFER_ERR_MISMATCH || rc_a == KVXFER_ERR_CORRUPT))
    return "inspect anchor returned " + std::to_string(ra) + " but decode returned " +
           std::to_string(rc_a);

  if (in.has_residual) {
    // Full decode on top of the anchor-only result: a failure must leave it as it was.
    kvxfer_result_t rc_f = KVXFER_SUCCESS;
    std::unique_ptr<FuzzDst> after_f;
    v = decode_all_paths(anc.data(), anc.n, res.data(), res.n, expect, *after_a, threads, &rc_f,
                         &after_f, "full");
    if (!v.empty()) return v;
    if (rc_a != KVXFER_SUCCESS && rc_f == KVXFER_SUCCESS)
      return "full decode succeeded where anchor-only failed with " + std::to_string(rc_a);
    if (rc_a == KVXFER_SUCCESS && ai.codec == KVXFER_CODEC_SPECTRUM)
      return check_spectrum(anc.data(), anc.n, *after_a,
                            rc_f == KVXFER_SUCCESS ? after_f.get() : nullptr, ai.raw_fallback != 0);
    return "";
  }
  if (rc_a == KVXFER_SUCCESS && ai.codec == KVXFER_CODEC_SPECTRUM)
    return check_spectrum(anc.data(), anc.n, *after_a, nullptr, ai.raw_fallback != 0);
  return "";
}

}  // namespace kvxfer::fuzz
