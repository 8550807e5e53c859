// What the llama example throws for input it cannot use: a missing or
// malformed file, a request line with a bad field, a checkpoint that
// disagrees with its config. The message names the file (and the line, field
// or tensor) and says what was expected and what was found; main prints it
// and exits non-zero. pagedkv's own checks throw c10::Error, which would mean
// a bug in the engine, not bad input.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace llama {

class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Concatenates its arguments with operator<< into an InputError and throws it.
template <class... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  throw InputError(out.str());
}

}  // namespace llama
