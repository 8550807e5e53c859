// pagedkv: a paged KV cache for LLM inference over libtorch tensors.
// The umbrella header: include this one.
#pragma once

#include "pagedkv/attention.hpp"
#include "pagedkv/bits.hpp"
#include "pagedkv/bitmap.hpp"
#include "pagedkv/cache_view.hpp"
#include "pagedkv/float8_view.hpp"
#include "pagedkv/checks.hpp"
#include "pagedkv/ops/backend.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/ops/page_copy.hpp"
#include "pagedkv/page_pool.hpp"
#include "pagedkv/page_reclaimer.hpp"
#include "pagedkv/page_store.hpp"
#include "pagedkv/page_table.hpp"
#include "pagedkv/paged_cache.hpp"
#include "pagedkv/prefix_cache.hpp"
#include "pagedkv/sequences.hpp"
