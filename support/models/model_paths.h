// Where the runners find model files that do not ship in the repository.
#pragma once

#include <string>

namespace kvxfer::model {

// The SmolLM2-135M-Instruct GGUF that scripts/install-deps.sh fetches:
// $KVXFER_SMOLLM2_GGUF when set, else
// ${XDG_CACHE_HOME:-$HOME/.cache}/kvxfer/SmolLM2-135M-Instruct.Q4_1.gguf.
// The file may be absent; callers check.  Thread-safe (reads the environment).
std::string smollm2_gguf_path();

}  // namespace kvxfer::model
