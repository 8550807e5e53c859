// docs/cache.md (and the README's tour): a cache, its pool, page tables,
// views, continuous batching, both layouts, bad input.
#include <pagedkv/pagedkv.hpp>

#include <string>
#include <vector>

#include "samples.hpp"

namespace docs {

void cache_sample() {
  //! [tour]
  //! [create]
  // 2 layers, 256 pages of 16 tokens, 8 kv heads of dim 128, fp16 (the default dtype).
  pagedkv::PagedCache<pagedkv::NHD> cache(/*n_layers=*/2, /*n_pages=*/256, /*page_size=*/16,
                                          /*n_kv_heads=*/8, /*head_dim=*/128);
  //! [create]

  //! [page_table]
  // The pool hands out the lowest free ids: the same calls give the same pages on every rank.
  std::vector<int64_t> pages = cache.alloc_n(4);           // {0, 1, 2, 3}; {} if fewer than 4 are free
  at::Tensor page_table = at::full({1, 8}, -1, at::kInt);  // [B, max_pages], -1 = unmapped
  for (int64_t j = 0; j < 4; ++j) page_table[0][j] = pages[j];
  //! [page_table]

  //! [write_gather]
  at::Tensor k = at::randn({1, 50, 8, 128}).to(at::kHalf);  // [B, S, H, D]: 50 prompt tokens
  at::Tensor v = at::randn({1, 50, 8, 128}).to(at::kHalf);
  at::Tensor lengths = at::tensor({50}, at::kLong);  // [B]: tokens held once the write is done
  pagedkv::CacheView<pagedkv::NHD> view = cache.bind(page_table, lengths);
  for (int64_t layer = 0; layer < cache.n_layers(); ++layer) {
    view.write(layer, /*start_pos=*/0, k, v);  // token s goes to position 0 + s
  }
  auto [keys, values] = view.gather(/*layer=*/1);  // [1, 50, 8, 128], contiguous
  //! [write_gather]
  //! [tour]
  expect(cache.k_cache().sizes() == at::IntArrayRef({2, 256, 16, 8, 128}), "NHD storage [L, P, page_size, H, D]");
  expect(pages == std::vector<int64_t>{0, 1, 2, 3} && cache.n_free() == 252, "lowest-first ids");
  expect(at::equal(keys, k) && at::equal(values, v), "gather to return what write stored");

  //! [strided]
  // k and v may be any strided view, e.g. slices of a fused QKV projection [B, S, (Hq + 2 H) * D]:
  at::Tensor qkv = at::randn({1, 50, (32 + 2 * 8) * 128}).to(at::kHalf);
  at::Tensor k_view = qkv.narrow(2, 32 * 128, 8 * 128).view({1, 50, 8, 128});  // no copy
  at::Tensor v_view = qkv.narrow(2, 40 * 128, 8 * 128).view({1, 50, 8, 128});
  view.write(/*layer=*/0, /*start_pos=*/0, k_view, v_view);
  //! [strided]
  expect(at::equal(view.gather(0).first, k_view), "strided k written as is");

  // A second sequence of 17 tokens on pages 4 and 5, in a batch with the first.
  const std::vector<int64_t> more = cache.alloc_n(2);
  at::Tensor batch_table = at::full({2, 8}, -1, at::kInt);
  batch_table[0].narrow(0, 0, 4).copy_(page_table[0].narrow(0, 0, 4));
  batch_table[1][0] = more[0];
  batch_table[1][1] = more[1];
  cache.bind(batch_table.narrow(0, 1, 1), at::tensor({17}, at::kLong))
      .write(0, 0, at::randn({1, 17, 8, 128}).to(at::kHalf), at::randn({1, 17, 8, 128}).to(at::kHalf));

  //! [decode_step]
  // Continuous batching: each sequence appends one token at its own length.
  at::Tensor starts = at::tensor({50, 17}, at::kLong);  // [B]: where each new token goes
  pagedkv::CacheView<pagedkv::NHD> step = cache.bind(batch_table, starts + 1);
  at::Tensor k1 = at::randn({2, 1, 8, 128}).to(at::kHalf);  // [B, 1, H, D]
  at::Tensor v1 = at::randn({2, 1, 8, 128}).to(at::kHalf);
  step.write(/*layer=*/0, starts, k1, v1);
  auto [k_all, v_all] = step.gather(0);  // [2, 51, 8, 128]; row 1 is zero past its 18 tokens
  //! [decode_step]
  expect(k_all.sizes() == at::IntArrayRef({2, 51, 8, 128}), "[B, max(lengths), H, D]");
  expect(at::equal(k_all[0][50], k1[0][0]) && at::equal(v_all[1][17], v1[1][0]), "each token at its own start");
  expect(k_all[1].narrow(0, 18, 33).abs().max().item<float>() == 0.0f, "zeros past a sequence's length");

  //! [layouts]
  // The same tokens in an HND cache, whose page is [n_kv_heads, page_size, head_dim].
  pagedkv::PagedCache<pagedkv::HND> hnd(2, 256, 16, 8, 128);
  std::vector<int64_t> hnd_pages = hnd.alloc_n(4);
  hnd.copy_pages_from(cache, at::tensor(pages), at::tensor(hnd_pages));  // every layer, k and v, relaid out
  at::Tensor hnd_table = at::tensor(hnd_pages, at::kInt).view({1, 4});
  auto [hnd_keys, hnd_values] = hnd.gather(/*layer=*/1, hnd_table, lengths);  // token-major, as from NHD
  //! [layouts]
  expect(hnd.k_cache().sizes() == at::IntArrayRef({2, 256, 8, 16, 128}), "HND storage [L, P, H, page_size, D]");
  expect(at::equal(hnd_keys, keys) && at::equal(hnd_values, values), "the same tokens from either layout");

  //! [sharing]
  // Two sequences may share a page: retain it for the second, free it once per holder.
  cache.retain(pages[0]);  // ref_count 2
  cache.free(pages[0]);    // ref_count 1: still allocated
  //! [sharing]
  expect(cache.ref_count(pages[0]) == 1, "one holder left");

  const at::Tensor page3_before = cache.k_cache()[0][pages[3]].clone();
  //! [bad_input]
  cache.free(pages[3]);  // page 3 goes back to the pool, but page_table still maps tokens 48..63 to it
  std::string message;
  try {
    view.write(/*layer=*/0, /*start_pos=*/48, k.narrow(1, 0, 2), v.narrow(1, 0, 2));
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();  // nothing was written, nothing changed
  }
  //! [bad_input]
  expect(message.find("pagedkv::PagedCache<NHD>::write: argument 'page_table' expected an allocated page at "
                      "page_table[0][3], got page 3 which is free (use after free)") == 0,
         "the use-after-free message the docs quote, got: " + message);
  expect(at::equal(cache.k_cache()[0][pages[3]], page3_before), "the rejected write to change nothing");

  //! [check]
  cache.check();  // audits every invariant of the pool and storage (O(n_pages): tests, debugging)
  //! [check]
}

}  // namespace docs
