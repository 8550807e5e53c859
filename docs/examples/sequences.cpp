// docs/sequences.md: SequenceTable, a prefill, a decode step of two
// sequences that share pages (fork, copy-on-write), swapping, rollback
// (truncate), a windowed table, release.
#include <pagedkv/pagedkv.hpp>

#include <stdexcept>
#include <vector>

#include "samples.hpp"

namespace docs {

void sequences_sample() {
  pagedkv::PagedCache<pagedkv::NHD> cache(/*n_layers=*/2, /*n_pages=*/64, /*page_size=*/16, /*n_kv_heads=*/8,
                                          /*head_dim=*/128);
  const at::Tensor k = at::randn({1, 40, 8, 128}).to(at::kHalf), v = at::randn({1, 40, 8, 128}).to(at::kHalf);
  const at::Tensor k1 = at::randn({2, 1, 8, 128}).to(at::kHalf), v1 = at::randn({2, 1, 8, 128}).to(at::kHalf);

  //! [prefill]
  pagedkv::SequenceTable<pagedkv::NHD> seqs(cache);  // the cache must outlive the table
  int64_t a = seqs.create();                          // no pages, length 0
  bool ok = seqs.prepare_append(a, 40);               // 3 pages; false (nothing changed) if the pool is short
  auto [table, lengths] = seqs.batch({a});            // [1, 3] int32 page table, [1] int64 lengths = {0}
  const auto view = cache.bind(table, lengths + 40);  // lengths after the write, for attention
  for (int64_t layer = 0; layer < cache.n_layers(); ++layer) {
    view.write(layer, /*start_pos=*/0, k, v);  // k, v: [1, 40, 8, 128]; then the layer's attention
  }
  seqs.commit_append(a, 40);  // length(a) = 40
  //! [prefill]
  expect(ok && seqs.length(a) == 40 && seqs.pages(a).size() == 3, "40 tokens on 3 pages");

  //! [fork]
  int64_t b = seqs.fork(a);  // a second sample of the same prompt: shares a's 3 pages (ref_count 2 each)
  //! [fork]
  expect(cache.n_free() == 61 && cache.ref_count(seqs.pages(b)[2]) == 2, "fork allocates nothing");

  //! [decode_step]
  // One decode step for {a, b}: each appends a token at its own length.
  const std::vector<int64_t> batch = {a, b};
  for (int64_t s : batch) {
    // Token 40 lands in page 2, which a and b share: the first prepare_append copies it (copy-on-write).
    if (!seqs.prepare_append(s, 1)) throw std::runtime_error("pool short: swap a sequence out, retry");
  }
  auto [step_table, step_lengths] = seqs.batch(batch);  // [2, 3], {40, 40}
  const auto step = cache.bind(step_table, step_lengths + 1);
  for (int64_t layer = 0; layer < cache.n_layers(); ++layer) step.write(layer, step_lengths, k1, v1);
  for (int64_t s : batch) seqs.commit_append(s, 1);
  //! [decode_step]
  expect(seqs.pages(a)[2] != seqs.pages(b)[2] && seqs.pages(a)[0] == seqs.pages(b)[0], "only the last page copied");
  const auto [ka, va] = cache.gather(1, seqs.batch({a}).first, seqs.batch({a}).second);
  const auto [kb, vb] = cache.gather(1, seqs.batch({b}).first, seqs.batch({b}).second);
  expect(at::equal(ka.narrow(1, 0, 40), k) && at::equal(kb.narrow(1, 0, 40), k), "the shared prompt in both");
  expect(at::equal(ka[0][40], k1[0][0]) && at::equal(kb[0][40], k1[1][0]) && at::equal(vb[0][40], v1[1][0]),
         "each its own token 40");

  //! [swap]
  // Preemption: move b to a host cache of the same geometry and dtype (any layout or device) and back.
  pagedkv::PagedCache<pagedkv::NHD> host_cache(2, /*n_pages=*/256, 16, 8, 128);  // e.g. on the CPU for a GPU cache
  pagedkv::SequenceTable<pagedkv::NHD> host(host_cache);  // must outlive the sequences swapped into it
  bool out = seqs.swap_out(b, host);  // b's pages here are freed; b keeps its id, seqs.swapped(b) is true
  // ... later, when the pool has room again:
  bool in = seqs.swap_in(b, host);  // fresh pages here, the same 41 tokens
  //! [swap]
  const auto [kb2, vb2] = cache.gather(1, seqs.batch({b}).first, seqs.batch({b}).second);
  expect(out && in && at::equal(kb2, kb) && at::equal(vb2, vb), "the tokens back after a swap");

  //! [rollback]
  // Speculative decoding: a step writes a's next token and 4 drafts; the model accepts 2 of the drafts.
  const int64_t before = seqs.length(a);  // 41
  if (!seqs.prepare_append(a, 5)) throw std::runtime_error("pool short: swap a sequence out, retry");
  // ... batch(), bind(table, lengths + 5), write the 5 tokens, verify them in one forward pass ...
  seqs.commit_append(a, 5);
  seqs.truncate(a, before + 1 + 2);  // keeps the token and the 2 accepted drafts; later pages lose a's reference
  //! [rollback]
  expect(seqs.length(a) == 44 && seqs.capacity(a) == 48, "truncate keeps 44 tokens on 3 pages");

  //! [window]
  // Sliding-window layers get a cache and a table of their own that keep each sequence's last 32 tokens.
  pagedkv::PagedCache<pagedkv::NHD> local_cache(2, /*n_pages=*/64, 16, 8, 128);
  pagedkv::SequenceTable<pagedkv::NHD> local(local_cache, /*window=*/32);
  int64_t w = local.create();
  bool room = local.prepare_append(w, 100);  // 7 pages: the chunk's queries read back to token 0
  // ... batch(), bind(table, lengths + 100), write, attention with window 32 ...
  local.commit_append(w, 100);  // the next query (position 100) sees [69, 100]: pages 0-3 go back to the pool
  auto [local_table, local_lengths] = local.batch({w});  // row {-1, -1, -1, -1, p4, p5, p6}, lengths {100}
  //! [window]
  expect(room && local_cache.n_free() == 61 && local_table[0][3].item<int64_t>() == -1 &&
             local_table[0][4].item<int64_t>() >= 0 && local_lengths[0].item<int64_t>() == 100,
         "a windowed table holds 3 pages of 100 tokens");

  //! [release]
  seqs.release(a);
  seqs.release(b);  // every page back to the pool; the ids may be handed out again
  //! [release]
  expect(cache.n_free() == cache.n_pages() && host_cache.n_free() == host_cache.n_pages(), "no page leaked");
}

}  // namespace docs
