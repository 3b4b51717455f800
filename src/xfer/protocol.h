// The progressive transfer protocol of kvxfer_send / kvxfer_recv
// (docs/TRANSPORT.md, "Request protocol").  Pure functions, no I/O, so every
// rule here is unit-tested on its own (tests/xfer_test.cc).
//
// A request is the i-th kvxfer_send from rank A to rank B matched with B's
// i-th kvxfer_recv from A; both sides number it `seq` (mod 2^15).  Its
// messages travel on the Link between A and B (transport/ofi.h) with the
// Link tag
//
//     seq (15 bits) | from_receiver (1) | kind (2) | page (21)      (39 bits)
//
// from_receiver keeps the two directions of one seq apart (B may at the same
// time be the sender of its own i-th request to A).  The exchange:
//
//   both   DESC    on the anchor class: the descriptor, plus the codec, mode
//                  and page size on the sender's.  The sender's at post
//                  time; the receiver's once the sender's came and its
//                  anchor store fits (KVXFER_RECV_ANCHOR_BYTES), or when it
//                  fails: it is the sender's go.  Each side compares the two
//                  (compare_desc); a mismatch fails the request on both
//                  sides with the same message.  An empty DESC from the
//                  receiver is a refusal of a request matched by id that
//                  has no receive any more: it follows the receiver's
//                  STATUS (the reason), and no page message flows.
//   sender ANCHOR p    page p's anchor section (anchor class), or in
//                      MONOLITHIC mode both sections back to back
//          RESIDUAL p  page p's residual section (residual class; PROGRESSIVE)
//   both   STATUS  once, when that side reaches its final stage: the result
//                  and its text.  The receiver's STATUS ok is what completes
//                  the sender.
//
// After a matched handshake every page message is sent and received even when
// the request has failed (a sender that cannot encode a page sends it empty),
// so that no message is left unmatched in the provider: a failure changes
// what is decoded and reported, never which messages flow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace kvxfer::xfer {

enum class MsgKind : uint64_t { kDesc = 0, kStatus = 1, kAnchor = 2, kResidual = 3 };

constexpr int kPageBits = 21;
constexpr int kKindBits = 2;
constexpr int kSeqBits = 15;
constexpr uint64_t kMaxPages = uint64_t{1} << kPageBits;
constexpr uint32_t kSeqMask = (1u << kSeqBits) - 1;
// The seq space: requests matched by order take [0, kIdSeqBase) in turn;
// requests matched by id (kvxfer_request_config_t.match_by_id) take
// [kIdSeqBase, kRdvSeq), chosen by the sender and announced on the peer's
// rendezvous stream, whose messages carry seq kRdvSeq (see RDV below).
constexpr uint32_t kIdSeqBase = 1u << (kSeqBits - 1);
constexpr uint32_t kRdvSeq = kSeqMask;

/** The Link tag of a message (layout above). */
uint64_t make_tag(uint32_t seq, bool from_receiver, MsgKind kind, uint64_t page);

/** One page: `num_tokens` tokens from `token_begin` of `layer`'s K or V. */
struct PageRef {
  int32_t layer;
  kvxfer_kv_kind_t kind;
  int64_t token_begin, num_tokens;
};

/**
 * The pages of a transfer, in send order: layer-major, K before V, tokens
 * ascending; each `page_tokens` long except the last of a (layer, kind).
 * Empty when num_tokens == 0.
 */
std::vector<PageRef> plan_pages(int32_t num_layers, int64_t num_tokens, int32_t page_tokens);

/** What each side announces in its DESC message. */
struct Desc {
  bool is_sender = false;
  uint64_t tag = 0;
  int32_t num_layers = 0, kv_heads = 0, head_dim = 0;
  kvxfer_dtype_t dtype = KVXFER_DTYPE_BF16;
  int64_t num_tokens = 0;
  // Sender only (zero on the receiver's):
  kvxfer_codec_config_t codec{};
  kvxfer_mode_t mode = KVXFER_MODE_AUTO;  // resolved: PROGRESSIVE or MONOLITHIC
  int32_t page_tokens = 0;
  // Both sides: 1 if this side's KV is on a CUDA device (a reserved byte
  // before, so a peer that does not set it reads as host memory).
  bool on_device = false;
};

constexpr size_t kDescBytes = 80;
constexpr uint32_t kDescMagic = 0x4458564bu;    // "KVXD" little-endian
constexpr uint32_t kStatusMagic = 0x5358564bu;  // "KVXS" little-endian
// 2: sink_tokens, 3: value_groups, 4: ASK, 5: WITHDRAW, 6: WITHDRAW answering an ASK
constexpr uint16_t kProtocolVersion = 6;
constexpr size_t kMaxStatusText = 1024;
constexpr size_t kStatusHeaderBytes = 16;

/** Serialises a Desc (little-endian, kDescBytes). */
std::vector<uint8_t> encode_desc(const Desc& d);
/** Parses a DESC message.  KVXFER_ERR_CORRUPT (with text) if malformed. */
kvxfer_result_t decode_desc(const uint8_t* buf, size_t len, Desc* out);

