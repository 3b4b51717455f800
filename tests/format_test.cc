// Wire format: every malformed, truncated, corrupted or mismatched section is
// rejected with the right code and a clear message, and a failed decode never
// writes the destination.  Also pins the header bytes (a format change must
// be deliberate) and replays the fuzz corpus in tests/data/fuzz/.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "../fuzz/page_decode_check.h"
#include "test_util.h"

namespace kvxfer::codec {
namespace {

using test::config;
using test::PagedBuffer;
using Bytes = std::vector<uint8_t>;

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

// Header field offsets (format.h, PageHeader; wire order).
enum Off : size_t {
  O_MAGIC = 0,
  O_VERSION = 4,
  O_HEADER_BYTES = 6,
  O_SECTION = 8,
  O_CODEC = 9,
  O_FLAGS = 10,
  O_SRC_DTYPE = 11,
  O_CHUNK = 12,
  O_CODE_BITS = 13,
  O_ANCHOR_BITS = 14,
  O_KIND = 15,
  O_ALPHA = 16,
  O_LAYER = 20,
  O_CHANNELS = 24,
  O_SINK_ROWS = 28,
  O_TOKEN_BEGIN = 32,
  O_TOKENS = 40,
  O_STREAM = 48,
  O_PAYLOAD = 56,
  O_LINK = 64,
  O_CHECKSUM = 72
};

template <typename T>
void put_le(Bytes* b, size_t off, T v) {
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  for (size_t i = 0; i < sizeof(T); ++i) (*b)[off + i] = static_cast<uint8_t>(u >> (8 * i));
}
template <typename T>
T get_le(const Bytes& b, size_t off) {
  uint64_t u = 0;
  for (size_t i = 0; i < sizeof(T); ++i) u |= static_cast<uint64_t>(b[off + i]) << (8 * i);
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

// The checksum exactly as docs/FORMAT.md defines it, independently of
// format.cc: XXH3-64 of the header whose checksum field is zero, seeded with
// XXH3-64 of the payload.  The payload is everything after the header.
uint64_t checksum_of(const Bytes& s) {
  Bytes hdr(s.begin(), s.begin() + kHeaderBytes);
  put_le<uint64_t>(&hdr, O_CHECKSUM, 0);
  const XXH64_hash_t seed = XXH3_64bits(s.data() + kHeaderBytes, s.size() - kHeaderBytes);
  return XXH3_64bits_withSeed(hdr.data(), kHeaderBytes, seed);
}
void reseal(Bytes* s) { put_le<uint64_t>(s, O_CHECKSUM, checksum_of(*s)); }

struct Pair {
  Bytes anchor, residual;
};

const kvxfer_page_id_t kId{3, KVXFER_KV_VALUE, 1000, 42};

// A small page (T=20 over two 16-token chunks, H=6) encoded with `cfg`.
Pair small_pair(const kvxfer_codec_config_t& cfg, uint64_t seed = 11, kvxfer_page_id_t id = kId,
                float scale = 1.0f, bool nan = false) {
  PagedBuffer src(20, 6, KVXFER_DTYPE_FP32, 16);
  test::fill_kv_like(&src, seed, scale);
  if (nan) src.set(7, 2, std::numeric_limits<float>::quiet_NaN());
  const auto e = test::encode(cfg, src, Impl::REFERENCE, id);
  EXPECT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  return {e.anchor, e.residual};
}
Pair lynx_pair(uint64_t seed = 11, kvxfer_page_id_t id = kId) {
  return small_pair(config(KVXFER_CODEC_LYNX, 20.0f, 16, 4), seed, id);
}

// A destination filled with a byte pattern (rows, row padding and the unused
// tokens of every block), so "unchanged" covers every byte it owns.
struct Dst {
  PagedBuffer buf;
  explicit Dst(kvxfer_dtype_t dt = KVXFER_DTYPE_FP16, int64_t T = 20, int32_t H = 6)
      : buf(T, H, dt, 16) {
    uint32_t s = 0x12345u;
    for (auto& blk : buf.storage)
      for (auto& byte : blk) {
        s = s * 1103515245u + 12345u;
        byte = static_cast<uint8_t>(s >> 16);
      }
  }
  std::vector<Bytes> snapshot() const { return buf.storage; }
  const kvxfer_page_layout_t* layout() const { return &buf.layout; }
};

const uint8_t* ptr(const Bytes& b) { return b.empty() ? nullptr : b.data(); }

// Decodes and checks the result code, a substring of the message, and that
// the destination was not touched.
void expect_decode_fails(const Bytes& anchor, const Bytes* residual, const kvxfer_page_id_t* expect,
                         kvxfer_result_t want, const std::string& substr, Dst* dst = nullptr) {
  Dst local;
  if (dst == nullptr) dst = &local;
  const auto before = dst->snapshot();
  for (Impl impl : {Impl::REFERENCE, Impl::AUTO}) {
    clear_error();
    const kvxfer_result_t r =
        decode_page(anchor.data(), anchor.size(), residual ? residual->data() : nullptr,
                    residual ? residual->size() : 0, expect, dst->layout(), impl);
    EXPECT_EQ(r, want) << "message: " << last_error();
    EXPECT_NE(std::string(last_error()).find(substr), std::string::npos)
        << "message \"" << last_error() << "\" lacks \"" << substr << "\"";
    EXPECT_TRUE(dst->snapshot() == before) << "a failed decode wrote the destination";
  }
}

// ---------------------------------------------------------------------------
// The test's checksum helper is the format's
// ---------------------------------------------------------------------------

TEST(WireFormat, ResealHelperMatchesTheEncoder) {
  for (kvxfer_codec_t c :
       {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4, KVXFER_CODEC_BF16}) {
    Pair p = small_pair(config(c, c == KVXFER_CODEC_LYNX ? 20.0f : 0.0f, 16, 4));
    for (Bytes* s : {&p.anchor, &p.residual}) {
      Bytes copy = *s;
      put_le<uint64_t>(&copy, O_CHECKSUM, 0);
      reseal(&copy);
      EXPECT_EQ(copy, *s) << "codec " << c;
      seal_section(copy.data());
      EXPECT_EQ(copy, *s);
    }
    EXPECT_EQ(get_le<uint64_t>(p.residual, O_LINK), get_le<uint64_t>(p.anchor, O_CHECKSUM));
  }
}

// ---------------------------------------------------------------------------
// Truncation and excess length
// ---------------------------------------------------------------------------

TEST(WireFormat, EveryTruncationOfAnAnchorIsTruncated) {
  const Pair p = lynx_pair();
  ASSERT_GT(p.anchor.size(), kHeaderBytes + 16);
  for (size_t len = 0; len < p.anchor.size(); ++len) {
    SCOPED_TRACE("length " + std::to_string(len));
    const Bytes cut(p.anchor.begin(), p.anchor.begin() + len);  // exactly len bytes
    PageHeader h;
    clear_error();
    EXPECT_EQ(parse_section(cut.empty() ? p.anchor.data() : cut.data(), len, &h),
              KVXFER_ERR_TRUNCATED);
    EXPECT_NE(
        std::string(last_error())
            .find(len < kHeaderBytes ? "shorter than the 80-byte header" : "section truncated"),
        std::string::npos)
        << last_error();
    kvxfer_page_info_t info;
    EXPECT_EQ(inspect_section(p.anchor.data(), len, &info), KVXFER_ERR_TRUNCATED);
    Dst dst;
    const auto before = dst.snapshot();
    EXPECT_EQ(decode_page(p.anchor.data(), len, nullptr, 0, nullptr, dst.layout()),
              KVXFER_ERR_TRUNCATED);
    EXPECT_EQ(decode_page(p.anchor.data(), len, p.residual.data(), p.residual.size(), nullptr,
                          dst.layout()),
              KVXFER_ERR_TRUNCATED);
    EXPECT_TRUE(dst.snapshot() == before);
  }
}

TEST(WireFormat, EveryTruncationOfAResidualIsTruncated) {
  const Pair p = lynx_pair();
  ASSERT_GT(p.residual.size(), kHeaderBytes + 16);
  for (size_t len = 0; len < p.residual.size(); ++len) {
    SCOPED_TRACE("length " + std::to_string(len));
    PageHeader h;
    clear_error();
    EXPECT_EQ(parse_section(p.residual.data(), len, &h), KVXFER_ERR_TRUNCATED);
    EXPECT_NE(std::string(last_error()).find(len < kHeaderBytes ? "shorter than" : "truncated"),
              std::string::npos)
        << last_error();
    Dst dst;
    const auto before = dst.snapshot();
    clear_error();
    EXPECT_EQ(decode_page(p.anchor.data(), p.anchor.size(), p.residual.data(), len, nullptr,
                          dst.layout()),
              KVXFER_ERR_TRUNCATED);
    EXPECT_NE(std::string(last_error()).find(len < kHeaderBytes ? "shorter than" : "truncated"),
              std::string::npos)
        << last_error();
    EXPECT_TRUE(dst.snapshot() == before);
  }
}

TEST(WireFormat, ASectionOneByteLongerIsInvalidArgument) {
  const Pair p = lynx_pair();
  for (const Bytes* s : {&p.anchor, &p.residual}) {
    Bytes longer = *s;
    longer.push_back(0);
    PageHeader h;
    clear_error();
    EXPECT_EQ(parse_section(longer.data(), longer.size(), &h), KVXFER_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(last_error()).find("exceeds the " + std::to_string(s->size()) + " bytes"),
              std::string::npos)
        << last_error();
  }
  Bytes la = p.anchor, lr = p.residual;
  la.push_back(0);
  lr.push_back(0);
  expect_decode_fails(la, nullptr, nullptr, KVXFER_ERR_INVALID_ARGUMENT, "exceeds");
  expect_decode_fails(p.anchor, &lr, nullptr, KVXFER_ERR_INVALID_ARGUMENT, "exceeds");
}

// ---------------------------------------------------------------------------
// Header fields out of range or inconsistent (checksum recomputed, so the
// field check itself must catch them)
// ---------------------------------------------------------------------------

struct FieldCase {
  const char* name;
  kvxfer_codec_t codec;  // page to start from
  bool residual;         // edit the residual section (else the anchor)
  std::function<void(Bytes*)> edit;
  const char* message;
  bool raw = false;  // start from a raw-fallback page
};

std::ostream& operator<<(std::ostream& os, const FieldCase& c) { return os << c.name; }

class HeaderField : public ::testing::TestWithParam<FieldCase> {};

TEST_P(HeaderField, IsCorruptAndNothingIsWritten) {
  const FieldCase& fc = GetParam();
  const float alpha = fc.codec == KVXFER_CODEC_LYNX ? 20.0f : 0.0f;
  auto cfg = config(fc.codec, alpha, 16, 4);
  if (fc.raw) cfg.nonfinite = KVXFER_NONFINITE_RAW;
  Pair p = small_pair(cfg, 11, kId, 1.0f, fc.raw);
  Bytes& s = fc.residual ? p.residual : p.anchor;
  fc.edit(&s);
  reseal(&s);
  PageHeader h;
  clear_error();
  EXPECT_EQ(parse_section(s.data(), s.size(), &h), KVXFER_ERR_CORRUPT);
  EXPECT_NE(std::string(last_error()).find(fc.message), std::string::npos)
      << "message \"" << last_error() << "\" lacks \"" << fc.message << "\"";
  kvxfer_page_info_t info;
  EXPECT_EQ(inspect_section(s.data(), s.size(), &info), KVXFER_ERR_CORRUPT);
  if (fc.residual) {
    expect_decode_fails(p.anchor, &p.residual, nullptr, KVXFER_ERR_CORRUPT, fc.message);
  } else {
    expect_decode_fails(p.anchor, nullptr, nullptr, KVXFER_ERR_CORRUPT, fc.message);
    expect_decode_fails(p.anchor, &p.residual, nullptr, KVXFER_ERR_CORRUPT, fc.message);
  }
}

template <typename T>
std::function<void(Bytes*)> set(size_t off, T v) {
  return [=](Bytes* b) { put_le<T>(b, off, v); };
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

INSTANTIATE_TEST_SUITE_P(
    WireFormat, HeaderField,
    ::testing::Values(
        FieldCase{"Magic", KVXFER_CODEC_LYNX, false, set<uint32_t>(O_MAGIC, 0x5058564Cu),
                  "bad magic 0x5058564c"},
        FieldCase{"MagicOnResidual", KVXFER_CODEC_LYNX, true, set<uint8_t>(O_MAGIC, 'k'),
                  "bad magic"},
        FieldCase{"VersionOne", KVXFER_CODEC_LYNX, false, set<uint16_t>(O_VERSION, 1),
                  "wire version 1"},
        FieldCase{"VersionZero", KVXFER_CODEC_LYNX, true, set<uint16_t>(O_VERSION, 0),
                  "wire version 0"},
        FieldCase{"HeaderBytes", KVXFER_CODEC_LYNX, false, set<uint16_t>(O_HEADER_BYTES, 88),
                  "header_bytes 88"},
        FieldCase{"SectionKindZero", KVXFER_CODEC_LYNX, false, set<uint8_t>(O_SECTION, 0),
                  "bad section kind 0"},
        FieldCase{"SectionKindThree", KVXFER_CODEC_LYNX, true, set<uint8_t>(O_SECTION, 3),
                  "bad section kind 3"},
        FieldCase{"Codec", KVXFER_CODEC_LYNX, false, set<uint8_t>(O_CODEC, 5), "bad codec 5"},
        // An INT8 page relabelled SPECTRUM: its metadata read as tier counts.
        FieldCase{"Int8AsSpectrum", KVXFER_CODEC_INT8, false, set<uint8_t>(O_CODEC, 4),
                  "SpectrumKV tier counts"},
        FieldCase{"CodecOnResidual", KVXFER_CODEC_INT8, true, set<uint8_t>(O_CODEC, 0xFF),
                  "bad codec 255"},
        FieldCase{"UnknownFlag", KVXFER_CODEC_LYNX, false, set<uint8_t>(O_FLAGS, 0x08),
                  "unknown flags 0x08"},
        FieldCase{"UnknownHighFlag", KVXFER_CODEC_INT8, true, set<uint8_t>(O_FLAGS, 0x80),
                  "unknown flags 0x80"},
        FieldCase{"TokenGroupsOnBf16", KVXFER_CODEC_BF16, false, set<uint8_t>(O_FLAGS, 0x04),
                  "token groups on a page that is not a quantized V page"},
        FieldCase{"SrcDtype", KVXFER_CODEC_LYNX, false, set<uint8_t>(O_SRC_DTYPE, 3),
                  "bad source dtype 3"},
        FieldCase{"ChunkTokens48", KVXFER_CODEC_LYNX, false, set<uint8_t>(O_CHUNK, 48),
                  "bad chunk_tokens 48"},
        FieldCase{"ChunkTokensZero", KVXFER_CODEC_INT4, false, set<uint8_t>(O_CHUNK, 0),
                  "bad chunk_tokens 0"},
        FieldCase{"Kind", KVXFER_CODEC_LYNX, false, set<uint8_t>(O_KIND, 2), "bad K/V kind 2"},
        FieldCase{"SinkRowsPastTokens", KVXFER_CODEC_LYNX, false,
                  set<uint32_t>(O_SINK_ROWS, 0x80000000u),
                  "sink_rows 2147483648 exceeds num_tokens"},
        FieldCase{"SinkRowsOnResidual", KVXFER_CODEC_LYNX, true, set<uint32_t>(O_SINK_ROWS, 65),
                  "sink_rows 65 exceeds num_tokens"},
        FieldCase{"SinkRowsOnBf16", KVXFER_CODEC_BF16, false, set<uint32_t>(O_SINK_ROWS, 1),
                  "sink_rows 1 on a page without codes"},
        FieldCase{"NumChannelsZero", KVXFER_CODEC_LYNX, false, set<uint32_t>(O_CHANNELS, 0),
                  "bad num_channels 0"},
        FieldCase{"NumChannelsTooBig", KVXFER_CODEC_LYNX, false,
                  set<uint32_t>(O_CHANNELS, (1u << 20) + 1), "bad num_channels 1048577"},
        FieldCase{"NumTokensTooBig", KVXFER_CODEC_LYNX, false,
                  set<uint64_t>(O_TOKENS, (1ull << 32) + 1), "bad num_tokens 4294967297"},
        FieldCase{"NumTokensHuge", KVXFER_CODEC_BF16, false, set<uint64_t>(O_TOKENS, ~0ull),
                  "bad num_tokens 18446744073709551615"},
        FieldCase{"NegativeTokenBegin", KVXFER_CODEC_LYNX, false, set<int64_t>(O_TOKEN_BEGIN, -1),
                  "negative token_begin -1"},
        FieldCase{"AnchorWithLink", KVXFER_CODEC_LYNX, false, set<uint64_t>(O_LINK, 1),
                  "anchor section with a link"},
        FieldCase{"LynxCodeBits", KVXFER_CODEC_LYNX, false, set<uint8_t>(O_CODE_BITS, 7),
                  "bad bit split 7/4"},
        FieldCase{"LynxAnchorBitsOne", KVXFER_CODEC_LYNX, false, set<uint8_t>(O_ANCHOR_BITS, 1),
                  "bad bit split 8/1"},
        FieldCase{"LynxAnchorBitsSeven", KVXFER_CODEC_LYNX, true, set<uint8_t>(O_ANCHOR_BITS, 7),
                  "bad bit split 8/7"},
        FieldCase{"Int8AnchorBitsEight", KVXFER_CODEC_INT8, false, set<uint8_t>(O_ANCHOR_BITS, 8),
                  "bad bit split 8/8"},
        FieldCase{"Int4AnchorBits", KVXFER_CODEC_INT4, false, set<uint8_t>(O_ANCHOR_BITS, 2),
                  "bad bit split 4/2"},
        FieldCase{"Int4CodeBits", KVXFER_CODEC_INT4, false, set<uint8_t>(O_CODE_BITS, 8),
                  "bad bit split 8/4"},
        FieldCase{"Bf16CodeBits", KVXFER_CODEC_BF16, false, set<uint8_t>(O_CODE_BITS, 8),
                  "bad bit split 8/0"},
        FieldCase{"Bf16AnchorBits", KVXFER_CODEC_BF16, true, set<uint8_t>(O_ANCHOR_BITS, 4),
                  "bad bit split 0/4"},
        FieldCase{"Bf16MetaFlag", KVXFER_CODEC_BF16, false, set<uint8_t>(O_FLAGS, FLAG_META_FP32),
                  "BF16 page with a metadata flag"},
        FieldCase{"RawWithMetaFlag", KVXFER_CODEC_LYNX, false,
                  set<uint8_t>(O_FLAGS, FLAG_RAW | FLAG_META_FP32), "raw page with a metadata flag",
                  true},
        FieldCase{"AlphaNaN", KVXFER_CODEC_LYNX, false, set<float>(O_ALPHA, kNaN), "bad alpha nan"},
        FieldCase{"AlphaInf", KVXFER_CODEC_LYNX, false, set<float>(O_ALPHA, kInf), "bad alpha inf"},
        FieldCase{"AlphaAbove1000", KVXFER_CODEC_LYNX, false, set<float>(O_ALPHA, 1001.0f),
                  "bad alpha 1001"},
        FieldCase{"AlphaJustAbove1000", KVXFER_CODEC_LYNX, true,
                  set<float>(O_ALPHA, std::nextafter(1000.0f, 2000.0f)), "bad alpha 1000"},
        FieldCase{"AlphaNegative", KVXFER_CODEC_LYNX, false, set<float>(O_ALPHA, -1.0f),
                  "bad alpha -1"},
        FieldCase{"AlphaOnInt8", KVXFER_CODEC_INT8, false, set<float>(O_ALPHA, 1.0f),
                  "alpha set on a non-LYNX page"},
        FieldCase{"NegativeZeroAlphaOnInt4", KVXFER_CODEC_INT4, false, set<float>(O_ALPHA, -0.0f),
                  "alpha set on a non-LYNX page"},
        FieldCase{
            "PayloadBytesPlusOne", KVXFER_CODEC_LYNX, false,
            [](Bytes* b) { put_le<uint64_t>(b, O_PAYLOAD, get_le<uint64_t>(*b, O_PAYLOAD) + 1); },
            "but the header fields imply"},
        FieldCase{
            "PayloadBytesMinusOne", KVXFER_CODEC_INT8, true,
            [](Bytes* b) { put_le<uint64_t>(b, O_PAYLOAD, get_le<uint64_t>(*b, O_PAYLOAD) - 1); },
            "but the header fields imply"},
        FieldCase{"PayloadBytesHuge", KVXFER_CODEC_LYNX, false, set<uint64_t>(O_PAYLOAD, ~0ull),
                  "payload_bytes 18446744073709551615"},
        FieldCase{"NumTokensDisagreesWithPayload", KVXFER_CODEC_LYNX, false,
                  set<uint64_t>(O_TOKENS, 21), "but the header fields imply"},
        FieldCase{"NumChannelsDisagreesWithPayload", KVXFER_CODEC_INT4, false,
                  set<uint32_t>(O_CHANNELS, 7), "but the header fields imply"},
        FieldCase{"MetaFlagDisagreesWithPayload", KVXFER_CODEC_LYNX, false,
                  set<uint8_t>(O_FLAGS, FLAG_META_FP32), "but the header fields imply"},
        FieldCase{"AnchorBitsDisagreeWithPayload", KVXFER_CODEC_LYNX, true,
                  set<uint8_t>(O_ANCHOR_BITS, 5), "but the header fields imply"},
        FieldCase{"RawDtypeDisagreesWithPayload", KVXFER_CODEC_INT8, false,
                  set<uint8_t>(O_SRC_DTYPE, KVXFER_DTYPE_BF16), "but the header fields imply",
                  true}),
    [](const ::testing::TestParamInfo<FieldCase>& i) { return std::string(i.param.name); });

// ---------------------------------------------------------------------------
// Bit flips without resealing: the checksum (or a field check) catches every one
// ---------------------------------------------------------------------------

void flip_every_bit(const Pair& p, bool residual) {
  const Bytes& orig = residual ? p.residual : p.anchor;
  Dst dst;
  const auto before = dst.snapshot();
  for (size_t i = 0; i < orig.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      Bytes s = orig;
      s[i] ^= static_cast<uint8_t>(1u << bit);
      PageHeader h;
      clear_error();
      ASSERT_EQ(parse_section(s.data(), s.size(), &h), KVXFER_ERR_CORRUPT)
          << "byte " << i << " bit " << bit << ": " << last_error();
      ASSERT_NE(last_error()[0], '\0');
      // In the payload and in the checksum field, only the checksum can notice
      // (but for a SpectrumKV page's tier counts, which the sizes depend on).
      const bool counts = orig[O_CODEC] == KVXFER_CODEC_SPECTRUM && i >= kHeaderBytes &&
                          i < kHeaderBytes + kTierCountBytes;
      if (i >= O_CHECKSUM && !counts) {
        ASSERT_NE(std::string(last_error()).find("checksum mismatch"), std::string::npos)
            << last_error();
      }
      if (bit == static_cast<int>(i % 8)) {  // one decode per byte position
        const Bytes& a = residual ? p.anchor : s;
        const Bytes& r = residual ? s : p.residual;
        ASSERT_EQ(decode_page(a.data(), a.size(), r.data(), r.size(), nullptr, dst.layout()),
                  KVXFER_ERR_CORRUPT)
            << "byte " << i;
        if (!residual) {
          ASSERT_EQ(decode_page(a.data(), a.size(), nullptr, 0, nullptr, dst.layout()),
                    KVXFER_ERR_CORRUPT);
        }
        ASSERT_TRUE(dst.snapshot() == before) << "byte " << i << " written on failure";
      }
    }
  }
}

TEST(WireFormat, EveryBitFlipInAnAnchorIsCorrupt) { flip_every_bit(lynx_pair(), false); }
TEST(WireFormat, EveryBitFlipInAResidualIsCorrupt) { flip_every_bit(lynx_pair(), true); }

// A page of 1 MiB or more has its two checksums verified on two threads
// (plan_decode_any); a failure there must still be reported by the call,
// name the section, and write nothing.
TEST(WireFormat, LargePageCorruptOnEitherSectionIsCorruptWithTwoThreads) {
  PagedBuffer src(2048, 512, KVXFER_DTYPE_BF16);
  test::fill_kv_like(&src, 21);
  // Encoded by each vector path there is (the same bytes).
  for (Impl impl : {Impl::AVX2, Impl::AVX512}) {
    Impl resolved = impl;
    if (resolve_impl(impl, &resolved) != KVXFER_SUCCESS) continue;
    const auto e = test::encode(config(KVXFER_CODEC_LYNX, 0.0f, 32), src, impl);
    ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
    ASSERT_GE(e.anchor.size() + e.residual.size(), size_t{1} << 20);
    for (bool in_residual : {false, true}) {
      Bytes a = e.anchor, r = e.residual;
      Bytes& hit = in_residual ? r : a;
      hit[hit.size() / 2] ^= 0x10;  // a payload byte: the checksum fails
      PagedBuffer out(2048, 512, KVXFER_DTYPE_BF16);
      const Bytes before = out.bytes();
      EXPECT_EQ(
          decode_page(a.data(), a.size(), r.data(), r.size(), nullptr, &out.layout, Impl::AUTO, 2),
          KVXFER_ERR_CORRUPT)
          << in_residual;
      EXPECT_NE(std::string(last_error()).find("checksum"), std::string::npos) << last_error();
      EXPECT_EQ(out.bytes(), before) << "a failed decode wrote into the destination";
    }
  }
}
TEST(WireFormat, EveryBitFlipInAnInt4AnchorIsCorrupt) {
  flip_every_bit(small_pair(config(KVXFER_CODEC_INT4, 0.0f, 16)), false);
}
TEST(WireFormat, EveryBitFlipInABf16AnchorIsCorrupt) {
  flip_every_bit(small_pair(config(KVXFER_CODEC_BF16, 0.0f, 16)), false);
}

// A SpectrumKV page (docs/FORMAT.md 6) of the small page's shape, every tier used.
Pair spectrum_pair() {
  PagedBuffer src(20, 6, KVXFER_DTYPE_FP32, 16);
  test::fill_kv_like(&src, 11);
  std::vector<uint8_t> tiers(20);
  for (size_t t = 0; t < tiers.size(); ++t) tiers[t] = static_cast<uint8_t>((t * 7 + t / 3) % 4);
  kvxfer_codec_config_t cfg = config(KVXFER_CODEC_INT8, 0.0f, 16, 4);
  cfg.codec = KVXFER_CODEC_SPECTRUM;
  size_t amax = 0, rmax = 0;
  EXPECT_EQ(max_sizes(&cfg, 20, 6, &amax, &rmax), KVXFER_SUCCESS);
  Pair p{Bytes(amax), Bytes(rmax)};
  size_t al = 0, rl = 0;
  EXPECT_EQ(encode_page_tiered(&cfg, &kId, &src.layout, tiers.data(), p.anchor.data(), amax, &al,
                               p.residual.data(), rmax, &rl),
            KVXFER_SUCCESS)
      << last_error();
  p.anchor.resize(al);
  p.residual.resize(rl);
  return p;
}
TEST(WireFormat, EveryBitFlipInASpectrumAnchorIsCorrupt) { flip_every_bit(spectrum_pair(), false); }
TEST(WireFormat, EveryBitFlipInASpectrumResidualIsCorrupt) {
  flip_every_bit(spectrum_pair(), true);
}

// ---------------------------------------------------------------------------
// Sections that do not belong together
// ---------------------------------------------------------------------------

TEST(WireFormat, ResidualOfAnotherPageIsMismatch) {
  const Pair a = lynx_pair(11, kId);
  const Pair b = lynx_pair(11, {4, KVXFER_KV_VALUE, 1000, 42});  // same data, other layer
  expect_decode_fails(a.anchor, &b.residual, nullptr, KVXFER_ERR_MISMATCH,
                      "does not belong to anchor section");
  EXPECT_EQ(std::string(last_error()).find("link checksum differs"), std::string::npos)
      << last_error();
  const Pair c = lynx_pair(11, {3, KVXFER_KV_KEY, 1000, 42});
  expect_decode_fails(a.anchor, &c.residual, nullptr, KVXFER_ERR_MISMATCH, "does not belong");
  const Pair d = lynx_pair(11, {3, KVXFER_KV_VALUE, 1016, 42});
  expect_decode_fails(a.anchor, &d.residual, nullptr, KVXFER_ERR_MISMATCH, "does not belong");
  const Pair e = lynx_pair(11, {3, KVXFER_KV_VALUE, 1000, 43});
  expect_decode_fails(a.anchor, &e.residual, nullptr, KVXFER_ERR_MISMATCH, "stream 43");
  // Same identity, other codec parameters.
  const Pair f = small_pair(config(KVXFER_CODEC_LYNX, 20.0f, 16, 3));
  expect_decode_fails(a.anchor, &f.residual, nullptr, KVXFER_ERR_MISMATCH, "does not belong");
  const Pair g = small_pair(config(KVXFER_CODEC_LYNX, 21.0f, 16, 4));
  expect_decode_fails(a.anchor, &g.residual, nullptr, KVXFER_ERR_MISMATCH, "does not belong");
}

TEST(WireFormat, SameIdentityOtherDataIsMismatchByLink) {
  const Pair a = lynx_pair(11);
  const Pair b = lynx_pair(12);  // same page id and shape, different values
  ASSERT_NE(a.anchor, b.anchor);
  expect_decode_fails(a.anchor, &b.residual, nullptr, KVXFER_ERR_MISMATCH,
                      "(link checksum differs)");
  expect_decode_fails(b.anchor, &a.residual, nullptr, KVXFER_ERR_MISMATCH,
                      "(link checksum differs)");
  // A residual whose link was rewritten (and resealed) to another anchor.
  Bytes forged = a.residual;
  put_le<uint64_t>(&forged, O_LINK, get_le<uint64_t>(b.anchor, O_CHECKSUM));
  reseal(&forged);
  expect_decode_fails(a.anchor, &forged, nullptr, KVXFER_ERR_MISMATCH, "(link checksum differs)");
}

TEST(WireFormat, AnchorInTheResidualSlotIsMismatch) {
  const Pair a = lynx_pair();
  expect_decode_fails(a.anchor, &a.anchor, nullptr, KVXFER_ERR_MISMATCH,
                      "second section is not a residual section");
}

TEST(WireFormat, ResidualInTheAnchorSlotIsMismatch) {
  const Pair a = lynx_pair();
  expect_decode_fails(a.residual, nullptr, nullptr, KVXFER_ERR_MISMATCH,
                      "the anchor argument holds a residual");
  expect_decode_fails(a.residual, &a.anchor, nullptr, KVXFER_ERR_MISMATCH,
                      "the anchor argument holds a residual");
  expect_decode_fails(a.residual, &a.residual, nullptr, KVXFER_ERR_MISMATCH,
                      "anchor argument holds a residual");
}

TEST(WireFormat, UnexpectedPageIdIsMismatch) {
  const Pair a = lynx_pair();
  const kvxfer_page_id_t wrong[] = {{4, KVXFER_KV_VALUE, 1000, 42},
                                    {3, KVXFER_KV_KEY, 1000, 42},
                                    {3, KVXFER_KV_VALUE, 1001, 42},
                                    {3, KVXFER_KV_VALUE, 1000, 0},
                                    {0xFFFFFFFFu, KVXFER_KV_VALUE, 1000, 42}};
  for (const auto& w : wrong) {
    expect_decode_fails(a.anchor, nullptr, &w, KVXFER_ERR_MISMATCH,
                        "expected layer " + std::to_string(w.layer));
    expect_decode_fails(a.anchor, &a.residual, &w, KVXFER_ERR_MISMATCH,
                        "section is layer 3 V tokens from 1000");
  }
  // The right identity passes.
  Dst dst;
  EXPECT_EQ(decode_page(a.anchor.data(), a.anchor.size(), a.residual.data(), a.residual.size(),
                        &kId, dst.layout()),
            KVXFER_SUCCESS)
      << last_error();
}

TEST(WireFormat, DestinationOfAnotherShapeIsMismatch) {
  const Pair a = lynx_pair();
  Dst t21(KVXFER_DTYPE_FP16, 21, 6), h5(KVXFER_DTYPE_FP32, 20, 5);
  expect_decode_fails(a.anchor, &a.residual, nullptr, KVXFER_ERR_MISMATCH,
                      "page is 20 tokens x 6 channels", &t21);
  expect_decode_fails(a.anchor, nullptr, nullptr, KVXFER_ERR_MISMATCH, "destination is 20 x 5",
                      &h5);
}

TEST(WireFormat, NullAndLengthArgumentsAreInvalid) {
  const Pair a = lynx_pair();
  Dst dst;
  const auto before = dst.snapshot();
  clear_error();
  EXPECT_EQ(decode_page(nullptr, a.anchor.size(), nullptr, 0, nullptr, dst.layout()),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("NULL"), std::string::npos) << last_error();
  clear_error();
  EXPECT_EQ(decode_page(a.anchor.data(), a.anchor.size(), nullptr, a.residual.size(), nullptr,
                        dst.layout()),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("residual is NULL but residual_len"), std::string::npos)
      << last_error();
  EXPECT_EQ(decode_page(a.anchor.data(), a.anchor.size(), nullptr, 0, nullptr, nullptr),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(dst.snapshot() == before);
  kvxfer_page_info_t info;
  EXPECT_EQ(inspect_section(nullptr, 100, &info), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(inspect_section(a.anchor.data(), a.anchor.size(), nullptr),
            KVXFER_ERR_INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------
// Checksum-valid sections with hostile metadata
// ---------------------------------------------------------------------------

// Entry `idx` of the metadata of a binary16-metadata anchor: {m, d} at payload + 4*idx.
void set_meta16(Bytes* anchor, size_t idx, int which, uint16_t bits) {
  put_le<uint16_t>(anchor, kHeaderBytes + 4 * idx + 2 * which, bits);
  reseal(anchor);
}
void set_meta32(Bytes* anchor, size_t idx, int which, float v) {
  put_le<float>(anchor, kHeaderBytes + 8 * idx + 4 * which, v);
  reseal(anchor);
}

TEST(WireFormat, NonFiniteOrNegativeFp16MetadataIsCorruptAndNothingIsWritten) {
  const Pair p = lynx_pair();
  const size_t entries = 2 * 6;  // 2 chunks x 6 channels
  struct Bad {
    int which;  // 0 offset m, 1 half-range d
    uint16_t bits;
    const char* what;
  } const bad[] = {{0, 0x7E00, "offset nan"},       {0, 0x7C00, "offset inf"},
                   {0, 0xFC00, "offset -inf"},      {1, 0x7E00, "half-range nan"},
                   {1, 0x7C00, "half-range inf"},   {1, 0xBC00, "half-range -1"},
                   {1, 0x8001, "half-range -5.96"}, {1, 0xFE00, "half-range -nan"}};
  for (size_t idx : {size_t{0}, size_t{7}, entries - 1}) {
    for (const Bad& b : bad) {
      SCOPED_TRACE(std::string(b.what) + " at entry " + std::to_string(idx));
      Bytes a = p.anchor;
      set_meta16(&a, idx, b.which, b.bits);
      kvxfer_page_info_t info;
      EXPECT_EQ(inspect_section(a.data(), a.size(), &info), KVXFER_SUCCESS)
          << "inspect does not read the payload";
      const std::string where = "metadata entry " + std::to_string(idx) + " (chunk " +
                                std::to_string(idx / 6) + ", channel " + std::to_string(idx % 6) +
                                ")";
      expect_decode_fails(a, nullptr, nullptr, KVXFER_ERR_CORRUPT, where);
      expect_decode_fails(a, nullptr, nullptr, KVXFER_ERR_CORRUPT, b.what);
      // The residual still links to the original anchor, so relink it first.
      Bytes r = p.residual;
      put_le<uint64_t>(&r, O_LINK, get_le<uint64_t>(a, O_CHECKSUM));
      reseal(&r);
      expect_decode_fails(a, &r, nullptr, KVXFER_ERR_CORRUPT, where);
    }
  }
}

TEST(WireFormat, NonFiniteOrNegativeFp32MetadataIsCorruptAndNothingIsWritten) {
  const Pair p = small_pair(config(KVXFER_CODEC_INT8, 0.0f, 16, 4), 11, kId, 1e30f);
  kvxfer_page_info_t info;
  ASSERT_EQ(inspect_section(p.anchor.data(), p.anchor.size(), &info), KVXFER_SUCCESS);
  ASSERT_EQ(info.meta_fp32, 1);
  const float bad[][2] = {{kNaN, 1.0f}, {kInf, 1.0f}, {-kInf, 1.0f},
                          {0.0f, kNaN}, {0.0f, kInf}, {0.0f, -1e-30f}};
  for (size_t idx : {size_t{0}, size_t{11}}) {
    for (const auto& b : bad) {
      Bytes a = p.anchor;
      set_meta32(&a, idx, 0, b[0]);
      set_meta32(&a, idx, 1, b[1]);
      expect_decode_fails(a, nullptr, nullptr, KVXFER_ERR_CORRUPT,
                          "metadata entry " + std::to_string(idx));
    }
  }
}

TEST(WireFormat, ExtremeButValidMetadataDecodes) {
  // Finite metadata at the edges of binary16 passes validation and decodes
  // (to large or infinite values in the destination dtype, never NaN).
  const Pair p = lynx_pair();
  Bytes a = p.anchor;
  set_meta16(&a, 0, 0, 0x7BFF);  // m = 65504
  set_meta16(&a, 0, 1, 0x7BFF);  // d = 65504
  set_meta16(&a, 1, 1, 0x8000);  // d = -0: a zero range
  for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32}) {
    Dst dst(dt);
    ASSERT_EQ(decode_page(a.data(), a.size(), nullptr, 0, nullptr, dst.layout()), KVXFER_SUCCESS)
        << last_error();
    for (int64_t t = 0; t < 20; ++t)
      for (int32_t c = 0; c < 6; ++c) ASSERT_FALSE(std::isnan(dst.buf.get(t, c))) << t << "," << c;
  }
}

// Every distinct alpha in a LYNX header makes the decoder build a codebook
// (up to about 1 MB of lookup table at alpha 1000).  Before the cache was
// bounded, a peer could grow the receiver's memory without limit with small,
// checksum-valid sections: 20000 alphas = 2.5 GB (measured).  The cache now
// keeps at most kCodebookCacheSize codebooks.
long rss_kb() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * 4;
}

TEST(WireFormat, ManyDistinctAlphasDoNotGrowMemoryWithoutBound) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer keeps freed memory in quarantine, so RSS says nothing here";
#endif
  Dst dst;
  const Pair warm = lynx_pair();
  ASSERT_EQ(decode_page(warm.anchor.data(), warm.anchor.size(), nullptr, 0, nullptr, dst.layout()),
            KVXFER_SUCCESS);
  const long before = rss_kb();
  for (int i = 0; i < 2000; ++i) {
    // Each page really is encoded with its own alpha, so its anchor table
    // fits that alpha's bins and the decode succeeds.
    const Pair p = small_pair(
        config(KVXFER_CODEC_LYNX, 500.0f + 0.01f * static_cast<float>(i), 16, 4), 11, kId);
    ASSERT_EQ(decode_page(p.anchor.data(), p.anchor.size(), nullptr, 0, nullptr, dst.layout()),
              KVXFER_SUCCESS)
        << last_error();
  }
  EXPECT_LT(rss_kb() - before, 64 * 1024) << "KB of memory kept after coding 2000 distinct alphas";
}

// ---------------------------------------------------------------------------
// A failed full decode leaves the anchor-only result in place
// ---------------------------------------------------------------------------

TEST(WireFormat, FailedFullDecodeKeepsTheAnchorOnlyResult) {
  const Pair p = lynx_pair();
  const Pair other = lynx_pair(12);
  for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32}) {
    Dst dst(dt);
    ASSERT_EQ(decode_page(p.anchor.data(), p.anchor.size(), nullptr, 0, nullptr, dst.layout()),
              KVXFER_SUCCESS);
    const auto anchor_only = dst.snapshot();
    // Sanity: the full decode really would write something else.
    Dst full(dt);
    ASSERT_EQ(decode_page(p.anchor.data(), p.anchor.size(), p.residual.data(), p.residual.size(),
                          nullptr, full.layout()),
              KVXFER_SUCCESS);
    ASSERT_NE(full.buf.bytes(), dst.buf.bytes());

    Bytes flipped = p.residual;
    flipped.back() ^= 0x10;
    expect_decode_fails(p.anchor, &flipped, nullptr, KVXFER_ERR_CORRUPT,
                        "checksum mismatch on residual", &dst);
    Bytes bad_header = p.residual;
    put_le<uint8_t>(&bad_header, O_FLAGS, 0x40);
    reseal(&bad_header);
    expect_decode_fails(p.anchor, &bad_header, nullptr, KVXFER_ERR_CORRUPT, "unknown flags", &dst);
    const Bytes cut(p.residual.begin(), p.residual.end() - 1);
    expect_decode_fails(p.anchor, &cut, nullptr, KVXFER_ERR_TRUNCATED, "truncated", &dst);
    expect_decode_fails(p.anchor, &other.residual, nullptr, KVXFER_ERR_MISMATCH,
                        "link checksum differs", &dst);
    const kvxfer_page_id_t wrong{3, KVXFER_KV_KEY, 1000, 42};
    expect_decode_fails(p.anchor, &p.residual, &wrong, KVXFER_ERR_MISMATCH, "expected layer 3 K",
                        &dst);
    EXPECT_TRUE(dst.snapshot() == anchor_only);
  }
}

// ---------------------------------------------------------------------------
// Golden header bytes
// ---------------------------------------------------------------------------

TEST(WireFormat, HeaderBytesAreFixed) {
  // A fixed 4 x 2 FP32 page, LYNX alpha 20, C = 16, A = 4.
  PagedBuffer src(4, 2, KVXFER_DTYPE_FP32, 16, 0, 0);
  const float v[4][2] = {{0.5f, -1.0f}, {2.0f, 0.25f}, {-0.75f, 3.0f}, {1.0f, 0.0f}};
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < 2; ++c) src.set(t, c, v[t][c]);
  const kvxfer_page_id_t id{5, KVXFER_KV_KEY, 256, 0x0102030405060708ull};
  const auto e = test::encode(config(KVXFER_CODEC_LYNX, 20.0f, 16, 4), src, Impl::REFERENCE, id);
  ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  // metadata: 1 chunk x 2 channels x {m, d} binary16 = 8; anchors: 8 x 4 bits = 4;
  // anchor table: 2^4 float32 = 64.
  ASSERT_EQ(e.anchor.size(), 80u + 8u + 4u + 64u);
  ASSERT_EQ(e.residual.size(), 80u + 4u);
  const Bytes& a = e.anchor;

