// kvxfer_env_doc TEMPLATE OUTPUT: writes docs/ENV.md.  TEMPLATE
// (docs/ENV.md.in) is copied with its line "@PARAMS@" replaced by the
// sections and variables of params.def: per variable a heading, its kind,
// range or choices and default, then its doc.  Exit 0, or 1 with a message.
// Built and run by the build (target env_doc); ctest env_doc compares the
// result with the checked-in docs/ENV.md.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "common/params.h"

namespace {

using namespace kvxfer;
using namespace kvxfer::params;

std::string default_text(const std::string& def) {
  return def.empty() ? "Default: (empty)." : "Default: `" + def + "`.";
}

std::string number(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

template <typename E>
std::string enum_kind(E def) {
  std::string s = "Enum ";
  for (size_t i = 0; i < params::Choices<E>::count; ++i)
    s += std::string(i ? ", `" : "`") + params::Choices<E>::names[i] + "`";
  return s + ". " + default_text(params::name_of(def));
}

void variable(std::string* out, const char* env, const std::string& kind, const char* doc) {
  *out += std::string("### `") + env + "`\n\n" + kind + "\n\n" + doc + "\n";
}

std::string parameters() {
  std::string s;
#define KVXFER_PARAM_SECTION(title, doc) \
  s += std::string("## ") + title + "\n\n" + (doc[0] != '\0' ? std::string(doc) + "\n" : "");
#define KVXFER_PARAM_INT(Name, env, def, lo, hi, doc)                                 \
  variable(&s, env,                                                                   \
           "Integer `" + std::to_string(lo) + "` to `" + std::to_string(hi) + "`. " + \
               default_text(std::to_string(def)),                                     \
           doc);
#define KVXFER_PARAM_SIZE(Name, env, def, lo, hi, doc)                               \
  variable(&s, env,                                                                  \
           "Size in bytes, `" + std::to_string(lo) + "` to `" + std::to_string(hi) + \
               "` (a count or k/m/g/t binary units: `256k`, `4MiB`). " +             \
               default_text(std::to_string(def)),                                    \
           doc);
#define KVXFER_PARAM_FLOAT(Name, env, def, lo, hi, doc)                                         \
  variable(&s, env,                                                                             \
           "Number `" + number(lo) + "` to `" + number(hi) + "`. " + default_text(number(def)), \
           doc);
#define KVXFER_PARAM_RATE(Name, env, def, doc) variable(&s, env, "Rate. " + default_text(def), doc);
#define KVXFER_PARAM_ENUM(Name, env, Type, def, choices, doc) \
  variable(&s, env, enum_kind(Type::def), doc);
#define KVXFER_PARAM_STRING(Name, env, def, doc) \
  variable(&s, env, "String. " + default_text(def), doc);
#include "common/params.def"
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s TEMPLATE OUTPUT\n", argv[0]);
    return 1;
  }
  std::ifstream in(argv[1]);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const std::string marker = "\n@PARAMS@\n";
  const size_t at = text.find(marker);
  if (!in || at == std::string::npos) {
    std::fprintf(stderr, "%s: cannot read %s, or it has no line @PARAMS@\n", argv[0], argv[1]);
    return 1;
  }
  text.replace(at + 1, marker.size() - 1, parameters());
  std::ofstream out(argv[2], std::ios::trunc);
  out << text;
  out.close();
  if (!out) {
    std::fprintf(stderr, "%s: cannot write %s\n", argv[0], argv[2]);
    return 1;
  }
  return 0;
}
