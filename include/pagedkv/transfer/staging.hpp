// Staging buffers of a transfer: the sender packs a layer's pages into one
// before sending it, the receiver lands the whole payload in one before any
// page is written. On the CPU one per thread and role, reused.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace pagedkv {

namespace transfer {

/// Which staging buffer: the sender's (packed payload) or the receiver's.
enum class StagingRole { send = 0, recv = 1 };

inline at::Tensor& staging_slot(StagingRole role) {
  // cppcheck-suppress constVariable ; handed out by reference, assigned by the caller
  thread_local at::Tensor slots[2];
  return slots[static_cast<int>(role)];
}

/// A staging tensor of `shape`. On the CPU it is one buffer per thread and
/// role, reused from transfer to transfer: a fresh 64 MiB buffer costs more
/// in page faults than the copy into it (bench/NOTES.md, "Transfer (issue
/// 12)"). Other devices have caching allocators of their own.
inline at::Tensor staging(StagingRole role, at::IntArrayRef shape, const at::TensorOptions& options) {
  if (!options.device().is_cpu()) return at::empty(shape, options);
  at::Tensor& slot = staging_slot(role);
  const int64_t numel = c10::multiply_integers(shape);
  if (!slot.defined() || slot.dtype() != options.dtype() || slot.numel() < numel) {
    slot = at::Tensor();  // the old buffer goes before the new one comes
    slot = at::empty({numel}, options);
  }
  return slot.narrow(0, 0, numel).view(shape);
}

/// After a failure the group may still hold a pending message on the
/// buffer (it keeps the memory alive through its work): never reuse it.
inline void drop_staging(StagingRole role) { staging_slot(role) = at::Tensor(); }

}  // namespace transfer

}  // namespace pagedkv