  const uint8_t expect_anchor[72] = {
      'K',  'V',  'X',  'P',                           // magic
      0x05, 0x00,                                      // version 5
      0x50, 0x00,                                      // header_bytes 80
      0x01,                                            // section: anchor
      0x00,                                            // codec LYNX
      0x00,                                            // flags
      0x02,                                            // src dtype FP32
      0x10,                                            // chunk_tokens 16
      0x08,                                            // code_bits 8
      0x04,                                            // anchor_bits 4
      0x00,                                            // kind K
      0x00, 0x00, 0xA0, 0x41,                          // alpha 20.0f
      0x05, 0x00, 0x00, 0x00,                          // layer 5
      0x02, 0x00, 0x00, 0x00,                          // num_channels 2
      0x00, 0x00, 0x00, 0x00,                          // reserved
      0x00, 0x01, 0,    0,    0,    0,    0,    0,     // token_begin 256
      0x04, 0,    0,    0,    0,    0,    0,    0,     // num_tokens 4
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // stream_id
      0x4C, 0,    0,    0,    0,    0,    0,    0,     // payload_bytes 76
      0,    0,    0,    0,    0,    0,    0,    0,     // link (none on an anchor)
  };
  for (size_t i = 0; i < 72; ++i) {
    EXPECT_EQ(a[i], expect_anchor[i]) << "anchor header byte " << i;
  }
  EXPECT_EQ(get_le<uint64_t>(a, O_CHECKSUM), checksum_of(a));

