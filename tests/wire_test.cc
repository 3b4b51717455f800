// Golden bytes of the control messages (docs/TRANSPORT.md, "Wire layouts"):
// each message is built with fixed, distinctive field values and compared
// with a checked-in hex string written from the documented layout, and the
// checked-in bytes are parsed back with every field checked.  A change made
// to both an encoder and its decoder fails here, since it would break an
// older peer.  Also replays the peer_message_fuzz corpus.  The page sections are pinned in
// tests/format_test.cc (WireFormat.HeaderBytesAreFixed).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../fuzz/peer_message_check.h"
#include "common/error.h"
#include "transport/bootstrap.h"
#include "transport/comm.h"
#include "transport/ofi.h"
#include "transport/ofi_link_internal.h"
#include "xfer/protocol.h"

namespace kvxfer {
namespace {

using Bytes = std::vector<uint8_t>;

/** "4b 56 58 44" -> bytes; spaces and '|' are ignored. */
Bytes hex(const std::string& s) {
  Bytes out;
  int hi = -1;
  for (char c : s) {
    int v;
    if (c >= '0' && c <= '9')
      v = c - '0';
    else if (c >= 'a' && c <= 'f')
      v = c - 'a' + 10;
    else
      continue;
    if (hi < 0) {
      hi = v;
    } else {
      out.push_back(static_cast<uint8_t>(hi << 4 | v));
      hi = -1;
    }
  }
  EXPECT_EQ(hi, -1) << "odd number of hex digits in " << s;
  return out;
}

std::string to_hex(const Bytes& b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < b.size(); ++i) {
    if (i) s += ' ';
    s += d[b[i] >> 4];
    s += d[b[i] & 15];
  }
  return s;
}

// ---------------------------------------------------------------------------
// Request protocol (src/xfer/protocol.h): DESC version 6.
// ---------------------------------------------------------------------------
// off type field          (docs/TRANSPORT.md, "DESC")
const char* const kSenderDesc =
    "4b 56 58 44"              // 0  u32 magic "KVXD"
    "06 00"                    // 4  u16 version 6
    "01 00"                    // 6  u16 role 1 sender
    "88 77 66 55 44 33 22 11"  // 8  u64 tag 0x1122334455667788
    "1c 00 00 00"              // 16 i32 num_layers 28
    "08 00 00 00"              // 20 i32 kv_heads 8
    "80 00 00 00"              // 24 i32 head_dim 128
    "01 00 00 00"              // 28 i32 dtype FP16
    "05 04 03 02 01 00 00 00"  // 32 i64 num_tokens 0x0102030405
    "01 00 00 00"              // 40 i32 codec INT8
    "00 00 a0 41"              // 44 f32 alpha 20.0
    "40 00 00 00"              // 48 i32 chunk_tokens 64
    "05 00 00 00"              // 52 i32 anchor_bits 5
    "01 00 00 00"              // 56 i32 nonfinite RAW
    "02 00 00 00"              // 60 i32 mode MONOLITHIC
    "00 01 00 00"              // 64 i32 page_tokens 256
    "01"                       // 68 u8  on_device 1
    "04 00 00 00"              // 69 i32 sink_tokens 4
    "01 00 00 00"              // 73 i32 value_groups TOKEN
    "00 00 00";                // 77 reserved
const char* const kReceiverDesc =
    "4b 56 58 44 06 00"                    // magic, version 6
    "00 00"                                // role 0 receiver
    "88 77 66 55 44 33 22 11"              // tag
    "1c 00 00 00 08 00 00 00 80 00 00 00"  // num_layers 28, kv_heads 8, head_dim 128
    "02 00 00 00"                          // dtype FP32
    "e8 03 00 00 00 00 00 00"              // num_tokens 1000
    // codec, alpha, chunk_tokens, anchor_bits, nonfinite, mode, page_tokens: 0 on a receiver
    "00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00"
    "00"                       // on_device 0
    "00 00 00 00 00 00 00 00"  // sink_tokens, value_groups: 0
    "00 00 00";                // reserved

xfer::Desc sender_desc() {
  xfer::Desc d;
  d.is_sender = true;
  d.tag = 0x1122334455667788ull;
  d.num_layers = 28;
  d.kv_heads = 8;
  d.head_dim = 128;
  d.dtype = KVXFER_DTYPE_FP16;
  d.num_tokens = 0x0102030405ll;
  d.codec = KVXFER_CODEC_CONFIG_INITIALIZER;
  d.codec.codec = KVXFER_CODEC_INT8;
  d.codec.alpha = 20.0f;
  d.codec.chunk_tokens = 64;
  d.codec.anchor_bits = 5;
  d.codec.nonfinite = KVXFER_NONFINITE_RAW;
  d.codec.sink_tokens = 4;
  d.codec.value_groups = KVXFER_VALUE_GROUPS_TOKEN;
  d.mode = KVXFER_MODE_MONOLITHIC;
  d.page_tokens = 256;
  d.on_device = true;
  return d;
}

xfer::Desc receiver_desc() {
  xfer::Desc d;  // codec{}, mode and page_tokens stay zero on a receiver (protocol.h)
  d.is_sender = false;
  d.tag = 0x1122334455667788ull;
  d.num_layers = 28;
  d.kv_heads = 8;
  d.head_dim = 128;
  d.dtype = KVXFER_DTYPE_FP32;
  d.num_tokens = 1000;
  return d;
}

TEST(WireBytes, SenderDescriptorIsFixed) {
  const Bytes want = hex(kSenderDesc);
  ASSERT_EQ(want.size(), xfer::kDescBytes);
  EXPECT_EQ(to_hex(xfer::encode_desc(sender_desc())), to_hex(want));

  xfer::Desc d;
  ASSERT_EQ(xfer::decode_desc(want.data(), want.size(), &d), KVXFER_SUCCESS) << last_error();
  EXPECT_TRUE(d.is_sender);
  EXPECT_EQ(d.tag, 0x1122334455667788ull);
  EXPECT_EQ(d.num_layers, 28);
  EXPECT_EQ(d.kv_heads, 8);
  EXPECT_EQ(d.head_dim, 128);
  EXPECT_EQ(d.dtype, KVXFER_DTYPE_FP16);
  EXPECT_EQ(d.num_tokens, 0x0102030405ll);
  EXPECT_EQ(d.codec.codec, KVXFER_CODEC_INT8);
  EXPECT_EQ(d.codec.alpha, 20.0f);
  EXPECT_EQ(d.codec.chunk_tokens, 64);
  EXPECT_EQ(d.codec.anchor_bits, 5);
  EXPECT_EQ(d.codec.nonfinite, KVXFER_NONFINITE_RAW);
  EXPECT_EQ(d.codec.sink_tokens, 4);
  EXPECT_EQ(d.codec.value_groups, KVXFER_VALUE_GROUPS_TOKEN);
  EXPECT_EQ(d.mode, KVXFER_MODE_MONOLITHIC);
  EXPECT_EQ(d.page_tokens, 256);
  EXPECT_TRUE(d.on_device);
  // The fields the wire does not carry come from KVXFER_CODEC_CONFIG_INITIALIZER.
  const kvxfer_codec_config_t init = KVXFER_CODEC_CONFIG_INITIALIZER;
  EXPECT_EQ(d.codec.size, init.size);
  EXPECT_EQ(d.codec.magic, init.magic);
  EXPECT_EQ(d.codec.version, init.version);
}

TEST(WireBytes, ReceiverDescriptorIsFixed) {
  const Bytes want = hex(kReceiverDesc);
  ASSERT_EQ(want.size(), xfer::kDescBytes);
  EXPECT_EQ(to_hex(xfer::encode_desc(receiver_desc())), to_hex(want));

  xfer::Desc d;
  d.page_tokens = 99;  // overwritten
  ASSERT_EQ(xfer::decode_desc(want.data(), want.size(), &d), KVXFER_SUCCESS) << last_error();
  EXPECT_FALSE(d.is_sender);
  EXPECT_EQ(d.tag, 0x1122334455667788ull);
  EXPECT_EQ(d.num_layers, 28);
  EXPECT_EQ(d.kv_heads, 8);
  EXPECT_EQ(d.head_dim, 128);
  EXPECT_EQ(d.dtype, KVXFER_DTYPE_FP32);
  EXPECT_EQ(d.num_tokens, 1000);
  EXPECT_EQ(d.codec.codec, KVXFER_CODEC_LYNX);  // 0
  EXPECT_EQ(d.codec.alpha, 0.0f);
  EXPECT_EQ(d.codec.chunk_tokens, 0);
  EXPECT_EQ(d.codec.anchor_bits, 0);
  EXPECT_EQ(d.codec.nonfinite, KVXFER_NONFINITE_ERROR);
  EXPECT_EQ(d.codec.sink_tokens, 0);
  EXPECT_EQ(d.codec.value_groups, KVXFER_VALUE_GROUPS_CHANNEL);
  EXPECT_EQ(d.mode, KVXFER_MODE_AUTO);
  EXPECT_EQ(d.page_tokens, 0);
  EXPECT_FALSE(d.on_device);
  // The pair handshakes (compare_desc reads these very fields) once the
  // receiver agrees on dtype and size.
  xfer::Desc s = d;
  ASSERT_EQ(xfer::decode_desc(hex(kSenderDesc).data(), xfer::kDescBytes, &s), KVXFER_SUCCESS);
  EXPECT_EQ(xfer::compare_desc(s, d), KVXFER_ERR_MISMATCH);  // num_tokens differ
  EXPECT_NE(std::string(last_error()).find("num_tokens is 4328719365 on the sender and 1000"),
            std::string::npos)
      << last_error();
}

TEST(WireBytes, OnlyDescriptorVersion6IsAccepted) {
  // Versions 1 to 5 (before sink_tokens, value_groups, ASK, WITHDRAW, the answer
  // to an ask) and any later
  // one are refused, as are a wrong magic, role, on_device or value_groups.
  const Bytes good = hex(kSenderDesc);
  xfer::Desc d;
  for (uint8_t v : {0, 1, 2, 3, 4, 5, 7, 0xff}) {
    Bytes b = good;
    b[4] = v;
    EXPECT_EQ(xfer::decode_desc(b.data(), b.size(), &d), KVXFER_ERR_CORRUPT) << int(v);
    EXPECT_NE(std::string(last_error()).find("not a kvxfer peer of this version"),
              std::string::npos);
  }
  struct Case {
    size_t off;
    uint8_t value;
  } cases[] = {{0, 0x4c},
               {6, 2},
               {68, 2},
               {73, 3},
               // Enumerations out of range (peer_message_fuzz found a dtype
               // of -196606 loaded as kvxfer_dtype_t: undefined behaviour).
               {28, 3},
               {31, 0xff},
               {40, 5},
               {43, 0x80},
               {56, 2},
               {60, 3}};
  for (const Case& c : cases) {
    Bytes b = good;
    b[c.off] = c.value;
    EXPECT_EQ(xfer::decode_desc(b.data(), b.size(), &d), KVXFER_ERR_CORRUPT) << c.off;
  }
  EXPECT_EQ(xfer::decode_desc(good.data(), 79, &d), KVXFER_ERR_CORRUPT);
}

// ---------------------------------------------------------------------------
// STATUS version 6: ok, an error with its text, the peer's cancel.
// ---------------------------------------------------------------------------
// `b` parses as a message of the rendezvous stream for request id
// 0x0123456789abcdef, seq 0x4005, withdrawn with `want` (KVXFER_SUCCESS: an
// RDV).
void expect_rendezvous(const Bytes& b, kvxfer_result_t want) {
  uint64_t id = 0;
  uint32_t seq = 0;
  kvxfer_result_t why = KVXFER_ERR_INTERNAL;
  ASSERT_EQ(xfer::decode_rdv(b.data(), b.size(), &id, &seq, &why), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(id, 0x0123456789abcdefull);
  EXPECT_EQ(seq, 0x4005u);
  EXPECT_EQ(why, want);
}

// A by-id sender's announcement on its peer's rendezvous stream (protocol.h).
TEST(WireBytes, RendezvousMessageIsFixed) {
  const Bytes want =
      hex("4b 56 58 52 06 00 00 00"    // magic "KVXR", version 6, reserved 0
          "ef cd ab 89 67 45 23 01"    // 8  u64 request id 0x0123456789abcdef
          "05 40 00 00 00 00 00 00");  // 16 u32 seq 0x4005 (the id space), u32 0
  EXPECT_EQ(to_hex(xfer::encode_rdv(0x0123456789abcdefull, 0x4005)), to_hex(want));
  expect_rendezvous(want, KVXFER_SUCCESS);  // an announcement, not a withdrawal
  uint64_t id = 0;
  uint32_t seq = 0;
  kvxfer_result_t why = KVXFER_ERR_INTERNAL;
  EXPECT_EQ(xfer::decode_rdv(want.data(), want.size() - 1, &id, &seq, &why), KVXFER_ERR_CORRUPT);
  for (size_t at : {size_t{0}, size_t{4}, size_t{6}, size_t{17}, size_t{20}}) {
    Bytes bad = want;
    bad[at] ^= 0x40;  // magic, version, reserved, a seq outside the id space, reserved
    EXPECT_EQ(xfer::decode_rdv(bad.data(), bad.size(), &id, &seq, &why), KVXFER_ERR_CORRUPT) << at;
  }
  // The stream's tag: seq kRdvSeq (no request's), from the sender, kind STATUS.
  EXPECT_EQ(xfer::make_tag(xfer::kRdvSeq, false, xfer::MsgKind::kStatus, 3),
            (uint64_t{0x7FFF} << 24) | (uint64_t{1} << 21) | 3);
}

// A by-id sender's withdrawal of its announcement, on the same stream
// (protocol.h, WITHDRAW): the RDV's layout with its own magic and the
// sender's result.
TEST(WireBytes, WithdrawMessageIsFixed) {
  const Bytes want =
      hex("4b 56 58 57 06 00 00 00"    // magic "KVXW", version 6, reserved 0
          "ef cd ab 89 67 45 23 01"    // 8  u64 request id 0x0123456789abcdef
          "05 40 00 00 f3 ff ff ff");  // 16 u32 seq 0x4005, i32 result -13 (CANCELLED)
  EXPECT_EQ(to_hex(xfer::encode_withdraw(0x0123456789abcdefull, 0x4005, KVXFER_ERR_CANCELLED)),
            to_hex(want));
  expect_rendezvous(want, KVXFER_ERR_CANCELLED);
  uint64_t id = 0;
  uint32_t seq = 0;
  kvxfer_result_t why = KVXFER_SUCCESS;
  // A result that is no error (0, 1) or below KVXFER_RESULT_MIN, a seq
  // outside the id space, another version.
  for (const auto& [at, v] : std::vector<std::pair<size_t, uint8_t>>{
           {20, 0x00}, {20, 0xf2}, {23, 0x00}, {18, 0x01}, {4, 0x04}}) {
    Bytes bad = want;
    bad[at] = v;
    if (at == 20 && v == 0x00) bad[21] = bad[22] = bad[23] = 0;  // result 0
    EXPECT_EQ(xfer::decode_rdv(bad.data(), bad.size(), &id, &seq, &why), KVXFER_ERR_CORRUPT)
        << at << " " << int(v);
  }
  Bytes one = want;  // result 1 (KVXFER_IN_PROGRESS)
  one[20] = 1;
  one[21] = one[22] = one[23] = 0;
  EXPECT_EQ(xfer::decode_rdv(one.data(), one.size(), &id, &seq, &why), KVXFER_ERR_CORRUPT);
  // Seq kRdvSeq: the answer to an ask (version 6), no request's seq, with
  // the number of the ask it answers (mod 2^16) at 6; an RDV may not carry
  // that seq, nor another WITHDRAW an ask number.
  const Bytes answer =
      hex("4b 56 58 57 06 00 34 12"    // magic "KVXW", version 6, ask number 0x1234
          "ef cd ab 89 67 45 23 01"    // 8  u64 request id
          "ff 7f 00 00 f3 ff ff ff");  // 16 u32 seq 0x7FFF, i32 result -13
  EXPECT_EQ(to_hex(xfer::encode_withdraw(0x0123456789abcdefull, xfer::kRdvSeq, KVXFER_ERR_CANCELLED,
                                         0x1234)),
            to_hex(answer));
  uint16_t ask = 0;
  ASSERT_EQ(xfer::decode_rdv(answer.data(), answer.size(), &id, &seq, &why, &ask), KVXFER_SUCCESS)
      << last_error();
  EXPECT_EQ(seq, xfer::kRdvSeq);
  EXPECT_EQ(why, KVXFER_ERR_CANCELLED);
  EXPECT_EQ(ask, 0x1234);
  Bytes numbered = want;  // seq 0x4005 with an ask number
  numbered[6] = 1;
  EXPECT_EQ(xfer::decode_rdv(numbered.data(), numbered.size(), &id, &seq, &why),
            KVXFER_ERR_CORRUPT);
  EXPECT_EQ(
      to_hex(xfer::encode_withdraw(0x0123456789abcdefull, 0x4005, KVXFER_ERR_CANCELLED, 0x1234)),
      to_hex(want));  // only an answer carries one
  const Bytes rdv = xfer::encode_rdv(0x0123456789abcdefull, xfer::kRdvSeq);
  EXPECT_EQ(xfer::decode_rdv(rdv.data(), rdv.size(), &id, &seq, &why), KVXFER_ERR_CORRUPT);
}

// A by-id receiver's ask on its peer's ask stream (protocol.h, ASK).
TEST(WireBytes, AskMessageIsFixed) {
  const Bytes want =
      hex("4b 56 58 41 06 00 00 00"    // magic "KVXA", version 6, reserved 0
          "ef cd ab 89 67 45 23 01"    // 8  u64 request id 0x0123456789abcdef
          "00 00 00 00 00 00 00 00");  // 16 u32 seq 0, u32 0
  EXPECT_EQ(to_hex(xfer::encode_ask(0x0123456789abcdefull)), to_hex(want));
  uint64_t id = 0;
  ASSERT_EQ(xfer::decode_ask(want.data(), want.size(), &id), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(id, 0x0123456789abcdefull);
  EXPECT_EQ(xfer::decode_ask(want.data(), want.size() - 1, &id), KVXFER_ERR_CORRUPT);
  for (size_t at : {size_t{0}, size_t{4}, size_t{6}, size_t{16}, size_t{20}}) {
    Bytes bad = want;
    bad[at] ^= 0x40;  // magic, version, reserved, a seq, reserved
    EXPECT_EQ(xfer::decode_ask(bad.data(), bad.size(), &id), KVXFER_ERR_CORRUPT) << at;
  }
  // An RDV is not an ASK, nor the other way round.
  const std::vector<uint8_t> rdv = xfer::encode_rdv(1, xfer::kIdSeqBase);
  EXPECT_EQ(xfer::decode_ask(rdv.data(), rdv.size(), &id), KVXFER_ERR_CORRUPT);
  uint32_t seq = 0;
  kvxfer_result_t why = KVXFER_SUCCESS;
  EXPECT_EQ(xfer::decode_rdv(want.data(), want.size(), &id, &seq, &why), KVXFER_ERR_CORRUPT);
  // The stream's tag: seq kRdvSeq, from the receiver, kind STATUS.
  EXPECT_EQ(xfer::make_tag(xfer::kRdvSeq, true, xfer::MsgKind::kStatus, 3),
            (uint64_t{0x7FFF} << 24) | (uint64_t{1} << 23) | (uint64_t{1} << 21) | 3);
}

TEST(WireBytes, StatusMessagesAreFixed) {
  struct Case {
    kvxfer_result_t result;
    const char* text;
    const char* bytes;
  } cases[] = {{KVXFER_SUCCESS, "",
                "4b 56 58 53 06 00 00 00"  // magic "KVXS", version 6, flags 0
                "00 00 00 00"              // 8  i32 result 0 (SUCCESS)
                "00 00 00 00"},            // 12 u32 text length 0
               {KVXFER_ERR_CORRUPT, "bad page",
                "4b 56 58 53 06 00 00 00"
                "fa ff ff ff"                // result -6 (CORRUPT)
                "08 00 00 00"                // length 8
                "62 61 64 20 70 61 67 65"},  // "bad page", no NUL
               {KVXFER_ERR_CANCELLED, "stop",
                "4b 56 58 53 06 00 00 00"
                "f3 ff ff ff"     // result -13 (CANCELLED): the peer's kvxfer_request_cancel
                "04 00 00 00"     // length 4
                "73 74 6f 70"}};  // "stop"
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    const Bytes want = hex(c.bytes);
    EXPECT_EQ(to_hex(xfer::encode_status(c.result, c.text)), to_hex(want));
    kvxfer_result_t r = KVXFER_IN_PROGRESS;
    std::string text = "x";
    ASSERT_EQ(xfer::decode_status(want.data(), want.size(), &r, &text), KVXFER_SUCCESS)
        << last_error();
    EXPECT_EQ(r, c.result);
    EXPECT_EQ(text, c.text);
    // Exactly 16 + length bytes; another version is refused.
    EXPECT_EQ(xfer::decode_status(want.data(), want.size() - 1, &r, &text), KVXFER_ERR_CORRUPT);
    Bytes v2 = want;
    v2[4] = 2;
    EXPECT_EQ(xfer::decode_status(v2.data(), v2.size(), &r, &text), KVXFER_ERR_CORRUPT);
  }
  // A refusal that no DESC follows: flags (offset 6) bit 0.  Other bits,
  // and the flag on a success, are refused.
  {
    const Bytes want =
        hex("4b 56 58 53 06 00 01 00"  // magic, version 6, flags 1 (kStatusNoDesc)
            "f4 ff ff ff"              // result -12 (TIMEOUT)
            "01 00 00 00 74");         // length 1, "t"
    EXPECT_EQ(to_hex(xfer::encode_status(KVXFER_ERR_TIMEOUT, "t", xfer::kStatusNoDesc)),
              to_hex(want));
    kvxfer_result_t r = KVXFER_SUCCESS;
    std::string text;
    uint16_t flags = 0;
    ASSERT_EQ(xfer::decode_status(want.data(), want.size(), &r, &text, &flags), KVXFER_SUCCESS)
        << last_error();
    EXPECT_EQ(flags, xfer::kStatusNoDesc);
    EXPECT_EQ(r, KVXFER_ERR_TIMEOUT);
    Bytes other = want;
    other[6] = 2;
    EXPECT_EQ(xfer::decode_status(other.data(), other.size(), &r, &text), KVXFER_ERR_CORRUPT);
    Bytes ok = want;
    for (int i = 8; i < 12; ++i) ok[static_cast<size_t>(i)] = 0;
    EXPECT_EQ(xfer::decode_status(ok.data(), ok.size(), &r, &text), KVXFER_ERR_CORRUPT);
    ok[6] = 0;
    EXPECT_EQ(xfer::decode_status(ok.data(), ok.size(), &r, &text, &flags), KVXFER_SUCCESS);
    EXPECT_EQ(flags, 0);
  }
  // Text longer than 1024 bytes is cut to 1024.
  const Bytes big = xfer::encode_status(KVXFER_ERR_SYSTEM, std::string(1500, 'z'));
  ASSERT_EQ(big.size(), 16u + 1024u);
  EXPECT_EQ(to_hex(Bytes(big.begin(), big.begin() + 16)),
            to_hex(hex("4b 56 58 53 06 00 00 00 f7 ff ff ff 00 04 00 00")));  // -9, 1024
}

// The Link tag of a request message: seq (15) | from_receiver (1) | kind (2) | page (21).
TEST(WireBytes, RequestTagLayoutIsFixed) {
  using xfer::MsgKind;
  EXPECT_EQ(xfer::make_tag(0x1234, true, MsgKind::kResidual, 0x1abcde), 0x1234fabcdeull);
  EXPECT_EQ(xfer::make_tag(0x1234, false, MsgKind::kDesc, 0), 0x1234000000ull);
  EXPECT_EQ(xfer::make_tag(0x1234, false, MsgKind::kStatus, 0), 0x1234200000ull);
  EXPECT_EQ(xfer::make_tag(0x1234, false, MsgKind::kAnchor, 7), 0x1234400007ull);
  EXPECT_EQ(xfer::make_tag(0x8005, false, MsgKind::kDesc, 0), 0x0005000000ull);  // seq mod 2^15
  EXPECT_EQ(xfer::make_tag(0x7fff, true, MsgKind::kResidual, 0x1fffff), (uint64_t{1} << 39) - 1);
}

// ---------------------------------------------------------------------------
// Link framing (transport/ofi.h), version 2: the header chunk and the hello.
// ---------------------------------------------------------------------------
TEST(WireBytes, LinkHeaderAndHelloAreFixed) {
  using transport::WireHeader;
  const Bytes want =
      hex("46 58 56 4b"                // 0  u32 magic 0x4B565846
          "02 00"                      // 4  u16 version 2
          "00 00"                      // 6  u16 flags 0
          "80 3e 00 00"                // 8  u32 chunk_bytes 16000
          "3d b7 c7 28"                // 12 u32 check: XXH3_64 of the header, low 32 bits
          "05 04 03 02 01 00 00 00"    // 16 u64 total 0x0102030405
          "78 56 34 12 00 00 00 00");  // 24 u64 user tag 0x12345678
  const WireHeader h = transport::make_wire_header(16000, 0x0102030405ull, 0x12345678);
  Bytes got(sizeof h);
  std::memcpy(got.data(), &h, sizeof h);
  EXPECT_EQ(to_hex(got), to_hex(want));

  WireHeader back;
  ASSERT_EQ(want.size(), sizeof back);
  std::memcpy(&back, want.data(), sizeof back);
  EXPECT_EQ(back.magic, 0x4B565846u);
  EXPECT_EQ(back.version, 2);
  EXPECT_EQ(back.flags, 0);
  EXPECT_EQ(back.chunk_bytes, 16000u);
  EXPECT_EQ(back.check, transport::wire_header_check(back));
  EXPECT_EQ(back.total, 0x0102030405ull);
  EXPECT_EQ(back.tag, 0x12345678u);
  EXPECT_TRUE(transport::wire_header_ok(back, 32, 0x12345678));
  EXPECT_FALSE(transport::wire_header_ok(back, 31, 0x12345678));  // a short header chunk
  EXPECT_FALSE(transport::wire_header_ok(back, 32, 0x12345679));  // another tag
  auto bad = [&](auto mutate) {
    WireHeader b = back;
    mutate(&b);
    return !transport::wire_header_ok(b, 32, 0x12345678);
  };
  // Every flipped byte fails the checksum, whatever field it lands in.
  for (size_t at = 0; at < sizeof(WireHeader); ++at)
    EXPECT_TRUE(bad([at](WireHeader* b) { reinterpret_cast<uint8_t*>(b)[at] ^= 0x5a; }))
        << "byte " << at;
  // Field checks, with the checksum made to match.
  auto bad_sealed = [&](auto mutate) {
    return bad([&](WireHeader* b) {
      mutate(b);
      b->check = transport::wire_header_check(*b);
    });
  };
  EXPECT_TRUE(bad_sealed([](WireHeader* b) { b->magic ^= 1; }));
  EXPECT_TRUE(bad_sealed([](WireHeader* b) { b->version = 1; }));
  EXPECT_TRUE(bad_sealed([](WireHeader* b) { b->flags = 1; }));
  EXPECT_TRUE(bad_sealed([](WireHeader* b) { b->chunk_bytes = 0; }));
  EXPECT_TRUE(bad_sealed([](WireHeader* b) { b->chunk_bytes = (1u << 30) + 1; }));
  EXPECT_TRUE(bad_sealed([](WireHeader* b) {  // 2^24 chunks: one too many
    b->chunk_bytes = 1;
    b->total = uint64_t{1} << 24;
  }));
  EXPECT_FALSE(bad_sealed([](WireHeader* b) {
    b->chunk_bytes = 1;
    b->total = (uint64_t{1} << 24) - 1;
  }));
  // A total near 2^64 must not wrap the chunk count into range.
  EXPECT_TRUE(bad_sealed([](WireHeader* b) {
    b->chunk_bytes = 2;
    b->total = ~uint64_t{0};
  }));

  Bytes hello(8);
  std::memcpy(hello.data(), &transport::kHelloMagic, 8);
  EXPECT_EQ(to_hex(hello), to_hex(hex("48 45 4c 4c 46 58 56 4b")));  // "HELLFXVK"
  std::memcpy(hello.data(), &transport::link_detail::kHelloRingsMagic, 8);
  EXPECT_EQ(to_hex(hello), to_hex(hex("48 45 4c 4c 46 58 56 42")));  // "HELLFXVB": rings
}

// ---------------------------------------------------------------------------
// Communicator payload (transport/comm.h), version 1.
// ---------------------------------------------------------------------------
TEST(WireBytes, CommPayloadIsFixed) {
  const Bytes want =
      hex("4b 56 58 43 01 00 00 00"  // magic "KVXC", version 1, 0
          "01 00 00 00 03 00 00 00"  // rank 1, nranks 3
          "03 00 00 00 aa bb cc"     // peer 0: 3 bytes
          "00 00 00 00"              // peer 1: this rank, empty
          "01 00 00 00 5a");         // peer 2: 1 byte
  const std::vector<Bytes> addrs = {{0xaa, 0xbb, 0xcc}, {}, {0x5a}};
  EXPECT_EQ(to_hex(transport::encode_comm_payload(1, addrs)), to_hex(want));
  std::vector<Bytes> back;
  ASSERT_EQ(transport::decode_comm_payload(want, 1, 3, &back), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(back, addrs);
  Bytes v2 = want;
  v2[4] = 2;
  EXPECT_EQ(transport::decode_comm_payload(v2, 1, 3, &back), KVXFER_ERR_CORRUPT);
}

// ---------------------------------------------------------------------------
// Bootstrap (transport/bootstrap.h), version 1: the unique id, the hello, the
// table, its timeout status, the failure report and the rank-failed status.
// Every frame starts with a u32 length.
// ---------------------------------------------------------------------------
TEST(WireBytes, UniqueIdLayoutIsFixed) {
  transport::UniqueId id{};
  id.magic = transport::kBootstrapMagic;
  id.version = transport::kBootstrapVersion;
  id.family = AF_INET;
  id.port = htons(0x1234);
  id.scope_id = 0x0a0b0c0d;
  const uint8_t addr[4] = {127, 0, 0, 1};
  std::memcpy(id.addr, addr, 4);
  for (size_t i = 0; i < transport::kBootstrapSecretBytes; ++i)
    id.secret[i] = static_cast<uint8_t>(0xc0 + i);
  Bytes got(sizeof id);
  std::memcpy(got.data(), &id, sizeof id);
  const Bytes want = hex(
      "4b 56 58 42 01 00"                                // magic "KVXB", version 1 (host order)
      "02 00"                                            // family AF_INET
      "12 34"                                            // port, network order
      "00 00"                                            // reserved
      "0d 0c 0b 0a"                                      // scope_id
      "7f 00 00 01 00 00 00 00 00 00 00 00 00 00 00 00"  // addr
      "c0 c1 c2 c3 c4 c5 c6 c7 c8 c9 ca cb cc cd ce cf"  // secret
      "d0 d1 d2 d3 d4 d5 d6 d7 d8 d9 da db dc dd de df"
      // reserved, 64 bytes
      "00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 "
      "00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 "
      "00 00 00 00");
  EXPECT_EQ(to_hex(got), to_hex(want));
}

/** Sends all of `b`; false on error. */
bool send_bytes(int fd, const Bytes& b) {
  size_t off = 0;
  while (off < b.size()) {
    const ssize_t n = ::send(fd, b.data() + off, b.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

/** Reads one length-prefixed frame (prefix included); empty on EOF or timeout. */
Bytes recv_frame(int fd) {
  Bytes b(4);
  size_t off = 0, want = 4;
  while (off < want) {
    const ssize_t n = ::recv(fd, b.data() + off, want - off, 0);
    if (n <= 0) return {};
    off += static_cast<size_t>(n);
    if (off == 4 && want == 4) {
      const uint32_t len = b[0] | b[1] << 8 | b[2] << 16 | uint32_t{b[3]} << 24;
      if (len > (1u << 20)) return {};
      want = 4 + len;
      b.resize(want);
    }
  }
  return b;
}

void set_timeouts(int fd) {
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// A fake root on a loopback listener of this test: what bootstrap_connect
// emits, and how it parses a checked-in table.
class FakeRoot {
 public:
  FakeRoot() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof sa;
    ok_ = fd_ >= 0 && ::bind(fd_, reinterpret_cast<sockaddr*>(&sa), len) == 0 &&
          ::listen(fd_, 4) == 0 && ::getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len) == 0;
    id_ = transport::UniqueId{};
    id_.magic = transport::kBootstrapMagic;
    id_.version = transport::kBootstrapVersion;
    id_.family = AF_INET;
    id_.port = sa.sin_port;
    std::memcpy(id_.addr, &sa.sin_addr, 4);
    for (size_t i = 0; i < transport::kBootstrapSecretBytes; ++i)
      id_.secret[i] = static_cast<uint8_t>(0xc0 + i);
  }
  ~FakeRoot() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return ok_; }
  const transport::UniqueId& id() const { return id_; }
  /** Accepts one rank, returns its hello frame and answers with `reply`. */
  Bytes serve(const Bytes& reply) {
    const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) return {};
    set_timeouts(c);
    Bytes hello = recv_frame(c);
    if (!send_bytes(c, reply)) hello.clear();
    ::shutdown(c, SHUT_WR);
    char drain;
    while (::recv(c, &drain, 1, 0) > 0) {
    }
    ::close(c);
    return hello;
  }
  /** Accepts one rank, answers its hello with `table`, reads its final
   *  status and answers with `verdict`; returns {hello, final status}. */
  std::pair<Bytes, Bytes> serve_final(const Bytes& table, const Bytes& verdict) {
    const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) return {};
    set_timeouts(c);
    Bytes hello = recv_frame(c);
    Bytes status;
    if (send_bytes(c, table)) status = recv_frame(c);
    if (!send_bytes(c, verdict)) status.clear();
    ::shutdown(c, SHUT_WR);
    char drain;
    while (::recv(c, &drain, 1, 0) > 0) {
    }
    ::close(c);
    return {hello, status};
  }

 private:
  int fd_ = -1;
  bool ok_ = false;
  transport::UniqueId id_{};
};

// The hello of rank 1 of 2 with payload "kv", under the secret c0..df.
const char* const kHello =
    "36 00 00 00"                                      // frame length 54
    "4b 56 58 42 01 00 00 00"                          // magic "KVXB", version 1, 0
    "01 00 00 00 02 00 00 00"                          // rank 1, nranks 2
    "c0 c1 c2 c3 c4 c5 c6 c7 c8 c9 ca cb cc cd ce cf"  // secret
    "d0 d1 d2 d3 d4 d5 d6 d7 d8 d9 da db dc dd de df"
    "02 00 00 00 6b 76";  // payload length 2, "kv"
// The table for 2 ranks: "r0", "kv".
const char* const kTable2 =
    "18 00 00 00"              // frame length 24
    "4b 56 58 42 01 00 00 00"  // magic, version 1, status 0 OK
    "02 00 00 00"              // nranks 2
    "02 00 00 00 72 30"        // rank 0: "r0"
    "02 00 00 00 6b 76";       // rank 1: "kv"

TEST(WireBytes, BootstrapHelloIsFixedAndTheTableParses) {
  FakeRoot root;
  ASSERT_TRUE(root.ok());
  auto served = std::async(std::launch::async, [&] { return root.serve(hex(kTable2)); });
  transport::AddressTable table;
  const uint8_t payload[2] = {'k', 'v'};
  ASSERT_EQ(transport::bootstrap_connect(root.id(), 1, 2, 5000, payload, 2, &table), KVXFER_SUCCESS)
      << last_error();
  EXPECT_EQ(to_hex(served.get()), to_hex(hex(kHello)));
  ASSERT_EQ(table.size(), 2u);
  EXPECT_EQ(table[0], (Bytes{'r', '0'}));
  EXPECT_EQ(table[1], (Bytes{'k', 'v'}));
}

TEST(WireBytes, BootstrapTimeoutStatusParses) {
  FakeRoot root;
  ASSERT_TRUE(root.ok());
  auto served = std::async(std::launch::async, [&] {
    return root.serve(
        hex("0c 00 00 00 4b 56 58 42 01 00"
            "01 00"           // status 1: the root timed out
            "02 00 00 00"));  // nranks 2
  });
  transport::AddressTable table;
  const uint8_t payload[2] = {'k', 'v'};
  EXPECT_EQ(transport::bootstrap_connect(root.id(), 1, 2, 5000, payload, 2, &table),
            KVXFER_ERR_TIMEOUT);
  EXPECT_NE(std::string(last_error()).find("timed out waiting for the other ranks"),
            std::string::npos)
      << last_error();
  EXPECT_EQ(to_hex(served.get()), to_hex(hex(kHello)));
}

/** A raw connection to a real root, with timeouts. */
int connect_to(const transport::UniqueId& id) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  set_timeouts(fd);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = id.port;
  std::memcpy(&sa.sin_addr, id.addr, 4);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

/** kHello with the rank, nranks and the real root's secret patched in. */
Bytes hello_for(const transport::UniqueId& id, uint8_t rank, uint8_t nranks) {
  Bytes h = hex(kHello);
  h[4 + 8] = rank;
  h[4 + 12] = nranks;
  std::memcpy(h.data() + 4 + 16, id.secret, transport::kBootstrapSecretBytes);
  return h;
}

TEST(WireBytes, RootParsesTheHelloAndSendsAFixedTable) {
  transport::UniqueId id;
  std::unique_ptr<transport::BootstrapRoot> root;
  ASSERT_EQ(transport::create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto accepted = std::async(std::launch::async, [&] { return root->accept_all(1, 5000); });
  const int fd = connect_to(id);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(send_bytes(fd, hello_for(id, 0, 1)));
  const Bytes table = recv_frame(fd);
  ::close(fd);
  EXPECT_EQ(accepted.get(), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(to_hex(table), to_hex(hex("12 00 00 00"              // frame length 18
                                      "4b 56 58 42 01 00 00 00"  // magic, version 1, OK
                                      "01 00 00 00"              // nranks 1
                                      "02 00 00 00 6b 76")));    // rank 0: "kv"
}

TEST(WireBytes, RootSendsAFixedTimeoutStatus) {
  transport::UniqueId id;
  std::unique_ptr<transport::BootstrapRoot> root;
  ASSERT_EQ(transport::create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto accepted = std::async(std::launch::async, [&] { return root->accept_all(2, 300); });
  const int fd = connect_to(id);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(send_bytes(fd, hello_for(id, 0, 2)));  // rank 1 never comes
  const Bytes status = recv_frame(fd);
  ::close(fd);
  EXPECT_EQ(accepted.get(), KVXFER_ERR_TIMEOUT);
  EXPECT_EQ(to_hex(status), to_hex(hex("0c 00 00 00 4b 56 58 42 01 00"
                                       "01 00"            // status 1: timed out
                                       "02 00 00 00")));  // nranks 2
}

// Fail fast: a failure report is a hello with flags 1 and the reason as its
// payload; the root answers every rank with status 3, the failed rank and
// the reason.
// The failure report of rank 1 of 2, reason "no nic", under the secret c0..df.
const char* const kFailedHello =
    "3a 00 00 00"                                      // frame length 58
    "4b 56 58 42 01 00 01 00"                          // magic, version 1, flags 1: failed
    "01 00 00 00 02 00 00 00"                          // rank 1, nranks 2
    "c0 c1 c2 c3 c4 c5 c6 c7 c8 c9 ca cb cc cd ce cf"  // secret
    "d0 d1 d2 d3 d4 d5 d6 d7 d8 d9 da db dc dd de df"
    "06 00 00 00 6e 6f 20 6e 69 63";  // reason length 6, "no nic"
// The rank-failed status for 2 ranks: rank 1 failed, "no nic".
const char* const kRankFailed2 =
    "1a 00 00 00"                     // frame length 26
    "4b 56 58 42 01 00 03 00"         // magic, version 1, status 3: a rank failed
    "02 00 00 00"                     // nranks 2
    "01 00 00 00"                     // failed rank 1
    "06 00 00 00 6e 6f 20 6e 69 63";  // reason length 6, "no nic"

TEST(WireBytes, BootstrapFailureReportIsFixed) {
  FakeRoot root;
  ASSERT_TRUE(root.ok());
  auto served = std::async(std::launch::async, [&] { return root.serve(hex(kRankFailed2)); });
  EXPECT_EQ(transport::bootstrap_report_failure(root.id(), 1, 2, 5000, "no nic"), KVXFER_SUCCESS)
      << last_error();
  EXPECT_EQ(to_hex(served.get()), to_hex(hex(kFailedHello)));
}

TEST(WireBytes, BootstrapRankFailedStatusParses) {
  FakeRoot root;
  ASSERT_TRUE(root.ok());
  Bytes reply = hex(kRankFailed2);
  reply[4 + 12] = 0;  // rank 0 failed, as rank 1 hears it
  auto served = std::async(std::launch::async, [&] { return root.serve(reply); });
  transport::AddressTable table;
  const uint8_t payload[2] = {'k', 'v'};
  EXPECT_EQ(transport::bootstrap_connect(root.id(), 1, 2, 5000, payload, 2, &table),
            KVXFER_ERR_SYSTEM);
  EXPECT_NE(std::string(last_error()).find("bootstrap: rank 0 failed: no nic"), std::string::npos)
      << last_error();
  EXPECT_TRUE(table.empty());
  EXPECT_EQ(to_hex(served.get()), to_hex(hex(kHello)));
}

TEST(WireBytes, BootstrapMalformedRankFailedStatusIsCorrupt) {
  for (int k = 0; k < 3; ++k) {
    FakeRoot root;
    ASSERT_TRUE(root.ok());
    Bytes reply = hex(kRankFailed2);
    if (k == 0) reply[4 + 12] = 2;  // failed rank out of range
    if (k == 1) reply[4 + 16] = 7;  // reason longer than the frame
    if (k == 2) {                   // truncated before the reason length
      reply.resize(4 + 16);
      reply[0] = 16;
    }
    auto served = std::async(std::launch::async, [&] { return root.serve(reply); });
    transport::AddressTable table;
    const uint8_t payload[2] = {'k', 'v'};
    EXPECT_EQ(transport::bootstrap_connect(root.id(), 1, 2, 5000, payload, 2, &table),
              KVXFER_ERR_CORRUPT)
        << k << ": " << last_error();
    served.get();
  }
}

TEST(WireBytes, RootSendsAFixedRankFailedStatus) {
  transport::UniqueId id;
  std::unique_ptr<transport::BootstrapRoot> root;
  ASSERT_EQ(transport::create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto accepted = std::async(std::launch::async, [&] { return root->accept_all(2, 5000); });
  const int r0 = connect_to(id);
  ASSERT_GE(r0, 0);
  ASSERT_TRUE(send_bytes(r0, hello_for(id, 0, 2)));
  const int r1 = connect_to(id);
  ASSERT_GE(r1, 0);
  Bytes report = hex(kFailedHello);
  std::memcpy(report.data() + 4 + 16, id.secret, transport::kBootstrapSecretBytes);
  ASSERT_TRUE(send_bytes(r1, report));
  const Bytes to_r0 = recv_frame(r0), to_r1 = recv_frame(r1);
  ::close(r0);
  ::close(r1);
  EXPECT_EQ(accepted.get(), KVXFER_ERR_SYSTEM);
  EXPECT_EQ(to_hex(to_r0), to_hex(hex(kRankFailed2)));
  EXPECT_EQ(to_hex(to_r1), to_hex(hex(kRankFailed2)));
}

TEST(WireBytes, RootRefusesUnknownHelloFlags) {
  transport::UniqueId id;
  std::unique_ptr<transport::BootstrapRoot> root;
  ASSERT_EQ(transport::create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto accepted = std::async(std::launch::async, [&] { return root->accept_all(1, 5000); });
  int fd = connect_to(id);
  ASSERT_GE(fd, 0);
  Bytes h = hello_for(id, 0, 1);
  h[4 + 6] = 2;  // a flag this version does not know
  ASSERT_TRUE(send_bytes(fd, h));
  EXPECT_TRUE(recv_frame(fd).empty());  // closed, no answer
  ::close(fd);
  fd = connect_to(id);  // the slot is still free
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(send_bytes(fd, hello_for(id, 0, 1)));
  EXPECT_FALSE(recv_frame(fd).empty());
  ::close(fd);
  EXPECT_EQ(accepted.get(), KVXFER_SUCCESS) << last_error();
}

// The final status round (accept_all with final_round): on the same
// connection after the table, the rank sends READY (status 4, its rank, no
// reason) or RANK_FAILED (status 3, its rank, the reason: the same bytes as
// the root's kRankFailed2); the root answers READY (header only) when every
// rank is ready.
const char* const kReady1of2 =
    "14 00 00 00"               // frame length 20
    "4b 56 58 42 01 00 04 00"   // magic, version 1, status 4: READY
    "02 00 00 00"               // nranks 2
    "01 00 00 00 00 00 00 00";  // rank 1, no reason
const char* const kAllReady2 =
    "0c 00 00 00 4b 56 58 42 01 00"
    "04 00"         // status 4: every rank is ready
    "02 00 00 00";  // nranks 2

TEST(WireBytes, BootstrapFinalStatusesAreFixed) {
  for (bool ok : {true, false}) {
    FakeRoot root;
    ASSERT_TRUE(root.ok());
    const Bytes verdict = hex(ok ? kAllReady2 : kRankFailed2);
    auto served =
        std::async(std::launch::async, [&] { return root.serve_final(hex(kTable2), verdict); });
    transport::AddressTable table;
    std::unique_ptr<transport::BootstrapSession> session;
    const uint8_t payload[2] = {'k', 'v'};
    ASSERT_EQ(transport::bootstrap_connect(root.id(), 1, 2, 5000, payload, 2, &table, &session),
              KVXFER_SUCCESS)
        << last_error();
    ASSERT_EQ(session->report(ok ? nullptr : "no nic"), KVXFER_SUCCESS) << last_error();
    bool ready = false;
    kvxfer_result_t r = KVXFER_SUCCESS;
    for (int i = 0; i < 5000 && r == KVXFER_SUCCESS && !ready; ++i) {
      r = session->poll(&ready);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (ok) {
      EXPECT_EQ(r, KVXFER_SUCCESS) << last_error();
      EXPECT_TRUE(ready);
    } else {
      EXPECT_EQ(r, KVXFER_ERR_SYSTEM);
      EXPECT_NE(std::string(last_error()).find("rank 1 failed: no nic"), std::string::npos)
          << last_error();
    }
    session.reset();
    const auto [hello, status] = served.get();
    EXPECT_EQ(to_hex(hello), to_hex(hex(kHello)));
    EXPECT_EQ(to_hex(status), to_hex(hex(ok ? kReady1of2 : kRankFailed2)));
  }
}

TEST(WireBytes, RootRunsAFixedFinalRound) {
  transport::UniqueId id;
  std::unique_ptr<transport::BootstrapRoot> root;
  ASSERT_EQ(transport::create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto accepted = std::async(std::launch::async, [&] { return root->accept_all(2, 5000, true); });
  const int r0 = connect_to(id), r1 = connect_to(id);
  ASSERT_GE(r0, 0);
  ASSERT_GE(r1, 0);
  Bytes h0 = hello_for(id, 0, 2);
  h0[4 + 52] = 'r';  // payload "r0"
  h0[4 + 53] = '0';
  ASSERT_TRUE(send_bytes(r0, h0));
  ASSERT_TRUE(send_bytes(r1, hello_for(id, 1, 2)));
  EXPECT_EQ(to_hex(recv_frame(r0)), to_hex(hex(kTable2)));
  EXPECT_EQ(to_hex(recv_frame(r1)), to_hex(hex(kTable2)));
  Bytes ready0 = hex(kReady1of2);
  ready0[4 + 12] = 0;  // rank 0
  ASSERT_TRUE(send_bytes(r0, ready0));
  ASSERT_TRUE(send_bytes(r1, hex(kReady1of2)));
  EXPECT_EQ(to_hex(recv_frame(r0)), to_hex(hex(kAllReady2)));
  EXPECT_EQ(to_hex(recv_frame(r1)), to_hex(hex(kAllReady2)));
  ::close(r0);
  ::close(r1);
  EXPECT_EQ(accepted.get(), KVXFER_SUCCESS) << last_error();
}

// ---------------------------------------------------------------------------
// The peer_message_fuzz corpus (tests/data/fuzz-peer/, fuzz/README.md),
// through the same checks, without sanitizers; each seed ends as it should.
// ---------------------------------------------------------------------------
TEST(PeerMessages, CorpusReplaysWithoutViolations) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(KVXFER_TEST_DATA_DIR) / "fuzz-peer";
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  size_t seeds = 0, complete = 0;
  for (const auto& f : files) {
    const std::string name = f.filename().string();
    SCOPED_TRACE(name);
    std::ifstream in(f, std::ios::binary);
    const Bytes data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const fuzz::peer::Outcome o = fuzz::peer::play(data.data(), data.size());
    EXPECT_EQ(o.violation, "");
    complete += o.stage == KVXFER_STAGE_COMPLETE;
    if (name.rfind("seed-", 0) != 0) continue;
    ++seeds;
    if (name.find("peer-failed") != std::string::npos) {
      EXPECT_EQ(o.stage, KVXFER_STAGE_ERROR);
      EXPECT_EQ(o.result, KVXFER_ERR_CORRUPT) << o.error;
    } else if (name.find("cancelled") != std::string::npos) {
      EXPECT_EQ(o.stage, KVXFER_STAGE_ERROR);
      EXPECT_EQ(o.result, KVXFER_ERR_CANCELLED) << o.error;
    } else {
      EXPECT_EQ(o.stage, KVXFER_STAGE_COMPLETE) << o.error;
    }
  }
  EXPECT_GE(seeds, 15u) << "the seeds (make_fuzz_seeds <dir> tests/data/fuzz-peer) are missing";
  EXPECT_GE(complete, 11u);
}

// A sender whose every page message is empty (it gave up), or that sends no
// page at all, and then reports success: the receive fails at once.  It used
// to wait for ever, with no receive left for the link's timeout to expire.
TEST(PeerMessages, ASenderReportingSuccessBeforeTheReceiveCompletedFailsIt) {
  for (const bool gave_up : {true, false}) {
    SCOPED_TRACE(gave_up ? "empty pages, then STATUS ok" : "STATUS ok before any page");
    const uint8_t flags = 0x02;  // this rank receives 5 tokens of bf16 (peer_message_check.h)
    xfer::Desc d;
    d.is_sender = true;
    d.tag = fuzz::peer::kTag;
    d.num_layers = fuzz::peer::kLayers;
    d.kv_heads = fuzz::peer::kHeads;
    d.head_dim = fuzz::peer::kHeadDim;
    d.num_tokens = 5;
    d.codec = KVXFER_CODEC_CONFIG_INITIALIZER;
    d.mode = KVXFER_MODE_PROGRESSIVE;
    d.page_tokens = 8;
    Bytes in{flags};
    auto add = [&](xfer::MsgKind kind, uint32_t page, const Bytes& body) {
      in.push_back(static_cast<uint8_t>(kind));
      in.push_back(static_cast<uint8_t>(page));
      in.push_back(static_cast<uint8_t>(page >> 8));
      in.push_back(static_cast<uint8_t>(body.size()));
      in.push_back(static_cast<uint8_t>(body.size() >> 8));
      in.insert(in.end(), body.begin(), body.end());
    };
    add(xfer::MsgKind::kDesc, 0, xfer::encode_desc(d));
    const size_t pages = xfer::plan_pages(d.num_layers, d.num_tokens, d.page_tokens).size();
    ASSERT_EQ(pages, 4u);
    for (uint32_t i = 0; gave_up && i < pages; ++i) {
      add(xfer::MsgKind::kAnchor, i, {});
      add(xfer::MsgKind::kResidual, i, {});
    }
    add(xfer::MsgKind::kStatus, 0, xfer::encode_status(KVXFER_SUCCESS, ""));
    const fuzz::peer::Outcome o = fuzz::peer::play(in.data(), in.size());
    EXPECT_EQ(o.violation, "");
    EXPECT_EQ(o.stage, KVXFER_STAGE_ERROR);
    EXPECT_EQ(o.result, KVXFER_ERR_CORRUPT) << o.error;
    EXPECT_NE(o.error.find("reported success before this receive"), std::string::npos) << o.error;
  }
}

// One request by id 77 of an Engine::testing_unlinked engine (rank 1; its
// peer 0 is played here): 5 tokens of bf16 KV in blocks of its own.
struct UnlinkedById : fuzz::peer::Harness {
  UnlinkedById() {
    using namespace fuzz::peer;
    engine = xfer::Engine::testing_unlinked(1, 2);
    m = engine->testing_impl();
    blocks.assign(4, std::vector<uint8_t>(kBlock * kHeads * kHeadDim * 2, 0x3f));
    k = {blocks[0].data(), blocks[1].data()};
    v = {blocks[2].data(), blocks[3].data()};
  }

  kvxfer_result_t post(bool is_send, std::shared_ptr<xfer::Request>* out) {
    using namespace fuzz::peer;
    kvxfer_kv_desc_t kv = KVXFER_KV_DESC_INITIALIZER;
    kv.num_layers = kLayers;
    kv.kv_heads = kHeads;
    kv.head_dim = kHeadDim;
    kv.dtype = KVXFER_DTYPE_BF16;
    kv.num_tokens = 5;
    kv.block_size = kBlock;
    kv.num_blocks = 1;
    kv.k_blocks = k.data();
    kv.v_blocks = v.data();
    kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
    rc.match_by_id = 1;
    rc.request_id = 77;
    const kvxfer_codec_config_t codec = KVXFER_CODEC_CONFIG_INITIALIZER;
    const kvxfer_result_t r =
        engine->post(is_send, 0, &kv, is_send ? &codec : nullptr, &rc, nullptr, out);
    m->step();
    return r;
  }
  /** Runs the codec jobs (a send encodes from its post), completes every
   *  send, and runs a progress round. */
  void complete_sends() {
    for (auto& q : m->jobs)
      while (!q.empty()) {
        xfer::Job j = std::move(q.front());
        q.pop_front();
        m->run_job(j);
      }
    Harness::complete_sends(false);
    m->step();
  }
  /** The peer's message `b` into this side's receive of `tag`; false if none is posted. */
  bool deliver(uint64_t tag, const Bytes& b) {
    done.resize(m->testing_posts.size(), false);
    for (size_t i = 0; i < m->testing_posts.size(); ++i) {
      const auto& p = m->testing_posts[i];
      if (done[i] || p.is_send || p.tag != tag || p.len < b.size()) continue;
      if (!b.empty()) std::memcpy(p.buf, b.data(), b.size());
      complete(i, KVXFER_SUCCESS, b.size());
      m->step();
      return true;
    }
    return false;
  }
  /** The peer's ASK of id 77 (the ask stream's receive is the engine's own). */
  void ask() {
    xfer::PeerIo& pi = m->io(0);
    const Bytes b = xfer::encode_ask(77);
    std::memcpy(pi.ask_in.data(), b.data(), b.size());
    transport::Completion c;
    c.bytes = b.size();
    m->on_ask(0, c);
    m->step();
  }
  /** The WITHDRAW answers this side posted: the ask numbers they name. */
  std::vector<uint16_t> answers() const {
    std::vector<uint16_t> out;
    for (const auto& p : m->testing_posts) {
      uint64_t id = 0;
      uint32_t seq = 0;
      uint16_t n = 0;
      kvxfer_result_t why = KVXFER_SUCCESS;
      if (p.is_send && p.len == xfer::kRdvBytes &&
          xfer::decode_rdv(p.buf, p.len, &id, &seq, &why, &n) == KVXFER_SUCCESS &&
          seq == xfer::kRdvSeq && id == 77 && why < 0)
        out.push_back(n);
    }
    return out;
  }
  static std::pair<kvxfer_stage_t, std::string> stage(const std::shared_ptr<xfer::Request>& r) {
    std::lock_guard<std::mutex> lk(r->mu);
    return {r->stage, r->error};
  }
};

// The answer to an ask (a WITHDRAW of seq kRdvSeq) names the ask it
// answers.  One that comes after its receive was cancelled, and a new
// receive of the id asked again, leaves the new receive alone (its sender's
// send, posted again, may take it); the answer to the new ask fails it.
// (A break-it run saw the stale answer fail the new receive, 2 times in 150.)
TEST(PeerMessages, AnAnswerToAnEarlierAskLeavesALaterReceiveAlone) {
  UnlinkedById e;
  std::shared_ptr<xfer::Request> r1, r2;
  ASSERT_EQ(e.post(false, &r1), KVXFER_SUCCESS) << last_error();  // it asks (ask 0)
  ASSERT_EQ(xfer::request_cancel(r1), KVXFER_SUCCESS);
  e.m->step();
  e.complete_sends();
  ASSERT_EQ(e.stage(r1).first, KVXFER_STAGE_ERROR);
  ASSERT_EQ(e.post(false, &r2), KVXFER_SUCCESS) << last_error();  // it asks again (ask 1)
  e.complete_sends();
  const auto answer = [](uint16_t ask) {
    return xfer::encode_withdraw(77, xfer::kRdvSeq, KVXFER_ERR_CANCELLED, ask);
  };
  const auto stream = [](uint32_t n) {
    return xfer::make_tag(xfer::kRdvSeq, false, xfer::MsgKind::kStatus, n);
  };
  ASSERT_TRUE(e.deliver(stream(0), answer(0)));  // the answer to r1's ask
  EXPECT_NE(e.stage(r2).first, KVXFER_STAGE_ERROR) << e.stage(r2).second;
  ASSERT_TRUE(e.deliver(stream(1), answer(1)));  // the answer to r2's
  EXPECT_EQ(e.stage(r2).first, KVXFER_STAGE_ERROR);
  EXPECT_NE(e.stage(r2).second.find("withdrew the kvxfer_send of request id 77"), std::string::npos)
      << e.stage(r2).second;
}

// An ask that comes while the send of its id runs waits for it.  When the
// send then fails before its receiver's DESC (the receiver refused it: the
// receive whose ask took it was cancelled), the ask is answered, and so is
// one that comes after; before, they were dropped and their receives waited
// for the timeout.
TEST(PeerMessages, AnAskWhileItsSendRunsIsAnsweredWhenTheSendIsRefused) {
  UnlinkedById e;
  std::shared_ptr<xfer::Request> s;
  ASSERT_EQ(e.post(true, &s), KVXFER_SUCCESS) << last_error();  // its RDV, DESC and receives
  e.complete_sends();
  e.ask();  // ask 0, while the send waits for its receiver's DESC
  EXPECT_TRUE(e.answers().empty());
  const uint64_t status = xfer::make_tag(s->seq, true, xfer::MsgKind::kStatus, 0);
  const uint64_t desc = xfer::make_tag(s->seq, true, xfer::MsgKind::kDesc, 0);
  ASSERT_TRUE(e.deliver(status, xfer::encode_status(KVXFER_ERR_CANCELLED, "cancelled")));
  ASSERT_TRUE(e.deliver(desc, {}));  // the refusal's empty DESC
  EXPECT_EQ(e.answers(), std::vector<uint16_t>{0});
  e.ask();  // ask 1, after the send failed
  EXPECT_EQ(e.answers(), (std::vector<uint16_t>{0, 1}));
  e.complete_sends();
  EXPECT_EQ(e.stage(s).first, KVXFER_STAGE_ERROR) << e.stage(s).second;
}

}  // namespace
}  // namespace kvxfer
