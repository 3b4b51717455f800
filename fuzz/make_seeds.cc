// Writes the seed corpus of page_decode_fuzz: valid (anchor, residual) pairs
// of every codec, several shapes, raw fallback, fp32 metadata, the empty page,
// and a few deliberately mismatched pairs, framed as fuzz/fuzz_input.h says.
// SpectrumKV pages (seed-spectrum-*) take their token tiers from a fixed
// pattern string, so every seed is deterministic.
//   make_fuzz_seeds <output dir> [<peer_message_fuzz output dir>]
// The committed copies live in tests/data/fuzz/ (seed-*), where
// tests/format_test.cc replays them.  With a second directory it also
// writes the seeds of peer_message_fuzz (tests/data/fuzz-peer/): whole
// request transcripts as a peer would send them, framed as
// fuzz/peer_message_fuzz.cc reads them.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "codec/page.h"
#include "common/error.h"
#include "fuzz_input.h"
#include "xfer/protocol.h"

namespace {

using namespace kvxfer;

struct Page {
  std::vector<uint8_t> anchor, residual;
};

// Deterministic KV-like values (LCG), optionally with a NaN or huge values.
// `tiers` (T entries) makes a SpectrumKV page (codec SPECTRUM) through
// encode_page_tiered; `sinks` puts +-900 into the FP16 tokens of such a page.
bool encode(kvxfer_codec_t codec, float alpha, int chunk, int abits, int64_t T, int32_t H,
            kvxfer_dtype_t dt, uint32_t seed, float scale, bool nan, Page* out,
            kvxfer_page_id_t id = {7, KVXFER_KV_VALUE, 4096, 0x1234},
            const std::vector<uint8_t>* tiers = nullptr, bool sinks = false,
            kvxfer_value_groups_t groups = KVXFER_VALUE_GROUPS_CHANNEL) {
  kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  cfg.value_groups = groups;
  cfg.codec = codec;
  cfg.alpha = alpha;
  cfg.chunk_tokens = chunk;
  cfg.anchor_bits = abits;
  cfg.nonfinite = KVXFER_NONFINITE_RAW;
  const size_t es = codec::dtype_size(dt);
  std::vector<uint8_t> buf(static_cast<size_t>(T * H) * es + 1);
  void* block = buf.data();
  kvxfer_page_layout_t l{&block, 1, static_cast<int32_t>(T > 0 ? T : 1), H, 0, T, H, dt};
  uint32_t s = seed;
  for (int64_t t = 0; t < T; ++t)
    for (int32_t c = 0; c < H; ++c) {
      s = s * 1664525u + 1013904223u;
      const float u = static_cast<float>(s >> 8) / 16777216.0f - 0.5f;
      float v = scale * (0.3f * static_cast<float>(c % 5) + u * (c % 7 == 3 ? 20.0f : 1.0f));
      if (nan && t == T / 2 && c == H / 2) v = NAN;
      if (sinks && (*tiers)[t] == KVXFER_TIER_FP16) v = (c % 2 ? 900.0f : -900.0f);
      codec::store_elem(buf.data() + static_cast<size_t>(t * H) * es, c, dt, v);
    }
  size_t amax = 0, rmax = 0;
  if (codec::max_sizes(&cfg, T, H, &amax, &rmax) != KVXFER_SUCCESS) return false;
  out->anchor.assign(amax, 0);
  out->residual.assign(rmax, 0);
  size_t al = 0, rl = 0;
  const kvxfer_result_t r =
      tiers != nullptr
          ? codec::encode_page_tiered(&cfg, &id, &l, tiers->data(), out->anchor.data(), amax, &al,
                                      out->residual.data(), rmax, &rl)
          : codec::encode_page(&cfg, &id, &l, out->anchor.data(), amax, &al, out->residual.data(),
                               rmax, &rl, codec::Impl::REFERENCE, 1);
  if (r != KVXFER_SUCCESS) {
    std::fprintf(stderr, "encode failed: %s\n", last_error());
    return false;
  }
  out->anchor.resize(al);
  out->residual.resize(rl);
  return true;
}

// ---------------------------------------------------------------------------
// peer_message_fuzz seeds: byte 0 flags, then records
// op u8 | page u16 | length u16 | bytes (fuzz/peer_message_fuzz.cc).
// ---------------------------------------------------------------------------
struct Transcript {
  std::vector<uint8_t> bytes;
  explicit Transcript(uint8_t flags) { bytes.push_back(flags); }
  void add(uint8_t op, uint32_t page, const std::vector<uint8_t>& msg) {
    bytes.push_back(op);
    bytes.push_back(static_cast<uint8_t>(page));
    bytes.push_back(static_cast<uint8_t>(page >> 8));
    bytes.push_back(static_cast<uint8_t>(msg.size()));
    bytes.push_back(static_cast<uint8_t>(msg.size() >> 8));
    bytes.insert(bytes.end(), msg.begin(), msg.end());
  }
};

constexpr uint64_t kPeerTag = 0x7a6;  // as fuzz/peer_message_fuzz.cc
const int64_t kPeerTokens[4] = {0, 5, 24, 40};

/** The DESC of a fuzz-target request (2 layers, 1 head of 4) from the peer's side. */
std::vector<uint8_t> peer_desc(bool is_sender, uint8_t flags, const kvxfer_codec_config_t& cc,
                               kvxfer_mode_t mode, int32_t page_tokens) {
  xfer::Desc d;
  d.is_sender = is_sender;
  d.tag = kPeerTag;
  d.num_layers = 2;
  d.kv_heads = 1;
  d.head_dim = 4;
  d.dtype = flags & 8 ? KVXFER_DTYPE_FP32 : KVXFER_DTYPE_BF16;
  d.num_tokens = kPeerTokens[(flags >> 1) & 3];
  if (is_sender) {
    d.codec = cc;
    d.mode = mode;
    d.page_tokens = page_tokens;
  }
  return xfer::encode_desc(d);
}

/**
 * A sender's whole request to the target's receiver: DESC, every page
 * (anchor then residual, or one monolithic message), STATUS ok.
 * `order`: 0 page by page, 1 every anchor first, 2 residual before anchor.
 */
Transcript sender_transcript(uint8_t flags, kvxfer_codec_t codec, float alpha, int abits,
                             kvxfer_mode_t mode, int32_t page_tokens, int order) {
  kvxfer_codec_config_t cc = KVXFER_CODEC_CONFIG_INITIALIZER;
  cc.codec = codec;
  cc.alpha = alpha;
  cc.chunk_tokens = 16;
  cc.anchor_bits = abits;
  cc.nonfinite = KVXFER_NONFINITE_RAW;
  Transcript t(flags);
  t.add(static_cast<uint8_t>(xfer::MsgKind::kDesc), 0,
        peer_desc(true, flags, cc, mode, page_tokens));
  const int64_t T = kPeerTokens[(flags >> 1) & 3];
  const auto pages = xfer::plan_pages(2, T, page_tokens);
  std::vector<Page> enc(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    const kvxfer_page_id_t id{static_cast<uint32_t>(pages[i].layer), pages[i].kind,
                              pages[i].token_begin, kPeerTag};
    if (!encode(codec, alpha, 16, abits, pages[i].num_tokens, 4,
                flags & 8 ? KVXFER_DTYPE_FP32 : KVXFER_DTYPE_BF16, static_cast<uint32_t>(i + 1),
                1.0f, false, &enc[i], id))
      return Transcript(0);
  }
  const uint8_t A = static_cast<uint8_t>(xfer::MsgKind::kAnchor);
  const uint8_t R = static_cast<uint8_t>(xfer::MsgKind::kResidual);
  for (size_t i = 0; i < pages.size(); ++i) {
    if (mode == KVXFER_MODE_MONOLITHIC) {
      std::vector<uint8_t> both = enc[i].anchor;
      both.insert(both.end(), enc[i].residual.begin(), enc[i].residual.end());
      t.add(A, static_cast<uint32_t>(i), both);
    } else if (order == 2) {
      t.add(R, static_cast<uint32_t>(i), enc[i].residual);
      t.add(A, static_cast<uint32_t>(i), enc[i].anchor);
    } else {
      t.add(A, static_cast<uint32_t>(i), enc[i].anchor);
      if (order == 0) t.add(R, static_cast<uint32_t>(i), enc[i].residual);
    }
  }
  if (order == 1 && mode != KVXFER_MODE_MONOLITHIC)
    for (size_t i = 0; i < pages.size(); ++i) t.add(R, static_cast<uint32_t>(i), enc[i].residual);
  t.add(static_cast<uint8_t>(xfer::MsgKind::kStatus), 0, xfer::encode_status(KVXFER_SUCCESS, ""));
  return t;
}

/** A receiver's side for the target's sender: DESC, then its STATUS. */
Transcript receiver_transcript(uint8_t flags, kvxfer_result_t result, const char* text) {
  Transcript t(flags);
  t.add(static_cast<uint8_t>(xfer::MsgKind::kDesc), 0,
        peer_desc(false, flags, {}, KVXFER_MODE_AUTO, 0));
  t.add(static_cast<uint8_t>(xfer::MsgKind::kStatus), 0, xfer::encode_status(result, text));
  return t;
}

int write_peer_seeds(const std::string& dir) {
  int failed = 0, written = 0;
  auto emit = [&](const std::string& name, const Transcript& t) {
    const std::string path = dir + "/seed-" + name;
    FILE* f = std::fopen(path.c_str(), "wb");
    if (t.bytes.size() < 2 || f == nullptr ||
        std::fwrite(t.bytes.data(), 1, t.bytes.size(), f) != t.bytes.size()) {
      std::fprintf(stderr, "%s: cannot write the seed\n", path.c_str());
      ++failed;
    } else {
      ++written;
    }
    if (f) std::fclose(f);
  };
  // The target receives (flags bit 0 clear).  Flags: bits 1-2 tokens, bit 3 fp32.
  emit("recv-lynx-progressive",
       sender_transcript(0x04, KVXFER_CODEC_LYNX, 20.0f, 4, KVXFER_MODE_PROGRESSIVE, 8, 0));
  emit("recv-lynx-anchors-first",
       sender_transcript(0x06, KVXFER_CODEC_LYNX, 0.0f, 3, KVXFER_MODE_PROGRESSIVE, 16, 1));
  emit("recv-int8-residual-first-fp32",
       sender_transcript(0x0c, KVXFER_CODEC_INT8, 0.0f, 4, KVXFER_MODE_PROGRESSIVE, 16, 2));
  emit("recv-int4-monolithic",
       sender_transcript(0x06, KVXFER_CODEC_INT4, 0.0f, 4, KVXFER_MODE_MONOLITHIC, 8, 0));
  emit("recv-bf16-monolithic-fp32",
       sender_transcript(0x0a, KVXFER_CODEC_BF16, 0.0f, 0, KVXFER_MODE_MONOLITHIC, 8, 0));
  emit("recv-empty",
       sender_transcript(0x00, KVXFER_CODEC_LYNX, 0.0f, 4, KVXFER_MODE_PROGRESSIVE, 8, 0));
  {  // the sender fails: STATUS with its error, then every page message empty
    Transcript t =
        sender_transcript(0x02, KVXFER_CODEC_LYNX, 0.0f, 4, KVXFER_MODE_PROGRESSIVE, 8, 0);
    Transcript f(0x02);
    f.bytes.assign(t.bytes.begin(), t.bytes.begin() + 1 + 5 + xfer::kDescBytes);  // flags, DESC
    f.add(static_cast<uint8_t>(xfer::MsgKind::kStatus), 0,
          xfer::encode_status(KVXFER_ERR_CORRUPT, "encoding the page failed"));
    for (uint32_t i = 0; i < 4; ++i) {
      f.add(static_cast<uint8_t>(xfer::MsgKind::kAnchor), i, {});
      f.add(static_cast<uint8_t>(xfer::MsgKind::kResidual), i, {});
    }
    emit("recv-peer-failed", f);
    // Cancelled here after the DESC (op bit 4), then the data still flows.
    Transcript c(0x02);
    c.bytes.assign(t.bytes.begin(), t.bytes.end());
    c.bytes[1 + 5 + xfer::kDescBytes] |= 0x10;  // the first page record cancels
    emit("recv-cancelled", c);
  }
  // The target sends (flags bit 0 set; bits 4-5 its codec, bit 6 page_tokens 16).
  emit("send-lynx", receiver_transcript(0x05, KVXFER_SUCCESS, ""));
  emit("send-int8-fp32", receiver_transcript(0x1d, KVXFER_SUCCESS, ""));
  emit("send-int4", receiver_transcript(0x27, KVXFER_SUCCESS, ""));
  emit("send-bf16", receiver_transcript(0x73, KVXFER_SUCCESS, ""));
  emit("send-empty", receiver_transcript(0x01, KVXFER_SUCCESS, ""));
  emit("send-peer-failed", receiver_transcript(0x05, KVXFER_ERR_CORRUPT, "checksum of page 3"));
  emit("send-peer-cancelled", receiver_transcript(0x05, KVXFER_ERR_CANCELLED, "cancelled"));
  std::printf("wrote %d peer_message_fuzz seeds to %s (%d failures)\n", written, dir.c_str(),
              failed);
  return failed;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s <output dir> [<peer_message_fuzz output dir>]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  int written = 0, failed = 0;
  auto emit = [&](const std::string& name, uint8_t mode, const std::vector<uint8_t>& a,
                  const std::vector<uint8_t>& r) {
    const auto bytes = fuzz::join_fuzz_input(mode, a, r);
    const std::string path = dir + "/seed-" + name;
    FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) {
      std::perror(path.c_str());
      ++failed;
    } else {
      ++written;
    }
    if (f) std::fclose(f);
  };
  // Reseal both sections by default so that mutations reach the payload checks.
  const uint8_t kReseal = fuzz::MODE_RESEAL_ANCHOR | fuzz::MODE_RESEAL_RESIDUAL;
  struct Case {
    const char* name;
    kvxfer_codec_t codec;
    float alpha;
    int chunk, abits;
    int64_t T;
    int32_t H;
    kvxfer_dtype_t dt;
    float scale;
    bool nan;
    uint8_t mode;
  };
  const Case cases[] = {
      {"lynx-a20-c16-A4-bf16", KVXFER_CODEC_LYNX, 20.0f, 16, 4, 20, 6, KVXFER_DTYPE_BF16, 1, false,
       kReseal | 0},
      {"lynx-a0-c32-A2-fp16", KVXFER_CODEC_LYNX, 0.0f, 32, 2, 33, 5, KVXFER_DTYPE_FP16, 1, false,
       kReseal | 1},
      {"lynx-a1000-c64-A6-fp32", KVXFER_CODEC_LYNX, 1000.0f, 64, 6, 17, 3, KVXFER_DTYPE_FP32, 1,
       false, kReseal | 2},
      {"lynx-a5-c128-A3-oddH", KVXFER_CODEC_LYNX, 5.0f, 128, 3, 9, 7, KVXFER_DTYPE_BF16, 1, false,
       kReseal | fuzz::MODE_SMALL_BLOCKS | 1},
      {"lynx-a255-c16-A5-expect", KVXFER_CODEC_LYNX, 255.0f, 16, 5, 18, 4, KVXFER_DTYPE_FP16, 1,
       false, kReseal | fuzz::MODE_EXPECT | 2},
      {"int8-c16-A2", KVXFER_CODEC_INT8, 0.0f, 16, 2, 19, 4, KVXFER_DTYPE_FP32, 1, false,
       kReseal | 0},
      {"int8-c32-A4-evenH", KVXFER_CODEC_INT8, 0.0f, 32, 4, 40, 8, KVXFER_DTYPE_BF16, 1, false,
       kReseal | fuzz::MODE_SMALL_BLOCKS | 2},
      {"int8-c64-A6", KVXFER_CODEC_INT8, 0.0f, 64, 6, 7, 9, KVXFER_DTYPE_FP16, 1, false,
       kReseal | 1},
      {"int4-c16-evenH", KVXFER_CODEC_INT4, 0.0f, 16, 4, 33, 10, KVXFER_DTYPE_BF16, 1, false,
       kReseal | 0},
      {"int4-c32-oddH", KVXFER_CODEC_INT4, 0.0f, 32, 4, 5, 3, KVXFER_DTYPE_FP32, 1, false,
       kReseal | 2},
      {"bf16-passthrough", KVXFER_CODEC_BF16, 0.0f, 32, 0, 6, 5, KVXFER_DTYPE_FP32, 1, false,
       kReseal | 1},
      {"bf16-passthrough-to-bf16", KVXFER_CODEC_BF16, 0.0f, 16, 0, 4, 4, KVXFER_DTYPE_BF16, 1,
       false, kReseal | 0},
      {"raw-bf16", KVXFER_CODEC_LYNX, 20.0f, 32, 4, 5, 4, KVXFER_DTYPE_BF16, 1, true, kReseal | 2},
      {"raw-fp16", KVXFER_CODEC_INT8, 0.0f, 16, 4, 6, 3, KVXFER_DTYPE_FP16, 1, true, kReseal | 0},
      {"raw-fp32", KVXFER_CODEC_INT4, 0.0f, 64, 4, 3, 5, KVXFER_DTYPE_FP32, 1, true, kReseal | 1},
      {"raw-bf16-codec", KVXFER_CODEC_BF16, 0.0f, 32, 0, 4, 3, KVXFER_DTYPE_FP16, 1, true,
       kReseal | 2},
      {"lynx-meta-fp32", KVXFER_CODEC_LYNX, 20.0f, 16, 4, 17, 4, KVXFER_DTYPE_FP32, 1e30f, false,
       kReseal | 2},
      {"int8-meta-fp32-to-fp16", KVXFER_CODEC_INT8, 0.0f, 16, 3, 16, 4, KVXFER_DTYPE_FP32, 1e20f,
       false, kReseal | 1},
      {"lynx-empty-page", KVXFER_CODEC_LYNX, 20.0f, 32, 4, 0, 4, KVXFER_DTYPE_BF16, 1, false,
       kReseal | 0},
      {"lynx-empty-page-1M-channels", KVXFER_CODEC_LYNX, 20.0f, 32, 4, 0, 1 << 20,
       KVXFER_DTYPE_BF16, 1, false, kReseal | 0},
      {"lynx-one-token", KVXFER_CODEC_LYNX, 100.0f, 32, 4, 1, 1, KVXFER_DTYPE_BF16, 1, false,
       kReseal | 0},
      {"lynx-no-reseal", KVXFER_CODEC_LYNX, 20.0f, 32, 4, 12, 4, KVXFER_DTYPE_BF16, 1, false, 0},
  };
  for (const Case& c : cases) {
    Page p;
    if (!encode(c.codec, c.alpha, c.chunk, c.abits, c.T, c.H, c.dt, 0x9e3779b9u ^ written, c.scale,
                c.nan, &p)) {
      ++failed;
      continue;
    }
    emit(c.name, c.mode, p.anchor, p.residual);
  }
  // V pages grouped per token (docs/FORMAT.md 2.8): T and H not multiples of
  // the chunk, and a wide page whose two groupings have different sizes.
  struct GroupCase {
    const char* name;
    kvxfer_codec_t codec;
    int chunk;
    int64_t T;
    int32_t H;
    kvxfer_dtype_t dt;
  };
  const GroupCase group_cases[] = {
      {"lynx-token-groups-c16-bf16", KVXFER_CODEC_LYNX, 16, 21, 37, KVXFER_DTYPE_BF16},
      {"int8-token-groups-c32-fp16", KVXFER_CODEC_INT8, 32, 40, 70, KVXFER_DTYPE_FP16},
      {"int4-token-groups-c16-fp32", KVXFER_CODEC_INT4, 16, 5, 18, KVXFER_DTYPE_FP32},
  };
  for (const GroupCase& c : group_cases) {
    Page p;
    if (!encode(c.codec, 0.0f, c.chunk, 4, c.T, c.H, c.dt, 0x51ed27u ^ written, 1, false, &p,
                {7, KVXFER_KV_VALUE, 0, 0x1234}, nullptr, false, KVXFER_VALUE_GROUPS_TOKEN)) {
      ++failed;
      continue;
    }
    emit(c.name, kReseal | 2, p.anchor, p.residual);
  }
  // SpectrumKV pages: token t gets tier pattern[t % len] ('0' FP16, '1' INT8,
  // '2' INT4, '3' DROP); `nan_tier` >= 0 forces the tier of the NaN's token
  // (T / 2).
  struct SpectrumCase {
    const char* name;
    const char* pattern;
    int chunk, abits;
    int64_t T;
    int32_t H;
    kvxfer_dtype_t dt;
    float scale;
    bool nan;
    int nan_tier;
    bool sinks;
    uint8_t mode;
  };
  const SpectrumCase spectrum_cases[] = {
      {"spectrum-mix-c16-A4-bf16", "0112223", 16, 4, 37, 6, KVXFER_DTYPE_BF16, 1, false, -1, false,
       kReseal | 0},
      {"spectrum-mix-drop-c32-A2-fp16", "3120", 32, 2, 40, 5, KVXFER_DTYPE_FP16, 1, false, -1,
       false, kReseal | 1},
      {"spectrum-mix-c64-A6-fp32", "21103", 64, 6, 70, 3, KVXFER_DTYPE_FP32, 1, false, -1, false,
       kReseal | 2},
      {"spectrum-mix-c128-A3-oddH", "1203", 128, 3, 131, 7, KVXFER_DTYPE_BF16, 1, false, -1, false,
       kReseal | fuzz::MODE_SMALL_BLOCKS | 1},
      {"spectrum-mix-A5-expect-threads", "0321", 16, 5, 18, 4, KVXFER_DTYPE_FP16, 1, false, -1,
       false, kReseal | fuzz::MODE_EXPECT | fuzz::MODE_THREADS | 2},
      {"spectrum-all-fp16", "0", 16, 4, 20, 4, KVXFER_DTYPE_FP32, 1, false, -1, false, kReseal | 1},
      {"spectrum-all-int8", "1", 32, 6, 33, 4, KVXFER_DTYPE_BF16, 1, false, -1, false, kReseal | 2},
      {"spectrum-all-int4-oddH", "2", 16, 4, 17, 3, KVXFER_DTYPE_FP16, 1, false, -1, false,
       kReseal | 0},
      {"spectrum-all-drop", "3", 16, 4, 9, 3, KVXFER_DTYPE_BF16, 1, false, -1, false, kReseal | 1},
      // The first chunk has no INT8/INT4 token: its metadata pairs are {+0, +0}.
      {"spectrum-unquantized-first-chunk", "0000000000000000331122", 16, 4, 38, 4,
       KVXFER_DTYPE_BF16, 1, false, -1, false, kReseal | 2},
      {"spectrum-sinks-fp16", "0121212121212121", 32, 4, 48, 4, KVXFER_DTYPE_FP32, 0.01f, false, -1,
       true, kReseal | 2},
      {"spectrum-fp16-saturated", "0012", 16, 4, 12, 3, KVXFER_DTYPE_FP32, 1e5f, false, -1, false,
       kReseal | 2},
      {"spectrum-denormal", "0120", 16, 4, 12, 3, KVXFER_DTYPE_FP32, 1e-40f, false, -1, false,
       kReseal | 2},
      {"spectrum-meta-fp32", "1102", 16, 4, 20, 4, KVXFER_DTYPE_FP32, 1e30f, false, -1, false,
       kReseal | 2},
      {"spectrum-meta-fp32-to-bf16", "2113", 32, 3, 35, 5, KVXFER_DTYPE_FP32, 1e20f, false, -1,
       false, kReseal | 0},
      {"spectrum-raw-nan-fp32", "0123", 16, 4, 13, 3, KVXFER_DTYPE_FP32, 1, true, 1, false,
       kReseal | 2},
      {"spectrum-raw-nan-bf16", "3102", 32, 4, 10, 5, KVXFER_DTYPE_BF16, 1, true, 0, false,
       kReseal | 1},
      {"spectrum-raw-nan-fp16-to-bf16", "21", 16, 4, 7, 2, KVXFER_DTYPE_FP16, 1, true, 2, false,
       kReseal | fuzz::MODE_SMALL_BLOCKS | 0},
      // A NaN in a DROP row is never read: a quantized page, not a raw one.
      {"spectrum-nan-in-drop", "0123", 16, 4, 13, 3, KVXFER_DTYPE_FP32, 1, true, 3, false,
       kReseal | 2},
      {"spectrum-one-token-fp16", "0", 16, 4, 1, 1, KVXFER_DTYPE_BF16, 1, false, -1, false,
       kReseal | 2},
      {"spectrum-one-token-int8", "1", 16, 2, 1, 3, KVXFER_DTYPE_FP16, 1, false, -1, false,
       kReseal | 1},
      {"spectrum-one-token-int4", "2", 64, 4, 1, 2, KVXFER_DTYPE_FP32, 1, false, -1, false,
       kReseal | 0},
      {"spectrum-empty-page", "0", 32, 4, 0, 4, KVXFER_DTYPE_BF16, 1, false, -1, false,
       kReseal | 0},
      {"spectrum-no-reseal", "0213", 16, 4, 12, 4, KVXFER_DTYPE_BF16, 1, false, -1, false, 0},
  };
  auto spectrum_tiers = [](const char* pattern, int64_t T, int nan_tier) {
    const size_t n = std::strlen(pattern);
    std::vector<uint8_t> tiers(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) tiers[t] = static_cast<uint8_t>(pattern[t % n] - '0');
    if (nan_tier >= 0 && T > 0) tiers[T / 2] = static_cast<uint8_t>(nan_tier);
    return tiers;
  };
  for (const SpectrumCase& c : spectrum_cases) {
    const std::vector<uint8_t> tiers = spectrum_tiers(c.pattern, c.T, c.nan_tier);
    Page p;
    if (!encode(KVXFER_CODEC_SPECTRUM, 0.0f, c.chunk, c.abits, c.T, c.H, c.dt,
                0x9e3779b9u ^ written, c.scale, c.nan, &p, {7, KVXFER_KV_VALUE, 4096, 0x1234},
                &tiers, c.sinks)) {
      ++failed;
      continue;
    }
    emit(c.name, c.mode, p.anchor, p.residual);
  }
  // SpectrumKV pairs that do not belong together: other tiers under the same
  // id (MISMATCH on the tier counts), a LYNX residual, and anchor-only.
  {
    const std::vector<uint8_t> t1 = spectrum_tiers("0123", 20, -1);
    const std::vector<uint8_t> t2 = spectrum_tiers("1023", 20, -1);
    const kvxfer_page_id_t id{7, KVXFER_KV_VALUE, 4096, 0x1234};
    Page s1, s2, ly;
    if (encode(KVXFER_CODEC_SPECTRUM, 0.0f, 16, 4, 20, 6, KVXFER_DTYPE_BF16, 11, 1, false, &s1, id,
               &t1) &&
        encode(KVXFER_CODEC_SPECTRUM, 0.0f, 16, 4, 20, 6, KVXFER_DTYPE_BF16, 11, 1, false, &s2, id,
               &t2) &&
        encode(KVXFER_CODEC_LYNX, 20.0f, 16, 4, 20, 6, KVXFER_DTYPE_BF16, 11, 1, false, &ly, id)) {
      emit("spectrum-anchor-only", kReseal | 1, s1.anchor, {});
      emit("spectrum-mismatch-other-tiers", kReseal, s1.anchor, s2.residual);
      emit("spectrum-mismatch-lynx-residual", kReseal, s1.anchor, ly.residual);
      emit("spectrum-swapped-sections", 0, s1.residual, s1.anchor);
    } else {
      ++failed;
    }
  }
  // Anchor only (no residual part), and pairs that do not belong together.
  Page a, b, same_id_other_data;
  if (encode(KVXFER_CODEC_LYNX, 20.0f, 16, 4, 20, 6, KVXFER_DTYPE_BF16, 1, 1, false, &a) &&
      encode(KVXFER_CODEC_LYNX, 20.0f, 16, 4, 20, 6, KVXFER_DTYPE_BF16, 2, 1, false, &b,
             {8, KVXFER_KV_KEY, 0, 0}) &&
      encode(KVXFER_CODEC_LYNX, 20.0f, 16, 4, 20, 6, KVXFER_DTYPE_BF16, 3, 1, false,
             &same_id_other_data)) {
    emit("anchor-only", kReseal, a.anchor, {});
    emit("mismatch-other-page", 0, a.anchor, b.residual);
    emit("mismatch-same-id-other-data", fuzz::MODE_RESEAL_ANCHOR, a.anchor,
         same_id_other_data.residual);
    emit("swapped-sections", 0, a.residual, a.anchor);
    emit("anchor-twice", 0, a.anchor, a.anchor);
  } else {
    ++failed;
  }
  std::printf("wrote %d seeds to %s (%d failures)\n", written, dir.c_str(), failed);
  if (argc == 3) failed += write_peer_seeds(argv[2]);
  return failed ? 1 : 0;
}
