// SmolLM2-135M-Instruct for the tests that need a real LLM: the model, its
// tokenizer and chat template from the GGUF that scripts/install-deps.sh
// fetches (models/model_paths.h).  Loaded once per test binary; when the file
// is absent or does not load, `model` is null and `why` says why.  The cases
// skip only when the file is absent, and fail when it is present but does not
// load (KVXFER_REQUIRE_SMOLLM2): a broken download must not pass as skipped.
#pragma once

#include <gtest/gtest.h>

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
  std::string why;       // why it is unavailable
  bool present = false;  // the file exists (so a load failure is a test failure)
};

/** In a test body: skips the case when `s` (a SmolLM2, or anything with
 *  `model`, `present` and `why`) is unavailable because the file is absent;
 *  fails it when the file is present but `s` did not load. */
#define KVXFER_REQUIRE_SMOLLM2(s)                                                \
  do {                                                                           \
    if (!(s).model) {                                                            \
      if ((s).present) FAIL() << "SmolLM2 is present but unusable: " << (s).why; \
      GTEST_SKIP() << "SmolLM2 not available: " << (s).why;                      \
    }                                                                            \
  } while (0)

inline const SmolLM2& smollm2() {
  static const SmolLM2 s = [] {
    SmolLM2 r;
    const std::string path = model::smollm2_gguf_path();
    if (!std::ifstream(path).good()) {
      r.why = path + " is absent; scripts/install-deps.sh fetches it";
      return r;
    }
    r.present = true;
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
