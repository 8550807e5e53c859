// The transfer's messages on the engine's c10d group: one send or receive
// of a tensor, waits against the call's single deadline (a timeout, a dead
// peer or an aborted work throws c10::Error naming the message and aborts
// the rest), the argument checks of ranks and timeouts, and int64 words on
// the wire device.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "pagedkv/checks.hpp"

namespace pagedkv {

namespace transfer {

using Clock = std::chrono::steady_clock;

/// What went wrong on the wire, for the error message.
inline std::string describe_failure(const std::exception& e) {
  const std::string what = e.what();
  const bool timed_out = what.find("imed out") != std::string::npos || what.find("imeout") != std::string::npos;
  return (timed_out ? std::string("timeout (the peer did not answer in time): ")
                    : std::string("peer gone or connection failed: ")) +
         what.substr(0, what.find('\n')) + " (rebuild the process group before the next transfer)";
}

/// Waits for c10d works against one deadline; throws c10::Error (naming
/// `what`) on a timeout, a dead peer or an aborted work.
template <class Works>
void wait_all(const checks::Caller& caller, Works& works, Clock::time_point deadline, const std::string& what) {
  for (auto& work : works) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    bool ok = false;
    std::string cause;
    try {
      ok = left.count() > 0 && work->wait(left);
      if (!ok) cause = left.count() > 0 ? "aborted" : "timeout (the call's deadline passed)";
    } catch (const std::exception& e) {
      cause = describe_failure(e);
    }
    if (!ok) {
      for (auto& w : works) {
        try {
          w->abort();  // stop gloo waiting on buffers we are about to drop
        } catch (...) {  // NOLINT(bugprone-empty-catch): best effort, the failure below is what matters
        }
      }
      TORCH_CHECK(false, caller, ": ", what, ": ", cause);
    }
  }
}

template <class Group>
auto send_one(Group& group, at::Tensor t, int rank, int tag) {
  std::vector<at::Tensor> tensors{std::move(t)};
  return group.send(tensors, rank, tag);
}

template <class Group>
auto recv_one(Group& group, at::Tensor t, int rank, int tag) {
  std::vector<at::Tensor> tensors{std::move(t)};
  return group.recv(tensors, rank, tag);
}

template <class Group>
void peer_rank(const checks::Caller& caller, const char* arg, Group& group, int rank) {
  const int size = group.getSize();
  const int self = group.getRank();
  TORCH_CHECK_INDEX(rank >= 0 && rank < size && rank != self, caller, ": argument '", arg,
                    "' expected a rank of the group other than this one ([0, ", size, ") without ", self, "), got ",
                    rank);
}

inline void positive_timeout(const checks::Caller& caller, std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, caller, ": argument 'timeout' expected > 0 ms, got ", timeout.count(), " ms");
}

/// The int64 words of a small host tensor on the wire device.
inline at::Tensor words_on(const std::vector<int64_t>& words, const at::Device& device) {
  at::Tensor t = at::empty({static_cast<int64_t>(words.size())}, at::kLong);
  std::copy(words.begin(), words.end(), t.data_ptr<int64_t>());
  return device.is_cpu() ? t : t.to(device);
}

inline std::vector<int64_t> words_of(const at::Tensor& t) {
  const at::Tensor host = t.cpu().contiguous();
  const int64_t* p = host.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + host.numel());
}

}  // namespace transfer

}  // namespace pagedkv