  // The residual header differs in section, payload_bytes, link and checksum only.
  const Bytes& r = e.residual;
  for (size_t i = 0; i < 56; ++i)
    if (i != O_SECTION) {
      EXPECT_EQ(r[i], expect_anchor[i]) << "residual header byte " << i;
    }
  EXPECT_EQ(r[O_SECTION], 0x02);
  EXPECT_EQ(get_le<uint64_t>(r, O_PAYLOAD), 4u);
  EXPECT_EQ(get_le<uint64_t>(r, O_LINK), get_le<uint64_t>(a, O_CHECKSUM));
  EXPECT_EQ(get_le<uint64_t>(r, O_CHECKSUM), checksum_of(r));

  // Metadata of channel 0 (values 0.5, 2, -0.75, 1): m = 0.625, d = 1.375 (binary16).
  EXPECT_EQ(get_le<uint16_t>(a, 80), 0x3900);  // 0.625
  EXPECT_EQ(get_le<uint16_t>(a, 82), 0x3D80);  // 1.375
  // Channel 1 (-1, 0.25, 3, 0): m = 1, d = 2.
  EXPECT_EQ(get_le<uint16_t>(a, 84), 0x3C00);
  EXPECT_EQ(get_le<uint16_t>(a, 86), 0x4000);

