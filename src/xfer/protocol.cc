// The request protocol's pure pieces (protocol.h).
#include "xfer/protocol.h"

#include <cinttypes>
#include <cstring>

#include "codec/format.h"
#include "codec/page_codec.h"
#include "common/error.h"

namespace kvxfer::xfer {
namespace {

template <typename T>
void put(std::vector<uint8_t>* b, T v) {
  static_assert(std::is_trivially_copyable_v<T>);
  uint8_t raw[sizeof(T)];
  std::memcpy(raw, &v, sizeof(T));  // little-endian hosts only (static_assert below)
  b->insert(b->end(), raw, raw + sizeof(T));
}

template <typename T>
T get(const uint8_t*& p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  p += sizeof(T);
  return v;
}

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little-endian");

}  // namespace

uint64_t make_tag(uint32_t seq, bool from_receiver, MsgKind kind, uint64_t page) {
  return (uint64_t{seq & kSeqMask} << (kPageBits + kKindBits + 1)) |
         (uint64_t{from_receiver} << (kPageBits + kKindBits)) |
         (static_cast<uint64_t>(kind) << kPageBits) | (page & (kMaxPages - 1));
}

std::vector<PageRef> plan_pages(int32_t num_layers, int64_t num_tokens, int32_t page_tokens) {
  std::vector<PageRef> pages;
  if (num_tokens <= 0 || page_tokens <= 0) return pages;
  const int64_t per = (num_tokens + page_tokens - 1) / page_tokens;
  pages.reserve(static_cast<size_t>(num_layers) * 2 * static_cast<size_t>(per));
  for (int32_t l = 0; l < num_layers; ++l)
    for (kvxfer_kv_kind_t k : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
      for (int64_t t = 0; t < num_tokens; t += page_tokens)
        pages.push_back({l, k, t, std::min<int64_t>(page_tokens, num_tokens - t)});
  return pages;
}

std::vector<uint8_t> encode_desc(const Desc& d) {
  std::vector<uint8_t> b;
  b.reserve(kDescBytes);
  put<uint32_t>(&b, kDescMagic);
  put<uint16_t>(&b, kProtocolVersion);
  put<uint16_t>(&b, d.is_sender ? 1 : 0);
  put<uint64_t>(&b, d.tag);
  put<int32_t>(&b, d.num_layers);
  put<int32_t>(&b, d.kv_heads);
  put<int32_t>(&b, d.head_dim);
  put<int32_t>(&b, d.dtype);
  put<int64_t>(&b, d.num_tokens);
  put<int32_t>(&b, d.codec.codec);
  put<float>(&b, d.codec.alpha);
  put<int32_t>(&b, d.codec.chunk_tokens);
  put<int32_t>(&b, d.codec.anchor_bits);
  put<int32_t>(&b, d.codec.nonfinite);
  put<int32_t>(&b, d.mode);
  put<int32_t>(&b, d.page_tokens);
  put<uint8_t>(&b, d.on_device ? 1 : 0);
  put<int32_t>(&b, d.codec.sink_tokens);   // version 2
  put<int32_t>(&b, d.codec.value_groups);  // version 3
  b.resize(kDescBytes, 0);                 // reserved
  return b;
}

kvxfer_result_t decode_desc(const uint8_t* buf, size_t len, Desc* out) {
  if (len != kDescBytes)
    return set_error(KVXFER_ERR_CORRUPT, "descriptor message is %zu bytes, expected %zu", len,
                     kDescBytes);
  const uint8_t* p = buf;
  const uint32_t magic = get<uint32_t>(p);
  const uint16_t version = get<uint16_t>(p);
  const uint16_t role = get<uint16_t>(p);
  if (magic != kDescMagic || version != kProtocolVersion || role > 1)
    return set_error(KVXFER_ERR_CORRUPT,
                     "descriptor message has magic 0x%08x version %u role %u (expected 0x%08x, "
                     "%u, 0 or 1): not a kvxfer peer of this version",
                     magic, version, role, kDescMagic, kProtocolVersion);
  Desc d;
  d.is_sender = role == 1;
  d.tag = get<uint64_t>(p);
  d.num_layers = get<int32_t>(p);
  d.kv_heads = get<int32_t>(p);
  d.head_dim = get<int32_t>(p);
  // Enumerations are range-checked before the cast: a value outside an
  // enumeration is undefined behaviour in C++.
  auto enum_field = [&p](const char* name, int32_t hi, int32_t* v) {
    *v = get<int32_t>(p);
    if (*v >= 0 && *v <= hi) return KVXFER_SUCCESS;
    return set_error(KVXFER_ERR_CORRUPT, "descriptor message has %s %d", name, *v);
  };
  int32_t dtype, codec, nonfinite, mode;
  KVXFER_CHECK(enum_field("dtype", KVXFER_DTYPE_FP32, &dtype));
  d.dtype = static_cast<kvxfer_dtype_t>(dtype);
  d.num_tokens = get<int64_t>(p);
  d.codec = KVXFER_CODEC_CONFIG_INITIALIZER;
  KVXFER_CHECK(enum_field("codec", codec::kLastCodec, &codec));
  d.codec.codec = static_cast<kvxfer_codec_t>(codec);
  d.codec.alpha = get<float>(p);
  d.codec.chunk_tokens = get<int32_t>(p);
  d.codec.anchor_bits = get<int32_t>(p);
  KVXFER_CHECK(enum_field("nonfinite", KVXFER_NONFINITE_RAW, &nonfinite));
  d.codec.nonfinite = static_cast<kvxfer_nonfinite_policy_t>(nonfinite);
  KVXFER_CHECK(enum_field("mode", KVXFER_MODE_MONOLITHIC, &mode));
  d.mode = static_cast<kvxfer_mode_t>(mode);
  d.page_tokens = get<int32_t>(p);
  const uint8_t dev = get<uint8_t>(p);
  if (dev > 1) return set_error(KVXFER_ERR_CORRUPT, "descriptor message has on_device %u", dev);
  d.on_device = dev == 1;
  d.codec.sink_tokens = get<int32_t>(p);
  const int32_t groups = get<int32_t>(p);
  if (groups < KVXFER_VALUE_GROUPS_CHANNEL || groups > KVXFER_VALUE_GROUPS_AUTO)
    return set_error(KVXFER_ERR_CORRUPT, "descriptor message has value_groups %d", groups);
  d.codec.value_groups = static_cast<kvxfer_value_groups_t>(groups);
  *out = d;
  return KVXFER_SUCCESS;
}

kvxfer_result_t compare_desc(const Desc& mine, const Desc& peer) {
  if (mine.is_sender == peer.is_sender)
    return set_error(KVXFER_ERR_MISMATCH,
                     "descriptor mismatch: both ranks posted kvxfer_%s for this request "
                     "(the i-th send to a peer matches that peer's i-th receive)",
                     mine.is_sender ? "send" : "recv");
  const Desc& s = mine.is_sender ? mine : peer;
  const Desc& r = mine.is_sender ? peer : mine;
  auto diff = [](const char* field, long long a, long long b) {
    return set_error(KVXFER_ERR_MISMATCH,
                     "descriptor mismatch: %s is %lld on the sender and %lld on the receiver",
                     field, a, b);
  };
  if (s.tag != r.tag)
    return set_error(KVXFER_ERR_MISMATCH,
                     "descriptor mismatch: tag is %" PRIu64 " on the sender and %" PRIu64
                     " on the receiver",
                     s.tag, r.tag);
  if (s.num_tokens != r.num_tokens) return diff("num_tokens", s.num_tokens, r.num_tokens);
  if (s.num_layers != r.num_layers) return diff("num_layers", s.num_layers, r.num_layers);
  if (s.kv_heads != r.kv_heads) return diff("kv_heads", s.kv_heads, r.kv_heads);
  if (s.head_dim != r.head_dim) return diff("head_dim", s.head_dim, r.head_dim);
  if (s.dtype != r.dtype)
    return set_error(KVXFER_ERR_MISMATCH,
                     "descriptor mismatch: dtype is %s on the sender and %s on the receiver",
                     codec::dtype_name(s.dtype), codec::dtype_name(r.dtype));
  const codec::PageCodec* sent = codec::page_codec(s.codec.codec);
  if (sent != nullptr && !sent->on_device() && r.on_device && s.num_tokens > 0)
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "the sender's codec is %s, which has no GPU decoder, and the "
                     "receiver's KV is on a CUDA device: receive into host memory or use "
                     "another codec",
                     sent->name());
  if (s.codec.value_groups != KVXFER_VALUE_GROUPS_CHANNEL && r.on_device && s.num_tokens > 0)
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "the sender's value_groups is %s, which may send token-grouped V pages, and "
                     "the receiver's KV is on a CUDA device, which decodes channel groups only "
                     "(docs/FORMAT.md 2.8): receive into host memory or send with channel groups",
                     s.codec.value_groups == KVXFER_VALUE_GROUPS_TOKEN ? "token" : "auto");
  if (s.num_tokens > 0 && (s.page_tokens <= 0 ||
                           (s.mode != KVXFER_MODE_PROGRESSIVE && s.mode != KVXFER_MODE_MONOLITHIC)))
    return set_error(KVXFER_ERR_CORRUPT, "sender's descriptor has page_tokens %d and mode %d",
                     s.page_tokens, static_cast<int>(s.mode));
  const uint64_t per = s.page_tokens > 0 ? (s.num_tokens + s.page_tokens - 1) / s.page_tokens : 0;
  if (static_cast<uint64_t>(s.num_layers) * 2 * per > kMaxPages)
    return set_error(KVXFER_ERR_CORRUPT, "sender's descriptor needs more than 2^%d pages",
                     kPageBits);
  return KVXFER_SUCCESS;
}

