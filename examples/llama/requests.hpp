// The request file and the output, both JSON Lines.
//
// In:  {"id": "r1", "prompt": [1, 2, 3], "max_new_tokens": 16}   one request a line
//      ("max_new_tokens" optional: --max-new-tokens is the default; blank
//      lines are skipped). Every problem is reported as FILE:LINE: field
//      'NAME' ...: a line that is not a JSON object, a missing or mistyped
//      field, an unknown field (a misspelt "max_new_tokens" would otherwise
//      be ignored), a token id outside the vocabulary, a repeated id.
// Out: {"id": "r1", "tokens": [...]}   one line per finished request, the
//      generated tokens only.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <istream>
#include <map>
#include <string>
#include <vector>

#include "errors.hpp"

namespace llama {

struct Request {
  std::string id;
  std::vector<int64_t> prompt;
  int64_t max_new_tokens = 0;
  int64_t line = 0;  ///< in the request file, for messages
};

/// What a request is checked against.
struct RequestLimits {
  int64_t vocab_size = 0;
  int64_t default_max_new_tokens = 32;
};

namespace requests_detail {

/// A JSON value for a message, cut short.
inline std::string shown(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

}  // namespace requests_detail

/// Parses a request file's text (`file` names it in messages).
inline std::vector<Request> parse_requests(const std::string& file, std::istream& in, const RequestLimits& limits) {
  using requests_detail::shown;
  std::vector<Request> out;
  std::map<std::string, int64_t> first_line;  // id -> line
  std::string text;
  for (int64_t line = 1; std::getline(in, text); ++line) {
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string at = file + ":" + std::to_string(line) + ": ";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      fail(at, "not valid JSON (", e.what(), ")");
    }
    if (!j.is_object()) fail(at, "expected a JSON object {\"id\": ..., \"prompt\": [...]}, got ", shown(j));
    for (const auto& item : j.items()) {
      if (item.key() != "id" && item.key() != "prompt" && item.key() != "max_new_tokens") {
        fail(at, "unknown field '", item.key(), "' (a request has 'id', 'prompt' and 'max_new_tokens')");
      }
    }
    Request r;
    r.line = line;
    if (!j.contains("id") || !j["id"].is_string()) {
      fail(at, "field 'id' expected a string, got ", j.contains("id") ? shown(j["id"]) : std::string("nothing"));
    }
    r.id = j["id"].get<std::string>();
    const auto seen = first_line.find(r.id);
    if (seen != first_line.end()) fail(at, "field 'id': \"", r.id, "\" is already the id of line ", seen->second);
    first_line.emplace(r.id, line);
    if (!j.contains("prompt") || !j["prompt"].is_array() || j["prompt"].empty()) {
      fail(at, "field 'prompt' expected a non-empty array of token ids, got ",
           j.contains("prompt") ? shown(j["prompt"]) : std::string("nothing"));
    }
    const nlohmann::json& prompt = j["prompt"];
    r.prompt.reserve(prompt.size());
    for (size_t i = 0; i < prompt.size(); ++i) {
      const nlohmann::json& t = prompt[i];
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= limits.vocab_size ||
          (t.is_number_unsigned() && t.get<uint64_t>() >= static_cast<uint64_t>(limits.vocab_size))) {
        fail(at, "field 'prompt[", i, "]' expected a token id in [0, ", limits.vocab_size, ") (vocab_size), got ",
             shown(t));
      }
      r.prompt.push_back(t.get<int64_t>());
    }
    r.max_new_tokens = limits.default_max_new_tokens;
    if (j.contains("max_new_tokens")) {
      const nlohmann::json& m = j["max_new_tokens"];
      if (!m.is_number_integer() || m.get<int64_t>() < 1 || (m.is_number_unsigned() && m.get<uint64_t>() > (1u << 30))) {
        fail(at, "field 'max_new_tokens' expected an integer in [1, 2^30], got ", shown(m));
      }
      r.max_new_tokens = m.get<int64_t>();
    }
    out.push_back(std::move(r));
  }
  if (in.bad()) fail(file, ": read error");
  return out;
}

inline std::vector<Request> read_requests(const std::string& path, const RequestLimits& limits) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open");
  return parse_requests(path, in, limits);
}

/// Pages a request holds at most: its prompt and all but the last generated
/// token; with a sliding window w (window >= 1) only the window's pages and
/// those of the chunk it computes (at most max_chunk tokens), since a
/// windowed table frees the rest: ceil((w - 1 + chunk) / page_size) + 1.
inline int64_t pages_needed(const Request& r, int64_t page_size, int64_t window = 0, int64_t max_chunk = 0) {
  const int64_t tokens = static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens - 1;
  const auto pages_for = [&](int64_t n) { return (n + page_size - 1) / page_size; };
  if (window == 0) return pages_for(tokens);
  return std::min(pages_for(tokens), pages_for(window - 1 + std::min(tokens, max_chunk)) + 1);
}

/// Every request must fit the pool on its own (the scheduler relies on it);
/// `flag` names the pool's flag, `window` / `max_chunk` as pages_needed.
inline void check_fits(const std::string& file, const std::vector<Request>& requests, int64_t n_pages,
                       int64_t page_size, const char* flag = "--n-pages", int64_t window = 0, int64_t max_chunk = 0) {
  for (const Request& r : requests) {
    const int64_t pages = pages_needed(r, page_size, window, max_chunk);
    if (pages > n_pages) {
      fail(file, ":", r.line, ": field 'prompt': ", r.prompt.size(), " tokens plus max_new_tokens ", r.max_new_tokens,
           " need ", pages, " pages of ", page_size, " tokens",
           window > 0 ? " (a sliding window of " + std::to_string(window) + " tokens and a step of " +
                            std::to_string(max_chunk) + ")"
                      : std::string(),
           ", more than the pool can ever hold (", n_pages, " pages, ", flag, ")");
    }
  }
}

/// One output line (no newline): {"id": ..., "tokens": [...]}.
inline std::string output_line(const std::string& id, const std::vector<int64_t>& tokens) {
  nlohmann::json j;
  j["id"] = id;
  j["tokens"] = tokens;
  return j.dump();
}

}  // namespace llama