  // Anchor table (docs/FORMAT.md 2.4), recomputed from the page's own codes:
  // per anchor, the mean of recon_full over the codes of the sampled rows
  // (t % 16 == 0: row 0, elements 0 and 1; double sums in ascending code
  // order), clamped to the anchor's bin; the bin centre if unused.
  const CodebookRef cb = get_codebook(KVXFER_CODEC_LYNX, 20.0f, 4, nullptr);
  ASSERT_NE(cb, nullptr);
  uint64_t hist[256] = {};
  for (uint64_t i = 0; i < 2; ++i) {
    const unsigned anchor = get_bits(a.data() + 80 + 8, i * 4, 4),
                   res = get_bits(r.data() + 80, i * 4, 4);
    ++hist[(anchor << 4) | res];
  }
  int used = 0;
  for (unsigned k = 0; k < 16; ++k) {
    double num = 0, den = 0;
    for (unsigned c = k * 16; c < (k + 1) * 16; ++c) {
      num = num + static_cast<double>(hist[c]) * cb->recon_full[c];
      den = den + static_cast<double>(hist[c]);
    }
    used += den > 0;
    float want = den > 0 ? static_cast<float>(num / den) : cb->recon_anchor[k];
    want = std::min(std::max(want, cb->anchor_lo[k]), cb->anchor_hi[k]);
    const float got = get_le<float>(a, 80 + 12 + 4 * k);
    EXPECT_EQ(std::memcmp(&got, &want, 4), 0)
        << "anchor table entry " << k << ": " << got << " vs " << want;
  }
  EXPECT_EQ(used, 2);  // z = -0.09 and -1 fall in two anchors: the test is not vacuous
}

