// The chat prompt of SmolLM2-Instruct (ChatML), rendered without a Jinja
// engine.
//
// A GGUF's tokenizer.chat_template is a Jinja template.  This class does not
// interpret Jinja: it recognises SmolLM2's template and renders the one case
// the model runner needs, a single user turn with an optional system message
// followed by the assistant's generation prompt, exactly as
// jinja2 renders the template with messages = [system?, user] and
// add_generation_prompt = true:
//
//   <|im_start|>system\n{system}<|im_end|>\n
//   <|im_start|>user\n{user}<|im_end|>\n
//   <|im_start|>assistant\n
//
// ({system} defaults to the template's own default system text, for SmolLM2
// "You are a helpful AI assistant named SmolLM, trained by Hugging Face").
// The contents are inserted verbatim, unescaped, as the template does.
//
// Recognising: parse() requires the template to contain, in this order, the
// loop header `{% for message in messages %}`, the default-system block
//   {% if loop.first and messages[0]['role'] != 'system' %}
//   {{ '<|im_start|>system\n<DEFAULT><|im_end|>\n' }}{% endif %}
// the turn `{{'<|im_start|>' + message['role'] + '\n' + message['content'] +
// '<|im_end|>' + '\n'}}`, `{% endfor %}`, and the generation prompt
// `{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}`
// (written without the line breaks shown here; `\n` stands for a newline, written
// either as the character or as the escape inside the Jinja string literals).
// Anything else, or a <DEFAULT> holding a quote, a backslash or a brace, is
// refused with a message naming the missing part: a template this class does
// not recognise is never rendered approximately.
//
// Errors: no exception crosses this API except std::bad_alloc.  Threading: a
// ChatTemplate is immutable; every const member may be called from any
// thread.
#pragma once

#include <memory>
#include <string>
#include <string_view>

namespace kvxfer::model {

namespace gguf {
class File;
}

class ChatTemplate {
 public:
  // Recognises `jinja` (see above); nullptr and *error otherwise.
  static std::unique_ptr<ChatTemplate> parse(std::string_view jinja, std::string* error);
  // parse() of the GGUF's tokenizer.chat_template; nullptr and *error naming
  // the key when it is absent or not recognised.
  static std::unique_ptr<ChatTemplate> from_gguf(const gguf::File& file, std::string* error);

  // The default system text of the template (without markers).
  const std::string& default_system() const { return default_system_; }

  // One user turn and the generation prompt, with the default system text.
  std::string render_user(std::string_view user) const;
  // The same with `system` as the system message (empty is allowed and
  // renders an empty system turn, as the template does).
  std::string render_user(std::string_view user, std::string_view system) const;

 private:
  ChatTemplate() = default;
  std::string default_system_;
};

}  // namespace kvxfer::model