std::vector<uint8_t> encode_status(kvxfer_result_t result, const std::string& text,
                                   uint16_t flags) {
  const size_t n = std::min(text.size(), kMaxStatusText);
  std::vector<uint8_t> b;
  put<uint32_t>(&b, kStatusMagic);
  put<uint16_t>(&b, kProtocolVersion);
  put<uint16_t>(&b, flags);
  put<int32_t>(&b, result);
  put<uint32_t>(&b, static_cast<uint32_t>(n));
  b.insert(b.end(), text.begin(), text.begin() + static_cast<std::ptrdiff_t>(n));
  return b;
}

kvxfer_result_t decode_status(const uint8_t* buf, size_t len, kvxfer_result_t* result,
                              std::string* text, uint16_t* flags) {
  if (len < kStatusHeaderBytes)
    return set_error(KVXFER_ERR_CORRUPT, "status message is %zu bytes, shorter than %zu", len,
                     kStatusHeaderBytes);
  const uint8_t* p = buf;
  const uint32_t magic = get<uint32_t>(p);
  const uint16_t version = get<uint16_t>(p);
  const uint16_t f = get<uint16_t>(p);
  const int32_t r = get<int32_t>(p);
  const uint32_t n = get<uint32_t>(p);
  // kStatusNoDesc marks a refusal: an error.
  if (magic != kStatusMagic || version != kProtocolVersion || (f & ~kStatusNoDesc) != 0 ||
      (f != 0 && r >= 0) || n > kMaxStatusText || len != kStatusHeaderBytes + n ||
      r > KVXFER_IN_PROGRESS || r < KVXFER_RESULT_MIN)
    return set_error(KVXFER_ERR_CORRUPT, "status message is malformed (%zu bytes)", len);
  *result = static_cast<kvxfer_result_t>(r);
  if (flags != nullptr) *flags = f;
  text->assign(reinterpret_cast<const char*>(p), n);
  return KVXFER_SUCCESS;
}