TEST(WireFormat, SpectrumPageBytesAreFixed) {
  // The same 4 x 2 page, SPECTRUM, C = 16, A = 4, tiers FP16, INT8, INT4, DROP.
  PagedBuffer src(4, 2, KVXFER_DTYPE_FP32, 16, 0, 0);
  const float v[4][2] = {{0.5f, -1.0f}, {2.0f, 0.25f}, {-0.75f, 3.0f}, {1.0f, 0.0f}};
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < 2; ++c) src.set(t, c, v[t][c]);
  const kvxfer_page_id_t id{5, KVXFER_KV_KEY, 256, 0x0102030405060708ull};
  kvxfer_codec_config_t cfg = config(KVXFER_CODEC_INT8, 0.0f, 16, 4);
  cfg.codec = KVXFER_CODEC_SPECTRUM;
  const uint8_t tiers[4] = {KVXFER_TIER_FP16, KVXFER_TIER_INT8, KVXFER_TIER_INT4, KVXFER_TIER_DROP};
  Bytes a(1024), r(1024);
  size_t al = 0, rl = 0;
  ASSERT_EQ(encode_page_tiered(&cfg, &id, &src.layout, tiers, a.data(), a.size(), &al, r.data(),
                               r.size(), &rl),
            KVXFER_SUCCESS)
      << last_error();
  // anchor: counts 32 | map 1 | metadata 1 chunk x 2 x {m, d} fp16 = 8 | fp16 high bytes 2
  //         | int8 anchors 2 x 4 bits = 1 | int4 codes 2 x 4 bits = 1 | table 2^4 x f32 = 64
  // residual: counts 32 | fp16 low bytes 2 | int8 residuals 1
  ASSERT_EQ(al, 80u + 32u + 1u + 8u + 2u + 1u + 1u + 64u);
  ASSERT_EQ(rl, 80u + 32u + 2u + 1u);
  a.resize(al);
  r.resize(rl);
  EXPECT_EQ(a[O_CODEC], 4);
  EXPECT_EQ(a[O_CODE_BITS], 8);
  EXPECT_EQ(a[O_ANCHOR_BITS], 4);
  EXPECT_EQ(get_le<uint32_t>(a, O_ALPHA), 0u);
  EXPECT_EQ(get_le<uint64_t>(a, O_PAYLOAD), al - 80);
  EXPECT_EQ(get_le<uint64_t>(a, O_CHECKSUM), checksum_of(a));
  EXPECT_EQ(get_le<uint64_t>(r, O_LINK), get_le<uint64_t>(a, O_CHECKSUM));
  EXPECT_EQ(get_le<uint64_t>(r, O_CHECKSUM), checksum_of(r));
  for (int k = 0; k < 4; ++k) {  // one token per tier, in both sections
    EXPECT_EQ(get_le<uint64_t>(a, 80 + 8 * k), 1u);
    EXPECT_EQ(get_le<uint64_t>(r, 80 + 8 * k), 1u);
  }
  EXPECT_EQ(a[112], 0xE4);  // map: 0 | 1 << 2 | 2 << 4 | 3 << 6
  // Metadata over the INT8 and INT4 tokens only (tokens 1, 2):
  // channel 0 {2, -0.75}: m = 0.625, d = 1.375; channel 1 {0.25, 3}: m = 1.625, d = 1.375.
  EXPECT_EQ(get_le<uint16_t>(a, 113), 0x3900);
  EXPECT_EQ(get_le<uint16_t>(a, 115), 0x3D80);
  EXPECT_EQ(get_le<uint16_t>(a, 117), 0x3E80);
  EXPECT_EQ(get_le<uint16_t>(a, 119), 0x3D80);
  // FP16 token 0: 0.5 = 0x3800, -1 = 0xBC00: high bytes in the anchor, low in the residual.
  EXPECT_EQ(a[121], 0x38);
  EXPECT_EQ(a[122], 0xBC);
  EXPECT_EQ(r[112], 0x00);
  EXPECT_EQ(r[113], 0x00);
  // INT8 token 1: z = +1 -> code 255 (anchor 0xF, residual 0xF); z = -1 -> code 0.
  EXPECT_EQ(a[123], 0x0F);
  EXPECT_EQ(r[114], 0x0F);
  // INT4 token 2: z = -1 -> 0; z = +1 -> 15 (the odd element in the high nibble).
  EXPECT_EQ(a[124], 0xF0);
  // Anchor table: the histogram samples row 0 only (t % 16 == 0), an FP16
  // token, so no INT8 code is counted and every entry is its bin centre.
  const CodebookRef cb = get_codebook(KVXFER_CODEC_INT8, 0.0f, 4, nullptr);
  for (unsigned k = 0; k < 16; ++k) {
    const float want = cb->recon_anchor[k];
    EXPECT_EQ(get_le<float>(a, 125 + 4 * k), want) << "table entry " << k;
  }
}

