// Byte-level BPE tokenizer (GPT-2 style) for SmolLM2: the same ids as the
// Hugging Face `tokenizers` library with SmolLM2's tokenizer.  Checked by
// tests/tokenizer_test.cc against HF tokenizers 0.23 built from the GGUF's
// own vocabulary and merges (tests/gen_tokenizer_expect.py): fixed strings,
// 20,000 fuzz strings, every Unicode code point in context, and the texts of
// data/.
//
// encode() turns UTF-8 text into token ids in four steps, as HF tokenizers
// does with SmolLM2's tokenizer.json:
//   1. Special tokens (GGUF token_type 3: <|endoftext|>, <|im_start|>,
//      <|im_end|>, ...) are matched literally, leftmost-longest, when
//      `parse_special` is true; each becomes its own id.  With parse_special
//      false they are ordinary text.
//   2. The text between them is pre-tokenized by
//      Sequence[Digits(individual_digits=true), ByteLevel(add_prefix_space=
//      false, use_regex=true)]: every numeric character (Unicode category N)
//      is a piece on its own, and each stretch between them is split by the
//      GPT-2 pattern
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      where \s is Oniguruma's Unicode whitespace (the engine of HF
//      tokenizers): U+0009..U+000D, U+0085 and categories Zs, Zl, Zp.  The
//      pattern runs on PCRE2 (UTF + UCP), with \s spelled out as that class
//      because PCRE2's own \s also matches U+180E.
//   3. The bytes of each piece are mapped to the 256 symbols of GPT-2's
//      bytes_to_unicode table; each byte is one initial symbol.
//   4. Adjacent symbols are merged by rank (the merge list's order, lowest
//      first; among equal ranks the leftmost), until no listed pair remains.
// Bytes without a symbol: a vocabulary need not hold all 256 byte symbols
// (SmolLM2's lacks 21: 0x04 0x06 0x13 0x14 0x16 0x1d 0xc0 0xc1 0xf1 0xf2
// 0xf5..0xff, i.e. six control characters, lead bytes of unassigned planes
// 4..11, and bytes that never occur in UTF-8).  Such a byte becomes the
// unknown token when the tokenizer has one (unk_id >= 0; GGUF
// tokenizer.ggml.unknown_token_id) and is dropped otherwise, exactly as HF
// tokenizers' BPE does with and without unk_token (fuse_unk false).  An
// unknown token merges with nothing; a dropped byte lets its neighbours
// merge.  has_byte_token() tells which bytes have a symbol.
//
// Invalid UTF-8 is defined, not an error: a byte that does not begin a
// well-formed UTF-8 sequence (the Unicode standard's table 3-7: no overlong
// forms, no surrogates, nothing above U+10FFFF, no truncated sequence) is a
// piece on its own and encodes as its byte token.  It also ends the stretch
// of text the pattern sees, as a digit does.
//
// Round trip: decode(encode(s)) == s for every byte string s (valid UTF-8 or
// not, parse_special true or false) whose bytes all have a symbol.
//
// Unicode version: the classes \p{L}, \p{N} and Z come from the PCRE2 library
// linked (Unicode 14 for Debian 12's 10.42); HF tokenizers uses its own
// tables (Oniguruma, Rust).  A character whose category changed in a later
// Unicode version could split differently; the code-point test above found
// no such difference with Debian 12's PCRE2.
//
// Errors: no exception crosses this API except std::bad_alloc.  Functions
// return bool (or nullptr) and write a message to *error when error is not
// nullptr.
//
// Threading: a BpeTokenizer is immutable after construction; every const
// member may be called concurrently from any number of threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvxfer::model {

namespace gguf {
class File;
}
struct BpeScratch;  // per-call state of encode() (bpe_tokenizer.cc)

class BpeTokenizer {
 public:
  // GGUF token_type values (llama.cpp's llama_token_type).
  static constexpr std::int32_t kTypeNormal = 1;
  static constexpr std::int32_t kTypeControl = 3;  // special: matched literally

  ~BpeTokenizer();
  BpeTokenizer(const BpeTokenizer&) = delete;
  BpeTokenizer& operator=(const BpeTokenizer&) = delete;

