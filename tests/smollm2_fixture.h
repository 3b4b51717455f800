// SmolLM2-135M-Instruct for the tests that need a real LLM: the model, its
// tokenizer and chat template from the GGUF that scripts/install-deps.sh
// fetches (models/model_paths.h).  Loaded once per test binary; when the file
// is absent or does not load, `model` is null and `why` says why, so that the
// cases skip with that message.
#pragma once

#include <fstream>
#include <memory>
#include <string>

#include "models/bpe_tokenizer.h"
#include "models/chat_template.h"
#include "models/llama2.h"
#include "models/model_paths.h"

namespace kvxfer::test {

struct SmolLM2 {
  std::unique_ptr<model::Model> model;  // null if unavailable
  std::unique_ptr<model::BpeTokenizer> tok;
  std::unique_ptr<model::ChatTemplate> chat;
  std::string why;  // why it is unavailable
};

inline const SmolLM2& smollm2() {
  static const SmolLM2 s = [] {
    SmolLM2 r;
    const std::string path = model::smollm2_gguf_path();
    if (!std::ifstream(path).good()) {
      r.why = path + " is absent; scripts/install-deps.sh fetches it";
      return r;
    }
    std::string err;
    r.model = model::Model::load(path, &err);
    if (r.model && r.model->gguf_file() != nullptr) {
      r.tok = model::BpeTokenizer::from_gguf(*r.model->gguf_file(), &err);
      r.chat = model::ChatTemplate::from_gguf(*r.model->gguf_file(), &err);
    }
    if (!r.model || !r.tok || !r.chat) {
      r.model.reset();
      r.why = "cannot load " + path + ": " + err;
    }
    return r;
  }();
  return s;
}

}  // namespace kvxfer::test