// ---------------------------------------------------------------------------
// Per-page anchor table: hostile entries are refused before anything is written
// ---------------------------------------------------------------------------

TEST(WireFormat, AnchorTableOutsideItsBinIsCorruptAndNothingIsWritten) {
  for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8}) {
    SCOPED_TRACE(codec == KVXFER_CODEC_LYNX ? "LYNX" : "INT8");
    const float alpha = codec == KVXFER_CODEC_LYNX ? 20.0f : 0.0f;
    const Pair p = small_pair(config(codec, alpha, 16, 4));
    const CodebookRef cb = get_codebook(codec, alpha, 4, nullptr);
    ASSERT_NE(cb, nullptr);
    ASSERT_TRUE(has_anchor_table(*cb));
    const size_t table = p.anchor.size() - 64;  // last in the anchor payload
    for (unsigned k : {0u, 5u, 15u}) {
      const float bad[] = {kNaN,
                           -kNaN,
                           kInf,
                           -kInf,
                           std::nextafter(cb->anchor_hi[k], 2.0f),
                           std::nextafter(cb->anchor_lo[k], -2.0f),
                           1e30f};
      for (float v : bad) {
        SCOPED_TRACE("entry " + std::to_string(k) + " = " + std::to_string(v));
        Bytes a = p.anchor;
        put_le<float>(&a, table + 4 * k, v);
        reseal(&a);
        kvxfer_page_info_t info;
        EXPECT_EQ(inspect_section(a.data(), a.size(), &info), KVXFER_SUCCESS)
            << "inspect does not read the payload";
        expect_decode_fails(a, nullptr, nullptr, KVXFER_ERR_CORRUPT,
                            "anchor table holds a value outside");
        Bytes r = p.residual;  // relinked to the edited anchor: the full decode refuses it too
        put_le<uint64_t>(&r, O_LINK, get_le<uint64_t>(a, O_CHECKSUM));
        reseal(&r);
        expect_decode_fails(a, &r, nullptr, KVXFER_ERR_CORRUPT, "anchor table");
      }
      // The bin's own edges are valid values.
      for (float v : {cb->anchor_lo[k], cb->anchor_hi[k]}) {
        Bytes a = p.anchor;
        put_le<float>(&a, table + 4 * k, v);
        reseal(&a);
        Dst dst;
        EXPECT_EQ(decode_page(a.data(), a.size(), nullptr, 0, nullptr, dst.layout()),
                  KVXFER_SUCCESS)
            << last_error();
      }
    }
  }
}

