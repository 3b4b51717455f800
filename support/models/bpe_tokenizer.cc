#include "models/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstdio>
#include <queue>
#include <utility>

#include "models/gguf.h"

namespace kvxfer::model {

namespace {

void set_error(std::string* error, std::string message) {
  if (error != nullptr) *error = std::move(message);
}

// GPT-2's bytes_to_unicode: the printable bytes 0x21..0x7e, 0xa1..0xac and
// 0xae..0xff stand for themselves; the other 68 bytes, in increasing order,
// become U+0100, U+0101, ...
std::uint32_t byte_to_codepoint(std::uint8_t b) {
  if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae) return b;
  std::uint32_t n = 0;
  for (std::uint32_t c = 0; c < b; ++c) {
    if (!((c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || c >= 0xae)) ++n;
  }
  return 0x100 + n;
}

void append_utf8(std::uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

// Length of the well-formed UTF-8 sequence at p[0..n) (Unicode table 3-7),
// or 0 when none starts there.  *cp receives the code point.
std::size_t utf8_sequence(const unsigned char* p, std::size_t n, std::uint32_t* cp) {
  const unsigned char b0 = p[0];
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  auto cont = [&](std::size_t i, unsigned char lo, unsigned char hi) {
    return i < n && p[i] >= lo && p[i] <= hi;
  };
  if (b0 >= 0xc2 && b0 <= 0xdf) {
    if (!cont(1, 0x80, 0xbf)) return 0;
    *cp = (b0 & 0x1fu) << 6 | (p[1] & 0x3fu);
    return 2;
  }
  if (b0 >= 0xe0 && b0 <= 0xef) {
    const unsigned char lo = b0 == 0xe0 ? 0xa0 : 0x80;  // no overlong forms
    const unsigned char hi = b0 == 0xed ? 0x9f : 0xbf;  // no surrogates
    if (!cont(1, lo, hi) || !cont(2, 0x80, 0xbf)) return 0;
    *cp = (b0 & 0x0fu) << 12 | (p[1] & 0x3fu) << 6 | (p[2] & 0x3fu);
    return 3;
  }
  if (b0 >= 0xf0 && b0 <= 0xf4) {
    const unsigned char lo = b0 == 0xf0 ? 0x90 : 0x80;  // no overlong forms
    const unsigned char hi = b0 == 0xf4 ? 0x8f : 0xbf;  // nothing above U+10FFFF
    if (!cont(1, lo, hi) || !cont(2, 0x80, 0xbf) || !cont(3, 0x80, 0xbf)) return 0;
    *cp = (b0 & 0x07u) << 18 | (p[1] & 0x3fu) << 12 | (p[2] & 0x3fu) << 6 | (p[3] & 0x3fu);
    return 4;
  }
  return 0;
}

std::string quoted(std::string_view s) {
  std::string out = "'";
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  out += "'";
  return out;
}

// The GPT-2 pre-tokenizer pattern with \s spelled as Oniguruma's Unicode
// whitespace (U+0009..U+000D, U+0085, Zs, Zl, Zp); PCRE2's \s would add
// U+180E.
constexpr char kGpt2Pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d"
    "| ?\\p{L}+"
    "| ?\\p{N}+"
    "| ?[^\\t-\\r\\x{85}\\p{Z}\\p{L}\\p{N}]+"
    "|[\\t-\\r\\x{85}\\p{Z}]+(?![^\\t-\\r\\x{85}\\p{Z}])"
    "|[\\t-\\r\\x{85}\\p{Z}]+";
// Digits(individual_digits=true): Rust's char::is_numeric, categories Nd Nl No.
constexpr char kDigitPattern[] = "\\p{N}";

}  // namespace

struct BpeTokenizer::Regex {
  pcre2_code* gpt2 = nullptr;
  pcre2_code* digit = nullptr;
  ~Regex() {
    pcre2_code_free(gpt2);
    pcre2_code_free(digit);
  }
};

namespace {

pcre2_code* compile(const char* pattern, std::string* error) {
  int code = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                                 PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
  if (re == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(code, msg, sizeof msg);
    set_error(error, "tokenizer: PCRE2 cannot compile the pre-tokenizer pattern at offset " +
                         std::to_string(offset) + ": " + reinterpret_cast<const char*>(msg));
    return nullptr;
  }
  // The JIT is an optimisation only: without it (a build without JIT
  // support) pcre2_match interprets the same pattern.
  (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
  return re;
}

// RAII for one encode call's match data (not shareable between threads).
struct MatchData {
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  ~MatchData() { pcre2_match_data_free(md); }
};

// One match of `re` in subject[0..n) at or after `start`: true with
// [*begin, *end); false with *rc = PCRE2_ERROR_NOMATCH or another error.
bool find(const pcre2_code* re, const char* subject, std::size_t n, std::size_t start,
          pcre2_match_data* md, std::size_t* begin, std::size_t* end, int* rc) {
  *rc = pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(subject), n, start, PCRE2_NO_UTF_CHECK, md,
                    nullptr);
  if (*rc < 0) return false;
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
  *begin = ov[0];
  *end = ov[1];
  return true;
}

std::string match_error(int rc) {
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(rc, msg, sizeof msg);
  return std::string("tokenizer: PCRE2 match failed: ") + reinterpret_cast<const char*>(msg);
}

// Scratch space of one encode call's BPE merges.
struct Symbol {
  std::int32_t id;
  std::int32_t prev;  // -1: none
  std::int32_t next;  // -1: none
  bool alive;
};
struct Candidate {
  std::uint32_t rank;
  std::int32_t pos;  // left symbol
  std::int32_t new_id;
  // std::priority_queue is a max-heap: the greatest is the lowest rank, then
  // the leftmost position (HF tokenizers' Merge ordering).
  bool operator<(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

}  // namespace

struct BpeScratch {
  std::vector<Symbol> symbols;
  std::priority_queue<Candidate> queue;
  MatchData match;
};

BpeTokenizer::BpeTokenizer() = default;
BpeTokenizer::~BpeTokenizer() = default;

std::unique_ptr<BpeTokenizer> BpeTokenizer::create(const std::vector<std::string>& tokens,
                                                   const std::vector<std::int32_t>& token_types,
                                                   const std::vector<std::string>& merges,
                                                   std::int32_t bos_id, std::int32_t eos_id,
                                                   std::int32_t unk_id, std::string* error) {
  if (tokens.empty() || tokens.size() > 0x7fffffffu) {
    set_error(error, "tokenizer: " + std::to_string(tokens.size()) + " tokens (need 1 .. 2^31-1)");
    return nullptr;
  }
  if (token_types.size() != tokens.size()) {
    set_error(error, "tokenizer: " + std::to_string(token_types.size()) + " token types for " +
                         std::to_string(tokens.size()) + " tokens");
    return nullptr;
  }
  const auto n = static_cast<std::int32_t>(tokens.size());
  auto in_range = [n](std::int32_t id) { return id >= 0 && id < n; };
  if (!in_range(bos_id) || !in_range(eos_id) || !(unk_id == -1 || in_range(unk_id))) {
    set_error(error, "tokenizer: bos " + std::to_string(bos_id) + ", eos " +
                         std::to_string(eos_id) + ", unk " + std::to_string(unk_id) +
                         ": an id outside [0, " + std::to_string(n) + ")" +
                         (unk_id < -1 ? " (unk may be -1)" : ""));
    return nullptr;
  }

  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  t->tokens_ = tokens;
  t->bos_id_ = bos_id;
  t->eos_id_ = eos_id;
  t->unk_id_ = unk_id;

  // Inverse of bytes_to_unicode over U+0000..U+0143.
  constexpr std::uint32_t kSymbolLimit = 0x144;
  std::int32_t byte_of[kSymbolLimit];
  std::fill(std::begin(byte_of), std::end(byte_of), -1);
  std::string symbol_text[256];
  for (int b = 0; b < 256; ++b) {
    const std::uint32_t cp = byte_to_codepoint(static_cast<std::uint8_t>(b));
    byte_of[cp] = b;
    append_utf8(cp, &symbol_text[b]);
  }

  t->bytes_.resize(tokens.size());
  t->special_.assign(tokens.size(), false);
  t->id_of_.reserve(tokens.size());
  for (std::int32_t id = 0; id < n; ++id) {
    const std::string& text = t->tokens_[id];
    if (text.empty()) {
      set_error(error, "tokenizer: token " + std::to_string(id) + " is empty");
      return nullptr;
    }
    auto [it, inserted] = t->id_of_.emplace(std::string_view(text), id);
    if (!inserted) {
      set_error(error, "tokenizer: token " + std::to_string(id) + " " + quoted(text) +
                           " repeats token " + std::to_string(it->second));
      return nullptr;
    }
    if (token_types[id] == kTypeControl) {
      t->special_[id] = true;
      t->bytes_[id] = text;
      t->specials_.push_back(id);
      t->special_first_byte_[static_cast<unsigned char>(text[0])] = true;
      continue;
    }
    // An ordinary token: a string of byte symbols.
    const auto* p = reinterpret_cast<const unsigned char*>(text.data());
    std::string& bytes = t->bytes_[id];
    for (std::size_t i = 0; i < text.size();) {
      std::uint32_t cp = 0;
      const std::size_t len = utf8_sequence(p + i, text.size() - i, &cp);
      if (len == 0 || cp >= kSymbolLimit || byte_of[cp] < 0) {
        set_error(error, "tokenizer: token " + std::to_string(id) + " " + quoted(text) +
                             " is not byte-level BPE (byte " + std::to_string(i) +
                             " starts no byte symbol)");
        return nullptr;
      }
      bytes.push_back(static_cast<char>(byte_of[cp]));
      i += len;
    }
  }
  // Longest first, so that the first special matching at a position is the
  // longest there (ties: lower id).
  std::stable_sort(t->specials_.begin(), t->specials_.end(), [&](std::int32_t a, std::int32_t b) {
    return t->tokens_[a].size() > t->tokens_[b].size();
  });
  for (int b = 0; b < 256; ++b) {
    const std::int32_t id = t->token_id(symbol_text[b]);
    t->byte_token_[b] = id >= 0 && !t->special_[id] ? id : -1;
  }

  t->merges_.reserve(merges.size());
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& m = merges[rank];
    const std::size_t space = m.find(' ');
    auto fail = [&](const std::string& why) {
      set_error(error, "tokenizer: merge " + std::to_string(rank) + " " + quoted(m) + ": " + why);
    };
    if (space == std::string::npos || space == 0 || space + 1 == m.size() ||
        m.find(' ', space + 1) != std::string::npos) {
      fail("not two tokens separated by one space");
      return nullptr;
    }
    const std::string_view left(m.data(), space);
    const std::string_view right(m.data() + space + 1, m.size() - space - 1);
    const std::int32_t l = t->token_id(left), r = t->token_id(right);
    if (l < 0 || r < 0) {
      fail(quoted(l < 0 ? left : right) + " is not a token");
      return nullptr;
    }
    std::string joined(left);
    joined += right;
    const std::int32_t merged = t->token_id(joined);
    if (merged < 0) {
      fail(quoted(joined) + " is not a token");
      return nullptr;
    }
    const std::uint64_t key = static_cast<std::uint64_t>(l) << 32 | static_cast<std::uint32_t>(r);
    const std::uint64_t value =
        static_cast<std::uint64_t>(rank) << 32 | static_cast<std::uint32_t>(merged);
    auto [it, inserted] = t->merges_.emplace(key, value);
    if (!inserted) {
      fail("repeats merge " + std::to_string(it->second >> 32));
      return nullptr;
    }
  }

