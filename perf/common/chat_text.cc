// Text inputs of the benchmarks and the demo; see chat_text.h.
#include "perf/common/chat_text.h"

#include <fstream>
#include <iterator>

namespace kvxfer::perf {

bool read_text_file(const std::string& path, std::string* out, std::string* err) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    *err = "cannot read " + path;
    return false;
  }
  out->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return true;
}

bool ChatText::load(const model::gguf::File& file, std::string* err) {
  tok = model::BpeTokenizer::from_gguf(file, err);
  if (!tok) return false;
  chat = model::ChatTemplate::from_gguf(file, err);
  return chat != nullptr;
}

bool ChatText::encode_user(const std::string& user, std::vector<int>* ids, std::string* err) const {
  std::vector<int32_t> v;
  if (!tok->encode(chat->render_user(user), true, &v, err)) return false;
  ids->assign(v.begin(), v.end());
  return true;
}

}  // namespace kvxfer::perf