TEST(WireFormat, AnchorOnlyDecodeUsesTheTable) {
  // Moving one table entry within its bin changes exactly the anchor-only
  // values of the elements with that anchor, and not the full decode.
  const Pair p = lynx_pair();
  const CodebookRef cb = get_codebook(KVXFER_CODEC_LYNX, 20.0f, 4, nullptr);
  const size_t table = p.anchor.size() - 64;
  Dst base(KVXFER_DTYPE_FP32), full_base(KVXFER_DTYPE_FP32);
  ASSERT_EQ(decode_page(p.anchor.data(), p.anchor.size(), nullptr, 0, nullptr, base.layout()),
            KVXFER_SUCCESS);
  ASSERT_EQ(decode_page(p.anchor.data(), p.anchor.size(), p.residual.data(), p.residual.size(),
                        nullptr, full_base.layout()),
            KVXFER_SUCCESS);
  // The most used anchor of the page.
  int count[16] = {};
  for (uint64_t i = 0; i < 120; ++i) ++count[get_bits(p.anchor.data() + 80 + 48, i * 4, 4)];
  const unsigned k = static_cast<unsigned>(std::max_element(count, count + 16) - count);
  Bytes a = p.anchor;
  const float old = get_le<float>(a, table + 4 * k);
  const float moved = old == cb->anchor_lo[k] ? cb->anchor_hi[k] : cb->anchor_lo[k];
  put_le<float>(&a, table + 4 * k, moved);
  reseal(&a);
  Dst out(KVXFER_DTYPE_FP32);
  ASSERT_EQ(decode_page(a.data(), a.size(), nullptr, 0, nullptr, out.layout()), KVXFER_SUCCESS)
      << last_error();
  int changed = 0;
  for (int64_t t = 0; t < 20; ++t)
    for (int32_t c = 0; c < 6; ++c) {
      const bool uses_k =
          get_bits(p.anchor.data() + 80 + 48, static_cast<uint64_t>(t * 6 + c) * 4, 4) == k;
      if (out.buf.get(t, c) != base.buf.get(t, c)) {
        ++changed;
        EXPECT_TRUE(uses_k) << "element " << t << "," << c << " does not use anchor " << k;
      }
    }
  EXPECT_GT(changed, count[k] / 2);
  Bytes r = p.residual;
  put_le<uint64_t>(&r, O_LINK, get_le<uint64_t>(a, O_CHECKSUM));
  reseal(&r);
  Dst full(KVXFER_DTYPE_FP32);
  ASSERT_EQ(decode_page(a.data(), a.size(), r.data(), r.size(), nullptr, full.layout()),
            KVXFER_SUCCESS);
  EXPECT_EQ(full.buf.bytes(), full_base.buf.bytes());
}

