#include "model/model_paths.h"

#include <cstdlib>

namespace kvxfer::model {

namespace {

// The value of `name`, or nullptr when it is unset or empty (`${name:-...}`).
const char* nonempty_env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

}  // namespace

std::string smollm2_gguf_path() {
  if (const char* p = nonempty_env("KVXFER_SMOLLM2_GGUF")) return p;
  std::string cache;
  if (const char* xdg = nonempty_env("XDG_CACHE_HOME")) {
    cache = xdg;
  } else if (const char* home = nonempty_env("HOME")) {
    cache = std::string(home) + "/.cache";
  } else {
    return std::string();
  }
  return cache + "/kvxfer/" + kSmolLM2GgufName;
}

}  // namespace kvxfer::model
