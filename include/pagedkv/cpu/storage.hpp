// Memory behind CPU caches and their gathers: outputs recycled between
// gathers, and cache storage advised to use huge pages (the storage of a
// cache on any device comes from zeroed_storage; only the CPU gets the hint).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pagedkv {
namespace cpu {

/// Storage for the outputs of CPU gathers, recycled once the caller has
/// dropped every tensor that used it. A fresh large at::empty costs a page
/// fault per 4 KiB (the kernel zeroes each page on first touch), which made a
/// gather several times slower than a memcpy (bench/NOTES.md, "Output recycler
/// (issue 3, change 2)"); engines drop a gather's k and v before the next
/// gather (next layer, next step), so the storage can be reused. A storage is
/// reused only when nothing else refers to it (no tensor, no view, no weak
/// reference), when it is large enough, and when it is at most twice the size
/// needed (so a small gather does not pin a huge buffer). Holds at most one
/// storage per slot. Thread-safe (gather is const and may run concurrently).
class OutputRecycler {
 public:
  static constexpr size_t kSlots = 2;  ///< one for k, one for v

  /// An uninitialised contiguous tensor of `sizes` on the CPU.
  at::Tensor empty(size_t slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
    const int64_t numel = c10::multiply_integers(sizes);
    const auto bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
    c10::Storage storage;
    if (bytes > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      c10::Storage& cached = cached_[slot];
      if (cached && reusable(cached, bytes, options)) storage = std::move(cached);
      cached = c10::Storage();
    }
    at::Tensor out;
    if (storage) {
      std::vector<int64_t> strides(sizes.size(), 1);
      for (size_t d = sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * std::max<int64_t>(sizes[d], 1);
      out = at::empty({0}, options).set_(storage, 0, sizes, strides);
    } else {
      out = at::empty(sizes, options);
      if (bytes == 0) return out;
      storage = out.storage();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    cached_[slot] = std::move(storage);
    return out;
  }

 private:
  static bool reusable(const c10::Storage& s, size_t bytes, const at::TensorOptions& options) {
    // use_count 1: only this recycler holds it; weak count 2: the recycler's
    // strong reference plus the temporary weak pointer asked.
    return s.use_count() == 1 && s.getWeakStorageImpl().weak_use_count() == 2 && s.nbytes() >= bytes &&
           s.nbytes() <= 2 * bytes && s.device() == options.device() && s.data() != nullptr;
  }

  std::mutex mutex_;
  std::array<c10::Storage, kSlots> cached_;
};

/// A zeroed tensor for a cache's K or V storage. On the CPU, storage of
/// 2 MiB or more starts at a 2 MiB boundary: torch's allocator gives 64-byte
/// alignment (large blocks start 64 bytes past a 4 KiB boundary), which
/// made every page, and every head run of an HND page, straddle a 4 KiB
/// boundary, where hardware prefetchers stop, which slowed decode from
/// memory (bench/NOTES.md, "Three keys per score pass"). The
/// tensor is then a view, at an offset, of a byte storage up to 2 MiB
/// larger. On Linux that storage is also advised to use transparent huge
/// pages before its first touch: the kernels hop between pages far apart,
/// and with 4 KiB pages every hop is a TLB miss (a nested page walk under a
/// hypervisor). Only a hint: the storage is zeroed whole anyway, so it costs
/// no memory.
inline at::Tensor zeroed_storage(at::IntArrayRef shape, const at::TensorOptions& options) {
  constexpr int64_t kHuge = int64_t{2} << 20;
  const at::ScalarType dtype = c10::typeMetaToScalarType(options.dtype());
  const int64_t bytes = c10::multiply_integers(shape) * static_cast<int64_t>(c10::elementSize(dtype));
  if (!options.device().is_cpu() || bytes < kHuge) return at::zeros(shape, options);
  const at::Tensor raw = at::empty({bytes + kHuge}, options.dtype(at::kByte));
  const auto begin = reinterpret_cast<uintptr_t>(raw.data_ptr());
  const auto offset = static_cast<int64_t>((uintptr_t{kHuge} - begin % uintptr_t{kHuge}) % uintptr_t{kHuge});
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  (void)madvise(reinterpret_cast<void*>(begin + static_cast<uintptr_t>(offset)), static_cast<size_t>(bytes / kHuge * kHuge),
                MADV_HUGEPAGE);
#endif
  return raw.narrow(0, offset, bytes).view(dtype).view(shape).zero_();
}
}  // namespace cpu
}  // namespace pagedkv