namespace {

// RDV, WITHDRAW and ASK: magic, version, `ask`, id, seq, last (kRdvBytes):
// last is 0 but in a WITHDRAW (its result), ask is 0 but in a WITHDRAW that
// answers an ask.
std::vector<uint8_t> encode_id_message(uint32_t magic, uint64_t id, uint32_t seq, uint32_t last = 0,
                                       uint16_t ask = 0) {
  std::vector<uint8_t> b;
  b.reserve(kRdvBytes);
  put<uint32_t>(&b, magic);
  put<uint16_t>(&b, kProtocolVersion);
  put<uint16_t>(&b, ask);
  put<uint64_t>(&b, id);
  put<uint32_t>(&b, seq);
  put<uint32_t>(&b, last);
  return b;
}

// The message's magic, or 0 if it is not kRdvBytes long or of another
// version.  The u16 at 6 goes to *ask.
uint32_t decode_id_message(const uint8_t* buf, size_t len, uint64_t* id, uint32_t* seq,
                           uint32_t* last, uint16_t* ask) {
  if (len != kRdvBytes) return 0;
  const uint8_t* p = buf;
  const uint32_t magic = get<uint32_t>(p);
  const uint16_t version = get<uint16_t>(p);
  *ask = get<uint16_t>(p);
  *id = get<uint64_t>(p);
  *seq = get<uint32_t>(p);
  *last = get<uint32_t>(p);
  return version == kProtocolVersion ? magic : 0;
}

}  // namespace

