// Text inputs of the benchmarks and the demo (perf/codec_quality,
// perf/spectrum_quality, examples/disagg_demo): a whole text file, and a GGUF
// model's tokenizer with its chat template.  Needs only kvxfer_models.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "models/bpe_tokenizer.h"
#include "models/chat_template.h"
#include "models/gguf.h"

namespace kvxfer::perf {

/** The whole file at `path` into *out; false with *err when it cannot be read. */
bool read_text_file(const std::string& path, std::string* out, std::string* err);

/** A GGUF model's tokenizer and chat template. */
struct ChatText {
  std::unique_ptr<model::BpeTokenizer> tok;
  std::unique_ptr<model::ChatTemplate> chat;

  /** Loads both from the model's GGUF file; false with *err. */
  bool load(const model::gguf::File& file, std::string* err);
  /** `user` as a user turn of the chat template, tokenized (special tokens parsed). */
  bool encode_user(const std::string& user, std::vector<int>* ids, std::string* err) const;
};

}  // namespace kvxfer::perf
