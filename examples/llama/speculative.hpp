// Drafting for speculative decoding by prompt lookup: a request's next
// tokens guessed from its own earlier tokens. Requests that quote or repeat
// what they have seen (code edits, summaries that copy spans, greedy loops)
// are guessed well; the scheduler verifies every draft in the step's forward
// pass and keeps only what the model itself would have chosen.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace llama {

/// Up to `max_tokens` tokens drafted after `tokens`: find the earlier
/// occurrence of the longest suffix of `tokens` (its last tokens, matched
/// backwards; the latest occurrence among equally long ones) and propose
/// what followed it. Empty when the last token never occurred before.
/// O(n x match length) per call.
inline std::vector<int64_t> prompt_lookup_draft(const std::vector<int64_t>& tokens, int64_t max_tokens) {
  const auto n = static_cast<int64_t>(tokens.size());
  if (n < 2 || max_tokens <= 0) return {};
  int64_t best_end = -1;  // the matched occurrence's last token
  int64_t best_length = 0;
  for (int64_t end = n - 2; end >= 0; --end) {
    int64_t length = 0;
    while (length <= end && tokens[static_cast<size_t>(end - length)] == tokens[static_cast<size_t>(n - 1 - length)]) {
      ++length;
    }
    if (length > best_length) {
      best_length = length;
      best_end = end;
    }
  }
  if (best_end < 0) return {};
  const int64_t from = best_end + 1;
  const int64_t count = std::min(max_tokens, n - from);
  return {tokens.begin() + from, tokens.begin() + from + count};
}

}  // namespace llama
