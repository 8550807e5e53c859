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