std::vector<uint8_t> encode_rdv(uint64_t id, uint32_t seq) {
  return encode_id_message(kRdvMagic, id, seq);
}

std::vector<uint8_t> encode_withdraw(uint64_t id, uint32_t seq, kvxfer_result_t why, uint16_t ask) {
  return encode_id_message(kWithdrawMagic, id, seq, static_cast<uint32_t>(why),
                           seq == kRdvSeq ? ask : 0);
}

kvxfer_result_t decode_rdv(const uint8_t* buf, size_t len, uint64_t* id, uint32_t* seq,
                           kvxfer_result_t* withdrawn, uint16_t* ask) {
  uint32_t last = 0;
  uint16_t a = 0;
  const uint32_t magic = decode_id_message(buf, len, id, seq, &last, &a);
  const auto why = static_cast<int32_t>(last);
  // The magic first: a message of the wrong length (magic 0) sets no *seq.
  const bool ok = ((magic == kRdvMagic && last == 0 && a == 0 && *seq < kRdvSeq) ||
                   (magic == kWithdrawMagic && why < 0 && why >= KVXFER_RESULT_MIN &&
                    (a == 0 || *seq == kRdvSeq))) &&
                  *seq >= kIdSeqBase && *seq <= kRdvSeq;
  if (!ok)
    return set_error(KVXFER_ERR_CORRUPT,
                     "rendezvous message is malformed (%zu bytes; not a kvxfer peer of this "
                     "version)",
                     len);
  *withdrawn = magic == kWithdrawMagic ? static_cast<kvxfer_result_t>(why) : KVXFER_SUCCESS;
  if (ask != nullptr) *ask = a;
  return KVXFER_SUCCESS;
}

std::vector<uint8_t> encode_ask(uint64_t id) { return encode_id_message(kAskMagic, id, 0); }

kvxfer_result_t decode_ask(const uint8_t* buf, size_t len, uint64_t* id) {
  uint32_t seq = 0, last = 0;
  uint16_t zero = 0;
  if (decode_id_message(buf, len, id, &seq, &last, &zero) != kAskMagic || zero != 0 || seq != 0 ||
      last != 0)
    return set_error(KVXFER_ERR_CORRUPT,
                     "ask message is malformed (%zu bytes; not a kvxfer peer of this version)",
                     len);
  return KVXFER_SUCCESS;
}

kvxfer_mode_t resolve_mode(kvxfer_mode_t requested, const kvxfer_codec_config_t& codec) {
  if (requested != KVXFER_MODE_AUTO) return requested;
  const codec::PageCodec* pc = codec::page_codec(codec.codec);
  return pc != nullptr && pc->has_residual() ? KVXFER_MODE_PROGRESSIVE : KVXFER_MODE_MONOLITHIC;
}

}  // namespace kvxfer::xfer