  // Builds a tokenizer from plain vectors (the core; from_gguf reads these
  // from a file).
  //   tokens       token id -> text, in the byte-mapped form of the vocabulary
  //                ("Ġthe" for " the"); unique, at least 256 entries.
  //   token_types  one per token: kTypeControl marks a special token (its text
  //                is taken literally); any other value is an ordinary token,
  //                whose text must consist of byte symbols only.
  //   merges       "left right" (one space), in rank order; left, right and
  //                left+right must all be tokens.
  //   bos_id, eos_id  ids of the begin/end-of-sequence tokens, in range.
  //   unk_id       id a byte without a symbol encodes as, in range; -1 drops
  //                such bytes (see the header comment).
  // Returns nullptr and *error naming the offending entry ("merge 17 'a b':
  // 'ab' is not a token") when any of this does not hold.
  static std::unique_ptr<BpeTokenizer> create(const std::vector<std::string>& tokens,
                                              const std::vector<std::int32_t>& token_types,
                                              const std::vector<std::string>& merges,
                                              std::int32_t bos_id, std::int32_t eos_id,
                                              std::int32_t unk_id, std::string* error);

  // Reads the tokenizer of a GGUF file: tokenizer.ggml.model (must be
  // "gpt2"), tokenizer.ggml.pre (must be "smollm", the pre-tokenizer
  // implemented here), tokenizer.ggml.tokens, .token_type, .merges,
  // .bos_token_id, .eos_token_id and, when present, .unknown_token_id
  // (default -1: drop) and .add_bos_token (default false).  nullptr and *error naming the key on
  // failure.  The tokenizer copies what it needs; `file` may be destroyed afterwards.
  static std::unique_ptr<BpeTokenizer> from_gguf(const gguf::File& file, std::string* error);

  // Appends the ids of `text` (any bytes; see the header comment for invalid
  // UTF-8) to *ids.  Never adds BOS or EOS: add bos_id() yourself when
  // add_bos() says the model wants it.  Returns false only for a text over
  // 2^31-1 bytes (split it) or when PCRE2 fails to match (memory
  // exhaustion); *ids then holds a prefix of the result.  Linear in the text length up to a log
  // factor of the longest piece.
  bool encode(std::string_view text, bool parse_special, std::vector<std::int32_t>* ids,
              std::string* error) const;

  // Appends the bytes of `ids` to *out: byte symbols mapped back through the
  // inverse of bytes_to_unicode, special tokens as their text.  The result
  // need not be valid UTF-8 (a token may hold part of a character).  False
  // and *error naming the position when an id is outside [0, vocab_size());
  // *out then holds the bytes of the ids before it.
  bool decode(const std::vector<std::int32_t>& ids, std::string* out, std::string* error) const;

  // Number of tokens; ids are 0 .. vocab_size()-1.
  std::int32_t vocab_size() const { return static_cast<std::int32_t>(tokens_.size()); }
  // The vocabulary entry of `id` as stored ("Ġthe", "<|im_end|>"); an empty
  // string for an id out of range.
  const std::string& token_text(std::int32_t id) const;
  // The bytes `id` decodes to (" the", "<|im_end|>"); empty out of range.
  const std::string& token_bytes(std::int32_t id) const;
  // The id whose vocabulary entry is exactly `text`; -1 when there is none.
  std::int32_t token_id(std::string_view text) const;
  // Whether `id` is a special (control) token; false out of range.
  bool is_special(std::int32_t id) const;

  std::int32_t bos_id() const { return bos_id_; }
  std::int32_t eos_id() const { return eos_id_; }
  // -1 when bytes without a symbol are dropped.
  std::int32_t unk_id() const { return unk_id_; }
  // Whether byte b has a symbol in the vocabulary.
  bool has_byte_token(std::uint8_t b) const { return byte_token_[b] >= 0; }
  // tokenizer.ggml.add_bos_token of the GGUF (false for create()).
  bool add_bos() const { return add_bos_; }

 private:
  struct Regex;
  BpeTokenizer();

  // Encodes one piece (raw bytes, no special tokens) by BPE.
  void encode_piece(std::string_view piece, BpeScratch* scratch,
                    std::vector<std::int32_t>* ids) const;
  // Pre-tokenizes and encodes the text between two special tokens.
  bool encode_text(std::string_view text, BpeScratch* scratch, std::vector<std::int32_t>* ids,
                   std::string* error) const;

  std::vector<std::string> tokens_;
  std::vector<std::string> bytes_;  // decoded bytes of each token
  std::vector<bool> special_;
  std::unordered_map<std::string_view, std::int32_t> id_of_;  // views into tokens_
  // Special tokens, longest first (leftmost-longest matching).
  std::vector<std::int32_t> specials_;
  bool special_first_byte_[256] = {};
  std::int32_t byte_token_[256] = {};  // byte -> id of its symbol, -1 if none
  // (left id << 32 | right id) -> (rank << 32 | merged id)
  std::unordered_map<std::uint64_t, std::uint64_t> merges_;
  std::int32_t bos_id_ = 0;
  std::int32_t eos_id_ = 0;
  std::int32_t unk_id_ = -1;
  bool add_bos_ = false;
  std::unique_ptr<Regex> regex_;
};

}  // namespace kvxfer::model
