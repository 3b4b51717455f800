#include "models/model_paths.h"

#include <cstdlib>

namespace kvxfer::model {

std::string smollm2_gguf_path() {
  if (const char* p = std::getenv("KVXFER_SMOLLM2_GGUF"); p != nullptr && *p != '\0') return p;
  std::string cache;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0')
    cache = x;
  else if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0')
    cache = std::string(h) + "/.cache";
  else
    cache = ".cache";
  return cache + "/kvxfer/SmolLM2-135M-Instruct.Q4_1.gguf";
}

}  // namespace kvxfer::model