/**
 * Compares this side's descriptor with the peer's.  KVXFER_SUCCESS, or
 * KVXFER_ERR_MISMATCH with a message naming the first differing field, the
 * same on both sides (values are given as sender/receiver):
 *   "descriptor mismatch: num_tokens is 400 on the sender and 512 on the receiver".
 * Also fails when both sides are senders or both receivers.  Block size, row
 * stride and pointers are each side's own and are not compared.
 */
kvxfer_result_t compare_desc(const Desc& mine, const Desc& peer);

/**
 * STATUS flag: a receiver's refusal of an announced request after which no
 * DESC comes (Engine::Impl::refuse_rdv without its empty DESC): the
 * sender ends its DESC receive itself.  The u16 at offset 6, 0 before:
 * a peer that leaves it 0 or reads it as reserved keeps the older rule
 * (the DESC receive waits for its timeout).
 */
constexpr uint16_t kStatusNoDesc = 1;

/** STATUS message: result (i32), flags (kStatusNoDesc or 0) and text (at
 *  most kMaxStatusText bytes).  decode_status: KVXFER_ERR_CORRUPT if
 *  malformed, an unknown flag included; `flags` may be null. */
std::vector<uint8_t> encode_status(kvxfer_result_t result, const std::string& text,
                                   uint16_t flags = 0);
kvxfer_result_t decode_status(const uint8_t* buf, size_t len, kvxfer_result_t* result,
                              std::string* text, uint16_t* flags = nullptr);

/**
 * RDV: a sender's announcement of a request matched by id, "request `id`
 * travels as seq `seq`", the n-th on its peer's rendezvous stream (tag:
 * seq kRdvSeq, from_receiver 0, kind STATUS, page n mod 2^21).  The
 * receiver binds its receive of that id to `seq` and goes on as for any
 * request.  Little-endian, kRdvBytes:
 *   0 u32 magic kRdvMagic, 4 u16 version, 6 u16 0, 8 u64 id, 16 u32 seq, 20 u32 0.
 */
constexpr size_t kRdvBytes = 24;
constexpr uint32_t kRdvMagic = 0x5258564bu;  // "KVXR" little-endian
std::vector<uint8_t> encode_rdv(uint64_t id, uint32_t seq);

/**
 * WITHDRAW: on the same stream, after its RDV, a sender whose request `id`
 * (seq `seq`) failed with `why` (< 0) before the receiver's DESC came.  A
 * receiver that has no receive bound to it yet refuses it at once
 * (Engine::Impl::refuse_rdv), so the sender's id is free then, not at its
 * timeout.  With seq kRdvSeq it answers an ASK of `id` (version 6), the
 * n-th on the ask stream, `ask` = n mod 2^16 (u16 at 6): that id's send
 * withdrew, or its send to KVXFER_ANY_PEER failed before any peer took it,
 * and no send of it is posted; the receive that sent that ask fails at
 * once, not at its timeout, and a later receive of the id is not touched.
 * RDV's layout with magic kWithdrawMagic and `why` (i32) at 20.
 */
constexpr uint32_t kWithdrawMagic = 0x5758564bu;  // "KVXW" little-endian
std::vector<uint8_t> encode_withdraw(uint64_t id, uint32_t seq, kvxfer_result_t why,
                                     uint16_t ask = 0);

/**
 * Parses a message of the rendezvous stream: an RDV (*withdrawn =
 * KVXFER_SUCCESS) or a WITHDRAW (*withdrawn = its result, in
 * [KVXFER_RESULT_MIN, -1]), and the answered ask's number in *ask (may be
 * null).  KVXFER_ERR_CORRUPT (with text) if malformed or seq is outside the
 * id space (kRdvSeq only for a WITHDRAW, the only one with an ask number).
 */
kvxfer_result_t decode_rdv(const uint8_t* buf, size_t len, uint64_t* id, uint32_t* seq,
                           kvxfer_result_t* withdrawn, uint16_t* ask = nullptr);

/**
 * ASK: a receiver's request for the send of `id`, the n-th on its peer's ask
 * stream (tag: seq kRdvSeq, from_receiver 1, kind STATUS, page n mod 2^21).
 * A receive by id with no RDV of its id yet sends one; a send to
 * KVXFER_ANY_PEER goes to the first peer that asks (Engine::Impl::claim),
 * and its RDV follows as for any send by id.  Every engine keeps a receive
 * of its peers' ask streams posted.  RDV's layout with magic kAskMagic and
 * seq 0; kAskBytes.
 */
constexpr size_t kAskBytes = kRdvBytes;
constexpr uint32_t kAskMagic = 0x4158564bu;  // "KVXA" little-endian
std::vector<uint8_t> encode_ask(uint64_t id);
/** Parses an ASK; KVXFER_ERR_CORRUPT (with text) if malformed. */
kvxfer_result_t decode_ask(const uint8_t* buf, size_t len, uint64_t* id);

/** PROGRESSIVE for split codecs (code bits > anchor bits), else MONOLITHIC. */
kvxfer_mode_t resolve_mode(kvxfer_mode_t requested, const kvxfer_codec_config_t& codec);

}  // namespace kvxfer::xfer
