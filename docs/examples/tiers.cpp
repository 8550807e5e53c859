// docs/tiers.md: a prefix cache over host memory and a disk directory; a
// page evicted from the pool comes back from host memory bit for bit, and a
// second engine (a restarted process) finds what the first left on disk.
#include <pagedkv/pagedkv.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "samples.hpp"

namespace docs {
namespace {

/// A stand-in for the model: K/V of tokens [from, n) from their ids and positions.
void tiers_prefill(pagedkv::SequenceTable<pagedkv::NHD>& seqs, int64_t seq, const at::Tensor& tokens, int64_t from) {
  const int64_t n = tokens.size(0) - from;
  auto [table, lengths] = seqs.batch({seq});
  const auto view = seqs.cache().bind(table, lengths + n);
  const at::Tensor base = (tokens.narrow(0, from, n).to(at::kFloat) * 0.01 +
                           at::arange(from, from + n, at::kFloat) * 0.001).view({1, n, 1, 1});
  const at::Tensor ramp = at::linspace(-1, 1, 4 * 64).view({1, 1, 4, 64});
  for (int64_t layer = 0; layer < seqs.cache().n_layers(); ++layer) {
    view.write(layer, from, (base + ramp).to(at::kHalf), (base - ramp).to(at::kHalf));
  }
}

/// An engine's request path, unchanged by tiers: acquire, prefill the rest, insert.
int64_t tiers_request(pagedkv::SequenceTable<pagedkv::NHD>& seqs, pagedkv::PrefixCache<pagedkv::NHD>& prefix,
                      const at::Tensor& tokens) {
  auto [seq, cached] = prefix.acquire(tokens);  // device pages first, then host memory, then the disk
  expect(seqs.prepare_append(seq, tokens.size(0) - cached), "room in the pool");
  tiers_prefill(seqs, seq, tokens, cached);
  seqs.commit_append(seq, tokens.size(0) - cached);
  prefix.insert(seq, tokens);
  return seq;
}

//! [store]
/// A tier of an engine's own (here a map; an object store or a transfer
/// engine in real life). Entries are opaque bytes: the prefix cache builds
/// and verifies them, the store only keeps them.
class MapStore final : public pagedkv::PageStore {
 public:
  std::string tier() const override { return "map"; }
  bool put(const pagedkv::PageKey& key, const at::Tensor& entry,
           std::vector<pagedkv::StoredPage>* /*pushed_out: no budget here*/) override {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_[key.hash] = entry;  // never written to again: keeping the tensor is enough
    return true;
  }
  at::Tensor get(const pagedkv::PageKey& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = entries_.find(key.hash);
    return it == entries_.end() ? at::Tensor() : it->second;  // undefined: a miss
  }
  void erase(const pagedkv::PageKey& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.erase(key.hash);
  }

 private:
  std::mutex mutex_;
  std::map<uint64_t, at::Tensor> entries_;
};
//! [store]

}  // namespace

void tiers_sample() {
  const std::string dir = (std::filesystem::temp_directory_path() / "pagedkv-docs-tiers").string();
  std::filesystem::remove_all(dir);
  const at::Tensor prompt = at::arange(500, 550, at::kLong);  // 50 tokens: 3 full pages of 16
  at::Tensor keys;  // layer 1's K of the prompt, as first computed
  {
    pagedkv::PagedCache<pagedkv::NHD> cache(/*n_layers=*/2, /*n_pages=*/16, /*page_size=*/16, /*n_kv_heads=*/4,
                                            /*head_dim=*/64);
    pagedkv::SequenceTable<pagedkv::NHD> seqs(cache);
    //! [tiers]
    pagedkv::PrefixCache<pagedkv::NHD> prefix(
        seqs, {pagedkv::host_store(/*max_bytes=*/int64_t{64} << 20),  // fastest first
               pagedkv::disk_store(dir, /*max_bytes=*/int64_t{1} << 30)});
    //! [tiers]
    //! [events]
    int64_t stored_on_disk = 0;
    prefix.set_event_listener([&](const pagedkv::PrefixEvent& e) {
      // e.type: stored, removed or cleared; e.hash and e.parent_hash chain the prompt's pages;
      // e.n_tokens: tokens up to the page's end; e.tier: "device", "host", "disk", "remote".
      if (e.type == pagedkv::PrefixEvent::Type::stored && e.tier == "disk") ++stored_on_disk;
    });
    //! [events]
    const int64_t a = tiers_request(seqs, prefix, prompt);
    keys = cache.gather(1, seqs.batch({a}).first, seqs.batch({a}).second).first;
    seqs.release(a);
    prefix.clear();  // the pool lets its 3 cached pages go: they move to host memory
    const int64_t b = tiers_request(seqs, prefix, prompt);
    expect(at::equal(cache.gather(1, seqs.batch({b}).first, seqs.batch({b}).second).first, keys),
           "the pages loaded from host memory hold the K/V first computed");
    seqs.release(b);
    //! [stats]
    pagedkv::PrefixStats stats = prefix.stats();  // hit_tokens 48: all from tiers[0], host memory
    int64_t from_host = stats.tiers[0].hit_tokens;  // also loaded_pages 3, stored_pages 3
    //! [stats]
    expect(stats.hit_tokens == 48 && from_host == 48 && stats.tiers[0].loaded_pages == 3, "the stats quoted");
    //! [persist]
    prefix.persist();  // before exit: evict what the pool caches, then host memory's entries go to the disk
    //! [persist]
    expect(stored_on_disk == 3, "the three pages written to the disk");
  }
  // A second engine (or the same one restarted) on the same directory.
  pagedkv::PagedCache<pagedkv::NHD> cache(2, 16, 16, 4, 64);
  pagedkv::SequenceTable<pagedkv::NHD> seqs(cache);
  pagedkv::PrefixCache<pagedkv::NHD> prefix(seqs, {std::make_shared<MapStore>(), pagedkv::disk_store(dir, 1 << 30)});
  const int64_t c = tiers_request(seqs, prefix, prompt);
  expect(prefix.stats().tiers[1].hit_tokens == 48, "a restarted engine loads the prompt's pages from the disk");
  expect(at::equal(cache.gather(1, seqs.batch({c}).first, seqs.batch({c}).second).first, keys),
         "and they hold the K/V first computed");
  seqs.release(c);
  prefix.clear();  // now in the engine's own tier, the first one
  const int64_t d = tiers_request(seqs, prefix, prompt);
  expect(prefix.stats().tiers[0].hit_tokens == 48, "a hit from the engine's own store");
  seqs.release(d);
  std::filesystem::remove_all(dir);
}

}  // namespace docs
