// Collects the c10 warnings (TORCH_WARN) raised on the calling thread while
// it lives: the tests of the prefix tiers check that a failing store warns.
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "pagedkv/torch_compat.hpp"

namespace pagedkv_test {

/// Collects the c10 warnings raised in its scope.
class Warnings : public c10::WarningHandler {
 public:
  Warnings() : guard_(this) {}
#if PAGEDKV_TORCH_AT_LEAST(2, 0)
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override { messages.push_back(msg); }
#endif
  bool any(const std::string& part) const {
    for (const auto& m : messages) {
      if (m.find(part) != std::string::npos) return true;
    }
    return false;
  }
  std::vector<std::string> messages;

 private:
#if PAGEDKV_TORCH_AT_LEAST(2, 0)
  c10::WarningUtils::WarningHandlerGuard guard_;
#else
  c10::Warning::WarningHandlerGuard guard_;
#endif
};

}  // namespace pagedkv_test