// ---------------------------------------------------------------------------
// Fuzz corpus replay
// ---------------------------------------------------------------------------

Bytes read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

TEST(WireFormat, FuzzCorpusReplaysWithoutViolations) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(KVXFER_TEST_DATA_DIR) / "fuzz";
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 30u) << "the corpus in " << dir << " is missing or incomplete";
  size_t seeds = 0, decoded = 0;
  for (const auto& f : files) {
    SCOPED_TRACE(f.filename().string());
    const Bytes data = read_file(f);
    seeds += f.filename().string().rfind("seed-", 0) == 0;
    // As the fuzzer runs it: framing, optional reseal, every path, all properties.
    const std::string v = fuzz::check_page_decode(data.data(), data.size());
    EXPECT_EQ(v, "");
    // The whole file as a bare section: alone, and with itself as residual.
    Dst dst;
    const auto before = dst.snapshot();
    const kvxfer_result_t r1 =
        decode_page(data.data(), data.size(), nullptr, 0, nullptr, dst.layout());
    const kvxfer_result_t r2 =
        decode_page(data.data(), data.size(), data.data(), data.size(), nullptr, dst.layout());
    EXPECT_TRUE(fuzz::known_result(r1) && fuzz::known_result(r2)) << r1 << " " << r2;
    if (r1 != KVXFER_SUCCESS && r2 != KVXFER_SUCCESS) {
      EXPECT_TRUE(dst.snapshot() == before);
    }
    // The framed anchor section, if the file holds a valid one, must decode.
    const fuzz::FuzzInput in = fuzz::split_fuzz_input(data.data(), data.size());
    kvxfer_page_info_t info;
    if (inspect_section(ptr(in.anchor), in.anchor.size(), &info) == KVXFER_SUCCESS &&
        !info.is_residual && info.num_tokens * info.num_channels <= 4096) {
      PagedBuffer out(info.num_tokens, info.num_channels, KVXFER_DTYPE_FP32);
      const kvxfer_result_t r =
          decode_page(in.anchor.data(), in.anchor.size(), nullptr, 0, nullptr, &out.layout);
      EXPECT_TRUE(r == KVXFER_SUCCESS || r == KVXFER_ERR_CORRUPT) << r << " " << last_error();
      decoded += r == KVXFER_SUCCESS;
    }
  }
  EXPECT_GE(seeds, 20u) << "the seed corpus (fuzz/make_seeds.cc) is missing";
  EXPECT_GE(decoded, 15u) << "too few corpus entries hold a decodable page";
}

}  // namespace
}  // namespace kvxfer::codec