  t->regex_ = std::make_unique<Regex>();
  t->regex_->gpt2 = compile(kGpt2Pattern, error);
  if (t->regex_->gpt2 == nullptr) return nullptr;
  t->regex_->digit = compile(kDigitPattern, error);
  if (t->regex_->digit == nullptr) return nullptr;
  return t;
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_gguf(const gguf::File& file, std::string* error) {
  // The reader's messages name the file and the key already; ours add them.
  std::string why;
  auto pass = [&]() {
    set_error(error, why);
    return nullptr;
  };
  auto fail = [&](const std::string& message) {
    set_error(error, "gguf '" + file.path() + "': " + message);
    return nullptr;
  };
  std::string model, pre;
  if (!file.get_string("tokenizer.ggml.model", &model, &why)) return pass();
  if (model != "gpt2") {
    return fail("tokenizer.ggml.model is " + quoted(model) +
                ", not 'gpt2' (the byte-level BPE implemented here)");
  }
  if (!file.get_string("tokenizer.ggml.pre", &pre, &why)) return pass();
  if (pre != "smollm") {
    return fail("tokenizer.ggml.pre is " + quoted(pre) +
                ": unknown pre-tokenizer (implemented: 'smollm')");
  }
  std::vector<std::string> tokens, merges;
  std::vector<std::int32_t> types;
  std::uint32_t bos = 0, eos = 0;
  if (!file.get_string_array("tokenizer.ggml.tokens", &tokens, &why) ||
      !file.get_i32_array("tokenizer.ggml.token_type", &types, &why) ||
      !file.get_string_array("tokenizer.ggml.merges", &merges, &why) ||
      !file.get_u32("tokenizer.ggml.bos_token_id", &bos, &why) ||
      !file.get_u32("tokenizer.ggml.eos_token_id", &eos, &why)) {
    return pass();
  }
  std::int32_t unk_id = -1;
  if (file.has("tokenizer.ggml.unknown_token_id")) {
    std::uint32_t unk = 0;
    if (!file.get_u32("tokenizer.ggml.unknown_token_id", &unk, &why)) return pass();
    if (unk >= tokens.size()) {
      return fail("tokenizer.ggml.unknown_token_id " + std::to_string(unk) + " is not below " +
                  std::to_string(tokens.size()) + " tokens");
    }
    unk_id = static_cast<std::int32_t>(unk);
  }
  bool add_bos = false;
  if (file.has("tokenizer.ggml.add_bos_token") &&
      !file.get_bool("tokenizer.ggml.add_bos_token", &add_bos, &why)) {
    return pass();
  }
  for (auto [key, id] : {std::pair<const char*, std::uint32_t>{"bos_token_id", bos},
                         std::pair<const char*, std::uint32_t>{"eos_token_id", eos}}) {
    if (id >= tokens.size()) {
      return fail(std::string("tokenizer.ggml.") + key + " " + std::to_string(id) +
                  " is not below " + std::to_string(tokens.size()) + " tokens");
    }
  }
  auto t = create(tokens, types, merges, static_cast<std::int32_t>(bos),
                  static_cast<std::int32_t>(eos), unk_id, &why);
  if (!t) return fail(why);
  t->add_bos_ = add_bos;
  return t;
}

const std::string& BpeTokenizer::token_text(std::int32_t id) const {
  static const std::string kEmpty;
  return id >= 0 && id < vocab_size() ? tokens_[id] : kEmpty;
}

const std::string& BpeTokenizer::token_bytes(std::int32_t id) const {
  static const std::string kEmpty;
  return id >= 0 && id < vocab_size() ? bytes_[id] : kEmpty;
}

std::int32_t BpeTokenizer::token_id(std::string_view text) const {
  auto it = id_of_.find(text);
  return it == id_of_.end() ? -1 : it->second;
}

bool BpeTokenizer::is_special(std::int32_t id) const {
  return id >= 0 && id < vocab_size() && special_[id];
}

void BpeTokenizer::encode_piece(std::string_view piece, BpeScratch* s,
                                std::vector<std::int32_t>* ids) const {
  std::vector<Symbol>& sym = s->symbols;
  sym.clear();
  for (unsigned char b : piece) {
    std::int32_t id = byte_token_[b];
    if (id < 0) {
      if (unk_id_ < 0) continue;  // dropped
      id = unk_id_;
    }
    const auto i = static_cast<std::int32_t>(sym.size());
    sym.push_back({id, i - 1, -1, true});
    if (i > 0) sym[i - 1].next = i;
  }
  if (sym.size() > 1) {
    auto push_pair = [&](std::int32_t left) {
      const std::int32_t right = sym[left].next;
      if (right < 0) return;
      const std::uint64_t key = static_cast<std::uint64_t>(sym[left].id) << 32 |
                                static_cast<std::uint32_t>(sym[right].id);
      auto it = merges_.find(key);
      if (it == merges_.end()) return;
      s->queue.push({static_cast<std::uint32_t>(it->second >> 32), left,
                     static_cast<std::int32_t>(it->second & 0xffffffffu)});
    };
    for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(sym.size()); ++i) push_pair(i);
    while (!s->queue.empty()) {
      const Candidate c = s->queue.top();
      s->queue.pop();
      Symbol& left = sym[c.pos];
      if (!left.alive || left.next < 0) continue;
      // A stale candidate: one of its symbols changed since it was queued.
      const std::uint64_t key =
          static_cast<std::uint64_t>(left.id) << 32 | static_cast<std::uint32_t>(sym[left.next].id);
      auto it = merges_.find(key);
      if (it == merges_.end() || static_cast<std::int32_t>(it->second & 0xffffffffu) != c.new_id) {
        continue;
      }
      Symbol& right = sym[left.next];
      left.id = c.new_id;
      right.alive = false;
      left.next = right.next;
      if (right.next >= 0) sym[right.next].prev = c.pos;
      if (left.prev >= 0) push_pair(left.prev);
      push_pair(c.pos);
    }
  }
  for (std::int32_t i = sym.empty() ? -1 : 0; i >= 0; i = sym[i].next) ids->push_back(sym[i].id);
}

bool BpeTokenizer::encode_text(std::string_view text, BpeScratch* s, std::vector<std::int32_t>* ids,
                               std::string* error) const {
  // The GPT-2 pattern over one stretch without digits.
  auto split = [&](std::string_view stretch) {
    std::size_t at = 0;
    while (at < stretch.size()) {
      std::size_t b = 0, e = 0;
      int rc = 0;
      if (!find(regex_->gpt2, stretch.data(), stretch.size(), at, s->match.md, &b, &e, &rc)) {
        if (rc != PCRE2_ERROR_NOMATCH) {
          set_error(error, match_error(rc));
          return false;
        }
        b = e = stretch.size();
      }
      // Text the pattern skipped (none: every character matches one of its
      // alternatives) is a piece of its own, as HF's Isolated split keeps it.
      if (b > at) encode_piece(stretch.substr(at, b - at), s, ids);
      if (e > b) encode_piece(stretch.substr(b, e - b), s, ids);
      at = e;
    }
    return true;
  };
  // Digits(individual_digits=true) over a stretch of valid UTF-8.
  auto digits = [&](std::string_view valid) {
    std::size_t at = 0;
    while (at < valid.size()) {
      std::size_t b = 0, e = 0;
      int rc = 0;
      if (!find(regex_->digit, valid.data(), valid.size(), at, s->match.md, &b, &e, &rc)) {
        if (rc != PCRE2_ERROR_NOMATCH) {
          set_error(error, match_error(rc));
          return false;
        }
        b = e = valid.size();
      }
      if (b > at && !split(valid.substr(at, b - at))) return false;
      if (e > b) encode_piece(valid.substr(b, e - b), s, ids);
      at = e;
    }
    return true;
  };
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  std::size_t valid_from = 0;
  for (std::size_t i = 0; i < text.size();) {
    std::uint32_t cp = 0;
    const std::size_t len = utf8_sequence(p + i, text.size() - i, &cp);
    if (len > 0) {
      i += len;
      continue;
    }
    // An invalid byte: the valid text before it, then the byte alone.
    if (i > valid_from && !digits(text.substr(valid_from, i - valid_from))) return false;
    encode_piece(text.substr(i, 1), s, ids);
    valid_from = ++i;
  }
  return valid_from >= text.size() || digits(text.substr(valid_from));
}

bool BpeTokenizer::encode(std::string_view text, bool parse_special, std::vector<std::int32_t>* ids,
                          std::string* error) const {
  if (text.size() > 0x7fffffffu) {  // symbol positions are int32
    set_error(error, "tokenizer: a text of " + std::to_string(text.size()) +
                         " bytes (at most 2^31-1 per call)");
    return false;
  }
  BpeScratch scratch;
  if (scratch.match.md == nullptr) {
    set_error(error, "tokenizer: out of memory for PCRE2 match data");
    return false;
  }
  std::size_t from = 0;  // start of the text not yet encoded
  if (parse_special && !specials_.empty()) {
    for (std::size_t i = 0; i < text.size(); ++i) {
      if (!special_first_byte_[static_cast<unsigned char>(text[i])]) continue;
      for (std::int32_t id : specials_) {
        const std::string& sp = tokens_[id];
        if (text.compare(i, sp.size(), sp) != 0) continue;
        if (i > from && !encode_text(text.substr(from, i - from), &scratch, ids, error)) {
          return false;
        }
        ids->push_back(id);
        from = i + sp.size();
        i = from - 1;  // the loop's ++i resumes at `from`
        break;
      }
    }
  }
  return from >= text.size() || encode_text(text.substr(from), &scratch, ids, error);
}

bool BpeTokenizer::decode(const std::vector<std::int32_t>& ids, std::string* out,
                          std::string* error) const {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size()) {
      set_error(error, "tokenizer: id " + std::to_string(ids[i]) + " at position " +
                           std::to_string(i) + " is outside [0, " + std::to_string(vocab_size()) +
                           ")");
      return false;
    }
    *out += bytes_[ids[i]];
  }
  return true;
}

}  // namespace kvxfer::model
