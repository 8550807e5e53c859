// docs/sequences.md, "Prefix caching": two requests that share a system
// prompt; the second prefills only what the first did not compute.
#include <pagedkv/pagedkv.hpp>

#include <cstdint>

#include "samples.hpp"

namespace docs {
namespace {

/// K/V of tokens [from, n) of a prompt, made from the token ids and
/// positions (a stand-in for a model, deterministic like one).
std::pair<at::Tensor, at::Tensor> prompt_kv(const at::Tensor& tokens, int64_t from) {
  const int64_t n = tokens.size(0) - from;
  const at::Tensor base = (tokens.narrow(0, from, n).to(at::kFloat) * 0.01 +
                           at::arange(from, from + n, at::kFloat) * 0.001).view({1, n, 1, 1});
  const at::Tensor ramp = at::linspace(-1, 1, 8 * 128).view({1, 1, 8, 128});
  return {(base + ramp).to(at::kHalf), (base - ramp).to(at::kHalf)};
}

/// "The model": writes the K/V of tokens [from, n_prompt) at start_pos = from, every layer.
void model_prefill(const pagedkv::CacheView<pagedkv::NHD>& view, const at::Tensor& tokens, int64_t from) {
  const auto [k, v] = prompt_kv(tokens, from);
  for (int64_t layer = 0; layer < view.cache().n_layers(); ++layer) view.write(layer, from, k, v);
}

//! [request]
/// Prefills a request's prompt (token ids [n_prompt], int64 on the cpu) as a new sequence,
/// reusing the K/V of every cached full page of it. -1 if the pool is short.
int64_t start_request(pagedkv::SequenceTable<pagedkv::NHD>& seqs, pagedkv::PrefixCache<pagedkv::NHD>& prefix,
                      const at::Tensor& tokens, uint64_t tenant) {
  const int64_t n_prompt = tokens.size(0);
  //! [acquire_insert]
  auto [seq, cached] = prefix.acquire(tokens, /*salt=*/tenant);  // shares the matched pages; 0 on a miss
  if (!seqs.prepare_append(seq, n_prompt - cached)) {  // evicts cached pages when the pool is short
    seqs.release(seq);                                  // free + evictable pages were too few
    return -1;
  }
  auto [table, lengths] = seqs.batch({seq});
  const auto view = seqs.cache().bind(table, lengths + (n_prompt - cached));
  model_prefill(view, tokens, /*from=*/cached);  // tokens [cached, n_prompt) only
  seqs.commit_append(seq, n_prompt - cached);
  prefix.insert(seq, tokens, /*salt=*/tenant);  // later requests find these pages
  //! [acquire_insert]
  return seq;
}
//! [request]

}  // namespace

void prefix_cache_sample() {
  pagedkv::PagedCache<pagedkv::NHD> cache(/*n_layers=*/2, /*n_pages=*/64, /*page_size=*/16, /*n_kv_heads=*/8,
                                          /*head_dim=*/128);
  pagedkv::SequenceTable<pagedkv::NHD> seqs(cache);
  //! [attach]
  pagedkv::PrefixCache<pagedkv::NHD> prefix(seqs);  // at most one per table; must not outlive it
  //! [attach]
  const at::Tensor system_prompt = at::arange(1000, 1040, at::kLong);  // 40 tokens: 2 full pages
  const at::Tensor first = at::cat({system_prompt, at::arange(7, 19, at::kLong)});
  const at::Tensor second = at::cat({system_prompt, at::arange(50, 75, at::kLong)});

  const int64_t a = start_request(seqs, prefix, first, /*tenant=*/1);
  seqs.release(a);  // finished: its 2 full pages stay cached
  expect(a >= 0 && prefix.n_cached() == 3 && prefix.n_evictable() == 1, "the first request's full pages cached");
  //! [peek]
  int64_t hit = prefix.peek(second, /*salt=*/1);  // 32: the two full pages of the system prompt; changes nothing
  //! [peek]
  expect(hit == 32 && prefix.peek(second, /*salt=*/2) == 0, "a hit for the tenant, none for another");
  const int64_t b = start_request(seqs, prefix, second, /*tenant=*/1);
  const auto [k, v] = cache.gather(1, seqs.batch({b}).first, seqs.batch({b}).second);
  const auto [k_ref, v_ref] = prompt_kv(second, 0);
  expect(at::equal(k, k_ref) && at::equal(v, v_ref), "cached pages plus the new ones hold the whole prompt");

  //! [stats]
  pagedkv::PrefixStats stats = prefix.stats();  // lookups 2, query_tokens 115, hit_tokens 32, ...
  prefix.check();                               // audits the tree, the index and every ref count
  //! [stats]
  expect(stats.lookups == 2 && stats.query_tokens == 51 + 64 && stats.hit_tokens == 32, "the stats quoted");
  seqs.release(b);
  //! [evict]
  int64_t freed = prefix.evict(2);  // frees up to 2 evictable pages, least recently used first
  prefix.clear();                   // every evictable page
  //! [evict]
  expect(freed == 2 && prefix.n_cached() == 0 && cache.n_free() == cache.n_pages(), "everything freed");
}

}  // namespace docs
