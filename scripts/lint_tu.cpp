// The translation unit `make lint` runs clang-tidy on: every header of
// include/pagedkv, with every class template instantiated in full for both
// layouts, so that the checks see all of the code (scripts/lint).
#include "pagedkv/pagedkv.hpp"

template class pagedkv::PagedCache<pagedkv::NHD>;
template class pagedkv::PagedCache<pagedkv::HND>;
template class pagedkv::CacheView<pagedkv::NHD>;
template class pagedkv::CacheView<pagedkv::HND>;
template class pagedkv::SequenceTable<pagedkv::NHD>;
template class pagedkv::SequenceTable<pagedkv::HND>;
template class pagedkv::PrefixCache<pagedkv::NHD>;
template class pagedkv::PrefixCache<pagedkv::HND>;

// Page transfer (not in the umbrella header): its templates for c10d's
// base process group, in both layouts.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "pagedkv/transfer.hpp"

#define PAGEDKV_LINT_TRANSFER(L)                                                                                 \
  template void pagedkv::send_pages<c10d::ProcessGroup, L>(c10d::ProcessGroup&, int, const pagedkv::PagedCache<L>&, \
                                                           const at::Tensor&, int64_t, int64_t,                   \
                                                           std::chrono::milliseconds, pagedkv::HeadRange);        \
  template std::vector<int64_t> pagedkv::recv_pages<c10d::ProcessGroup, L>(                                       \
      c10d::ProcessGroup&, int, pagedkv::PagedCache<L>&, int64_t, std::chrono::milliseconds);                     \
  template void pagedkv::send_sequence<c10d::ProcessGroup, L>(c10d::ProcessGroup&, int,                            \
                                                              const pagedkv::SequenceTable<L>&, int64_t, int64_t, \
                                                              std::chrono::milliseconds, pagedkv::HeadRange);     \
  template int64_t pagedkv::recv_sequence<c10d::ProcessGroup, L>(c10d::ProcessGroup&, int,                         \
                                                                 pagedkv::SequenceTable<L>&, int64_t,              \
                                                                 std::chrono::milliseconds);
PAGEDKV_LINT_TRANSFER(pagedkv::NHD)
PAGEDKV_LINT_TRANSFER(pagedkv::HND)
