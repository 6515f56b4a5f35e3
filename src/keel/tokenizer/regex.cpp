#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <memory>

#include "base/error.h"
#include "tokenizer/utf8.h"

namespace keel::tok {
namespace {

// Oniguruma's \s under UTF-8 is Unicode White_Space; PCRE2's (with UCP) misses U+0085.
constexpr std::string_view kSpaceClass =
    "\\t-\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
    "\\x{205F}\\x{3000}";
// Oniguruma's \h is a hex digit (PCRE2's is horizontal space).
constexpr std::string_view kHexClass = "0-9A-Fa-f";

// Per-thread match state: match data and a JIT stack large enough for long runs.
struct MatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, nullptr);
    if (context && stack) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchState& match_state() {
  thread_local MatchState state;
  return state;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

std::string translate_oniguruma(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      ++i;
      if (e == 's' || e == 'h') {
        const std::string_view cls = e == 's' ? kSpaceClass : kHexClass;
        if (in_class) {
          out += cls;
        } else {
          out += '[';
          out += cls;
          out += ']';
        }
        continue;
      }
      if ((e == 'S' || e == 'H') && !in_class) {
        out += "[^";
        out += e == 'S' ? kSpaceClass : kHexClass;
        out += ']';
        continue;
      }
      out += c;
      out += e;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {
      // POSIX class [:name:] inside a bracket expression.
      const size_t close = p.find(":]", i + 2);
      if (close != std::string_view::npos) {
        out += p.substr(i, close + 2 - i);
        i = close + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

Regex::Regex(std::string_view pattern, const std::string& what)
    : pattern_(pattern), what_(what) {
  const std::string translated = translate_oniguruma(pattern);
  int err = 0;
  PCRE2_SIZE offset = 0;
  // Ruby syntax: ^ and $ are line anchors.
  const uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE | PCRE2_NEVER_BACKSLASH_C;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()),
                                   translated.size(), options, &err, &offset, nullptr);
  if (!code)
    fail(ErrorCode::tokenizer_json, {.field = what},
         "regex '" + std::string(pattern) + "' does not compile at offset " +
             std::to_string(offset) + ": " + pcre2_message(err));
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::search(std::string_view subject, size_t from, size_t& begin, size_t& end,
                   bool anchored) const {
  MatchState& st = match_state();
  auto* code = static_cast<pcre2_code*>(code_);
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  int rc;
  if (jit_ && !anchored) {
    rc = pcre2_jit_match(code, s, subject.size(), from, 0, st.data, st.context);
  } else {
    rc = pcre2_match(code, s, subject.size(), from,
                     PCRE2_NO_UTF_CHECK | (anchored ? PCRE2_ANCHORED : 0), st.data, st.context);
  }
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0)
    fail(ErrorCode::tokenizer_json, {.field = what_},
         "regex '" + pattern_ + "' failed on a " + std::to_string(subject.size()) +
             "-byte piece: " + pcre2_message(rc));
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
  begin = ov[0];
  end = ov[1];
  return true;
}

void Regex::for_each_match(std::string_view subject,
                           const std::function<void(size_t, size_t)>& fn) const {
  size_t pos = 0;
  bool have_last = false;
  size_t last_end = 0;
  size_t b, e;
  while (pos <= subject.size() && search(subject, pos, b, e, false)) {
    if (b == e && have_last && last_end == e) {
      if (pos >= subject.size()) break;
      pos += utf8_lead_length(static_cast<unsigned char>(subject[pos]));
      continue;
    }
    pos = e;
    have_last = true;
    last_end = e;
    fn(b, e);
  }
}

bool Regex::matches_prefix(std::string_view subject) const {
  size_t b, e;
  return search(subject, 0, b, e, true);
}

}  // namespace keel::tok
