// PCRE2 regexes that behave like the Oniguruma ones Hugging Face tokenizers uses:
// UTF + Unicode properties, Ruby's line anchors, Oniguruma's \s and \h, and its rule
// for stepping over empty matches.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace keel::tok {

class Regex {
 public:
  // `what` names the pattern's owner in errors (e.g. "pre_tokenizer Split").
  Regex(std::string_view pattern, const std::string& what);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls fn(begin, end) for each successive match in subject (byte offsets), stepping
  // over an empty match that touches the previous one as Oniguruma's find_iter does.
  // subject must be valid UTF-8. Thread-safe.
  void for_each_match(std::string_view subject,
                      const std::function<void(size_t, size_t)>& fn) const;

  // Whether the pattern matches at exactly offset 0 of subject (anchored).
  bool matches_prefix(std::string_view subject) const;

  const std::string& pattern() const { return pattern_; }

 private:
  bool search(std::string_view subject, size_t from, size_t& begin, size_t& end,
              bool anchored) const;

  std::string pattern_;
  std::string what_;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

// Oniguruma (Ruby syntax) -> PCRE2: rewrites \s, \S, \h, \H, which differ between them.
std::string translate_oniguruma(std::string_view pattern);

}  // namespace keel::tok
