#include "models/chat_template.h"

#include <utility>

#include "models/gguf.h"

namespace kvxfer::model {

namespace {

constexpr std::string_view kLoop = "{% for message in messages %}";
constexpr std::string_view kSystemOpen =
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n";
constexpr std::string_view kSystemClose = "<|im_end|>\n' }}{% endif %}";
constexpr std::string_view kTurn =
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}";
constexpr std::string_view kEndLoop = "{% endfor %}";
constexpr std::string_view kGeneration =
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

void set_error(std::string* error, std::string message) {
  if (error != nullptr) *error = std::move(message);
}

void append_turn(std::string* out, std::string_view role, std::string_view content) {
  *out += "<|im_start|>";
  *out += role;
  *out += '\n';
  *out += content;
  *out += "<|im_end|>\n";
}

}  // namespace

std::unique_ptr<ChatTemplate> ChatTemplate::parse(std::string_view jinja, std::string* error) {
  // `\n` inside a Jinja string literal is a newline; compare one spelling.
  std::string t;
  t.reserve(jinja.size());
  for (std::size_t i = 0; i < jinja.size(); ++i) {
    if (jinja[i] == '\\' && i + 1 < jinja.size() && jinja[i + 1] == 'n') {
      t += '\n';
      ++i;
    } else {
      t += jinja[i];
    }
  }
  std::size_t at = 0;
  auto expect = [&](std::string_view part, const char* what) {
    const std::size_t found = t.find(part, at);
    if (found == std::string::npos) {
      set_error(error, std::string("chat template not recognised (not SmolLM2's ChatML): no ") +
                           what + " `" + std::string(part) + "`" +
                           (at > 0 ? " after the parts before it" : ""));
      return false;
    }
    at = found + part.size();
    return true;
  };
  if (!expect(kLoop, "loop over the messages") || !expect(kSystemOpen, "default-system block")) {
    return nullptr;
  }
  const std::size_t text_begin = at;
  if (!expect(kSystemClose, "end of the default system text")) return nullptr;
  std::string system = t.substr(text_begin, at - kSystemClose.size() - text_begin);
  if (system.find_first_of("'\"\\{}") != std::string::npos) {
    set_error(error, "chat template not recognised: the default system text '" + system +
                         "' holds a quote, backslash or brace");
    return nullptr;
  }
  if (!expect(kTurn, "message turn") || !expect(kEndLoop, "end of the loop") ||
      !expect(kGeneration, "generation prompt")) {
    return nullptr;
  }
  std::unique_ptr<ChatTemplate> c(new ChatTemplate());
  c->default_system_ = std::move(system);
  return c;
}

std::unique_ptr<ChatTemplate> ChatTemplate::from_gguf(const gguf::File& file, std::string* error) {
  std::string jinja, why;
  if (!file.get_string("tokenizer.chat_template", &jinja, &why)) {
    set_error(error, why);  // names the file and the key
    return nullptr;
  }
  auto c = parse(jinja, &why);
  if (!c) set_error(error, "gguf '" + file.path() + "': tokenizer.chat_template: " + why);
  return c;
}

std::string ChatTemplate::render_user(std::string_view user) const {
  return render_user(user, default_system_);
}

std::string ChatTemplate::render_user(std::string_view user, std::string_view system) const {
  std::string out;
  out.reserve(user.size() + system.size() + 80);
  append_turn(&out, "system", system);
  append_turn(&out, "user", user);
  out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace kvxfer::model
