// The operation-script engine for a PrefixCache with tiers (fuzz_tiers, the
// corpus replay test and the property test in tests/test_property.cpp). It
// decodes bytes into a configuration (layout, K/V formats, page size 1-4, a
// device pool of 2-12 pages, a vocabulary of 2-4 token ids so that prompts
// share prefixes, tiers: host memory and a directory, host memory alone or
// the directory alone, each with a budget of a few entries; the directory's
// budget ample for some inputs; after them a server's tier when the caller
// gives one: tests/test_redis_store.cpp) and a script of: requests (acquire, prefill
// of the rest of the prompt, insert; the sequence kept or released, so that
// the pool runs short and allocations evict), releases, evict, clear,
// persist, restarts (a new engine over the same directory, after persist()
// or as after a crash, without it) and corruption of a file of the
// directory (one flipped byte after the header, or a truncation).
//
// The model is built from the KV events (PrefixCache::set_event_listener):
// per tier, the chained hashes it holds and their entries' sizes; plus,
// per hash, the K/V bytes of the page when it was first computed and the
// files this script corrupted. After every call:
//
// - the events are coherent: the device announces a page once and removes
//   only what it holds, a tier removes only what it holds, `cleared` comes
//   with an empty device, a page keeps its parent and its token count, a
//   first page has no parent, every page is one this script computed;
// - the model's counts and bytes equal n_cached() and each store's
//   n_entries() and bytes(); every tier stays within its budget;
// - a directory whose budget is ample never drops an entry it was not
//   told is corrupt (an inserted page leaves every tier only by a drop of
//   the last tier or a crash);
// - acquire matches what the model says some tier holds, page after page
//   (a corrupt file is not a page), unless the pool ran out (then no free
//   or reclaimable page is left) or the next page was dropped by the very
//   eviction that made room; every matched page holds the K/V bytes
//   recorded when it was computed, bit for bit (codes and scales); peek
//   matches what the device holds;
// - a corrupt file met by a lookup is warned about, removed and a miss;
// - PrefixCache::check() passes.
//
// Any disagreement throws pagedkv_fuzz::Failure (script.hpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../tests/warnings_capture.hpp"
#include "pagedkv/page_store.hpp"
#include "pagedkv/prefix_cache.hpp"
#include "script.hpp"  // Failure, fail, Bytes

namespace pagedkv_fuzz {

/// What a script did, for tests that check a batch of scripts reached every path.
struct TierSummary {
  int64_t loaded_pages = 0;  // pages acquire loaded from a tier
  int64_t restarts = 0;
  int64_t corruptions = 0;   // files damaged
  int64_t drops = 0;         // entries the last tier dropped
  int64_t last_tier_loaded_pages = 0;  // pages acquire loaded from the last tier
};

struct TierOptions {
  int64_t max_ops = std::numeric_limits<int64_t>::max();
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  bool trace = false;
  /// Forced parts of the configuration (the property test covers each); -1: from the input.
  int layout = -1;  // 0 NHD, 1 HND
  int formats = -1;  // index into tier_detail::kFormats
  int tiers = -1;    // 0 host + disk, 1 host, 2 disk
  int ample_disk = -1;  // 0 a budget of a few entries, 1 one nothing fills
  /// A last tier that outlives restarts (a server; tests/test_redis_store.cpp
  /// passes a redis_store), made anew for each engine, and the entries it holds
  /// once its queued writes are done. It must keep everything (no budget).
  std::function<std::shared_ptr<pagedkv::PageStore>()> remote;
  std::function<int64_t(pagedkv::PageStore&)> remote_entries;
};

namespace tier_detail {

constexpr int64_t kLayers = 2;
constexpr int64_t kHeads = 1;
constexpr int64_t kDim = 4;
constexpr int64_t kMaxLive = 3;

inline const pagedkv::KVQuant kFormats[4] = {
    pagedkv::KVQuant{},
    pagedkv::KVQuant{pagedkv::KVFormat::fp8_e4m3, pagedkv::KVFormat::fp8_e4m3},
    pagedkv::KVQuant{pagedkv::KVFormat::int8, pagedkv::KVFormat::int8},
    pagedkv::KVQuant{pagedkv::KVFormat::fp8_e4m3, pagedkv::KVFormat::int8}};

/// K/V of tokens `ids` at positions first_pos..: a function of (id,
/// position, layer) only, as a model's K/V is of its prefix.
inline at::Tensor kv_of(const std::vector<int64_t>& ids, int64_t first_pos, int64_t layer, bool is_v) {
  std::vector<float> values;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t pos = first_pos + static_cast<int64_t>(i);
    for (int64_t d = 0; d < kHeads * kDim; ++d) {
      const float x = static_cast<float>((ids[i] * 131 + pos * 17 + layer * 7 + d * 3 + (is_v ? 5 : 0)) % 61) - 30.0f;
      values.push_back(x * 0.37f);
    }
  }
  return at::tensor(values, at::kFloat).view({1, static_cast<int64_t>(ids.size()), kHeads, kDim});
}

/// A page's codes and scales, token-major, as bytes: what must come back from a tier.
template <class L>
std::vector<uint8_t> page_bytes(const pagedkv::PagedCache<L>& cache, int64_t page) {
  namespace ps = pagedkv::page_store;
  std::vector<uint8_t> out;
  const auto append = [&](const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    const auto* p = static_cast<const uint8_t*>(c.data_ptr());
    out.insert(out.end(), p, p + c.numel() * static_cast<int64_t>(c.element_size()));
  };
  append(ps::page_codes<L>(cache.k_cache(), page));
  append(ps::page_codes<L>(cache.v_cache(), page));
  if (cache.k_scales().defined()) append(ps::page_scales<L>(cache.k_scales(), page, cache.page_size(), kHeads));
  if (cache.v_scales().defined()) append(ps::page_scales<L>(cache.v_scales(), page, cache.page_size(), kHeads));
  return out;
}

inline at::Tensor ids_tensor(const std::vector<int64_t>& ids) { return at::tensor(ids, at::kLong); }

/// A fresh directory, removed with everything in it when the script ends.
struct TempDir {
  std::string path;
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pagedkv-tiers-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) fail("mkdtemp failed");
    path = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

/// What the script knows of a page it computed.
struct Page {
  uint64_t salt;
  std::vector<int64_t> tokens;  // from position 0 to the page's end
  uint64_t parent;              // the previous page's chained hash; 0 for a first page
  std::vector<uint8_t> bytes;   // its K/V as first computed
  uint64_t key;                 // its entry's PageKey
};

template <class L>
class Runner {
 public:
  Runner(Bytes& in, const TierOptions& options, pagedkv::KVQuant quant, int tiers, bool ample_disk)
      : in_(in),
        options_(options),
        page_size_(in.range(1, 4)),
        n_pages_(in.range(2, 12)),
        vocab_(in.range(2, 4)),
        quant_(quant),
        use_host_(tiers != 2),
        use_disk_(tiers != 1),
        ample_disk_(ample_disk),
        remote_name_(options.remote ? options.remote()->tier() : std::string()) {
    const int64_t entry = static_cast<int64_t>(geometry().entry_bytes(2 * page_size_));
    host_budget_ = entry * in.range(1, 6);
    disk_budget_ = ample_disk_ ? int64_t{1} << 40 : entry * in.range(1, 8);
    start();
  }

  TierSummary run() {
    for (int64_t op = 0; op < options_.max_ops && !in_.empty(); ++op) {
      if (std::chrono::steady_clock::now() > options_.deadline) break;
      step();
      verify();
    }
    for (const int64_t seq : live_) engine_->seqs.release(seq);
    live_.clear();
    engine_->prefix.clear();
    verify();
    count_last_tier_loads();
    if (engine_->prefix.n_cached() != 0) fail("clear() left ", engine_->prefix.n_cached(), " pages cached");
    return summary_;
  }

 private:
  struct Engine {
    pagedkv::PagedCache<L> cache;
    pagedkv::SequenceTable<L> seqs;
    std::shared_ptr<pagedkv::HostStore> host;
    std::shared_ptr<pagedkv::DiskStore> disk;
    std::shared_ptr<pagedkv::PageStore> remote;
    pagedkv::PrefixCache<L> prefix;
    Engine(int64_t n_pages, int64_t page_size, pagedkv::KVQuant quant, std::shared_ptr<pagedkv::HostStore> h,
           std::shared_ptr<pagedkv::DiskStore> d, std::shared_ptr<pagedkv::PageStore> r)
        : cache(kLayers, n_pages, page_size, kHeads, kDim, at::TensorOptions().dtype(at::kFloat), quant),
          seqs(cache),
          host(std::move(h)),
          disk(std::move(d)),
          remote(std::move(r)),
          prefix(seqs, stores()) {}
    std::vector<std::shared_ptr<pagedkv::PageStore>> stores() const {
      std::vector<std::shared_ptr<pagedkv::PageStore>> all;
      if (host) all.push_back(host);
      if (disk) all.push_back(disk);
      if (remote) all.push_back(remote);
      return all;
    }
  };

  pagedkv::page_store::Geometry geometry() const {
    return pagedkv::page_store::Geometry{kLayers, page_size_, kHeads, kDim, at::kFloat, quant_};
  }
  int64_t entry_bytes(int64_t n_tokens) const { return static_cast<int64_t>(geometry().entry_bytes(n_tokens)); }
  std::string last_tier() const { return !remote_name_.empty() ? remote_name_ : use_disk_ ? "disk" : "host"; }

  void trace(const std::string& what) const {
    if (options_.trace) std::fprintf(stderr, "%s\n", what.c_str());
  }

  void start() {
    auto host = use_host_ ? std::make_shared<pagedkv::HostStore>(host_budget_) : nullptr;
    auto disk = use_disk_ ? std::make_shared<pagedkv::DiskStore>(dir_.path, disk_budget_) : nullptr;
    engine_ = std::make_unique<Engine>(n_pages_, page_size_, quant_, host, disk,
                                       options_.remote ? options_.remote() : nullptr);
    engine_->prefix.set_event_listener([this](const pagedkv::PrefixEvent& e) { on_event(e); });
  }

  void on_event(const pagedkv::PrefixEvent& e) {
    std::map<uint64_t, int64_t>& held = tiers_[e.tier];
    if (e.type == pagedkv::PrefixEvent::Type::cleared) {
      if (e.tier != "device" || !held.empty()) event_failure("cleared ", e.tier, " holding ", held.size(), " pages");
      return;
    }
    const auto page = pages_.find(e.hash);
    if (page == pages_.end()) return event_failure("an event about a page never computed (", e.tier, ")");
    if (e.parent_hash != page->second.parent) event_failure("an event with another parent (", e.tier, ")");
    if (e.n_tokens != static_cast<int64_t>(page->second.tokens.size()))
      event_failure("an event with ", e.n_tokens, " tokens for a page of ", page->second.tokens.size());
    if (e.type == pagedkv::PrefixEvent::Type::stored) {
      if (e.tier == "device" && held.count(e.hash) != 0) event_failure("the device stored a page twice");
      held[e.hash] = e.n_tokens;
      // A damaged entry the directory pushed out is damaged in the next tier too.
      const bool moved_damaged = moving_damaged_ == e.hash && e.tier == remote_name_;
      if (moved_damaged) {
        corrupt_[e.tier].insert(e.hash);
      } else {
        corrupt_[e.tier].erase(e.hash);  // a new entry replaced the damaged one
      }
      moving_damaged_ = 0;
    } else {
      if (held.erase(e.hash) != 1) event_failure("removed from ", e.tier, " what it did not hold");
      if (e.tier != "device") removed_now_.insert(e.hash);
      if (e.tier == last_tier()) ++summary_.drops;
      const bool ample = e.tier == remote_name_ || (e.tier == "disk" && ample_disk_);
      if (e.tier == last_tier() && ample && corrupt_[e.tier].count(e.hash) == 0)
        event_failure("a last tier without a budget to keep (", e.tier, ") dropped an intact entry");
      moving_damaged_ = corrupt_[e.tier].erase(e.hash) != 0 ? e.hash : 0;
    }
  }

  template <class... Args>
  void event_failure(const Args&... args) {
    if (event_failure_.empty()) {
      std::ostringstream os;
      (os << ... << args);
      event_failure_ = os.str();
    }
  }

  bool held_by(const char* tier, uint64_t h) const {
    const auto it = tiers_.find(tier);
    return it != tiers_.end() && it->second.count(h) != 0;
  }
  /// Whether a lookup of page h finds it: some tier holds an intact entry of it.
  bool available(uint64_t h) const {
    for (const auto& t : tiers_) {
      if (t.second.count(h) == 0) continue;
      const auto damaged = corrupt_.find(t.first);
      if (damaged == corrupt_.end() || damaged->second.count(h) == 0) return true;
    }
    return false;
  }
  /// Whether some tier holds page h at all (intact or not).
  bool held_anywhere(uint64_t h) const {
    for (const auto& t : tiers_) {
      if (t.second.count(h) != 0) return true;
    }
    return false;
  }

  std::vector<int64_t> random_tokens(int64_t n) {
    std::vector<int64_t> t;
    for (int64_t i = 0; i < n; ++i) t.push_back(in_.range(0, vocab_ - 1));
    return t;
  }

  /// The chained hashes (and entry keys) of prompt's first n_full pages.
  std::vector<std::pair<uint64_t, uint64_t>> chain_of(const std::vector<int64_t>& prompt, uint64_t salt,
                                                      int64_t n_full) const {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    uint64_t h = pagedkv::prefix_hash::salt_seed(salt);
    uint64_t key = pagedkv::page_store::key_seed(geometry(), salt);
    for (int64_t j = 0; j < n_full; ++j) {
      h = pagedkv::prefix_hash::page(h, prompt.data() + j * page_size_, page_size_);
      key = pagedkv::page_store::next_key(key, prompt.data() + j * page_size_, page_size_).hash;
      out.emplace_back(h, key);
    }
    return out;
  }

  /// Records every full page of seq (computed by this script) before insert announces them.
  void learn(int64_t seq, const std::vector<int64_t>& prompt, uint64_t salt) {
    const auto& cache = engine_->cache;
    const auto& pages = engine_->seqs.pages(seq);
    const int64_t n_full = engine_->seqs.length(seq) / page_size_;
    const auto chain = chain_of(prompt, salt, n_full);
    for (int64_t j = 0; j < n_full; ++j) {
      const uint64_t h = chain[static_cast<size_t>(j)].first;
      std::vector<uint8_t> bytes = page_bytes(cache, pages[static_cast<size_t>(j)]);
      const auto it = pages_.find(h);
      if (it != pages_.end()) {
        if (it->second.bytes != bytes) fail("page ", j, " computed again holds other K/V bytes");
        continue;
      }
      pages_[h] = Page{salt,
                       std::vector<int64_t>(prompt.begin(), prompt.begin() + (j + 1) * page_size_),
                       j == 0 ? 0 : chain[static_cast<size_t>(j - 1)].first,
                       std::move(bytes),
                       chain[static_cast<size_t>(j)].second};
    }
  }

  void request() {
    auto& e = *engine_;
    const std::vector<int64_t> prompt = random_tokens(in_.range(1, 5 * page_size_ + 1));
    const uint64_t salt = static_cast<uint64_t>(in_.range(0, 1));
    const int64_t n = static_cast<int64_t>(prompt.size());
    const int64_t cap_pages = (n - 1) / page_size_;
    const auto chain = chain_of(prompt, salt, cap_pages);
    int64_t on_device = 0;
    while (on_device < cap_pages && held_by("device", chain[static_cast<size_t>(on_device)].first)) ++on_device;
    int64_t want = on_device;
    while (want < cap_pages && available(chain[static_cast<size_t>(want)].first)) ++want;
    // A corrupt file the lookup will meet: a warning and a miss.
    const bool meets_corrupt = want < cap_pages && held_anywhere(chain[static_cast<size_t>(want)].first);
    if (e.prefix.peek(ids_tensor(prompt), salt) != on_device * page_size_)
      fail("peek matched ", e.prefix.peek(ids_tensor(prompt), salt) / page_size_, " pages, the device holds ",
           on_device);
    removed_now_.clear();
    pagedkv_test::Warnings warnings;
    const auto [seq, matched] = e.prefix.acquire(ids_tensor(prompt), salt);
    const int64_t got = matched / page_size_;
    trace("acquire " + std::to_string(n) + " tokens salt " + std::to_string(salt) + ": " + std::to_string(got) +
          " pages, model " + std::to_string(want) + " (" + std::to_string(on_device) + " on the device)");
    if (got > want) fail("acquire matched ", got, " pages, the model's tiers hold ", want);
    if (got < on_device) fail("acquire matched ", got, " pages, the device holds ", on_device);
    if (got < want) {
      const bool short_pool = e.cache.n_free() + e.prefix.n_reclaimable() == 0;
      const bool dropped = removed_now_.count(chain[static_cast<size_t>(got)].first) != 0 &&
                           !available(chain[static_cast<size_t>(got)].first);
      if (!short_pool && !dropped)
        fail("acquire matched ", got, " pages, the model's tiers hold ", want, " and the pool has room");
    }
    if (meets_corrupt && got == want && warnings.messages.empty() &&
        e.cache.n_free() + e.prefix.n_reclaimable() > 0)
      fail("a lookup met a corrupt file without a warning");
    for (int64_t j = 0; j < got; ++j) {
      const auto it = pages_.find(chain[static_cast<size_t>(j)].first);
      if (it == pages_.end()) fail("acquire matched page ", j, ", which this script never computed");
      if (page_bytes(e.cache, e.seqs.pages(seq)[static_cast<size_t>(j)]) != it->second.bytes)
        fail("page ", j, " of the match holds other K/V bytes than were computed (", got - on_device,
             " pages loaded from tiers)");
    }
    summary_.loaded_pages += got - on_device;
    if (!e.seqs.prepare_append(seq, n - matched)) {
      e.seqs.release(seq);
      return;
    }
    const std::vector<int64_t> rest(prompt.begin() + matched, prompt.end());
    const auto table = e.seqs.batch({seq});
    for (int64_t layer = 0; layer < kLayers; ++layer)
      e.cache.write(layer, table.first, matched, kv_of(rest, matched, layer, false),
                    kv_of(rest, matched, layer, true));
    e.seqs.commit_append(seq, n - matched);
    if (in_.range(0, 3) != 0) {
      learn(seq, prompt, salt);
      e.prefix.insert(seq, ids_tensor(prompt), salt);
    }
    if (static_cast<int64_t>(live_.size()) < kMaxLive && in_.flag()) {
      live_.push_back(seq);
    } else {
      e.seqs.release(seq);
    }
  }

  void count_last_tier_loads() { summary_.last_tier_loaded_pages += engine_->prefix.stats().tiers.back().loaded_pages; }

  /// Restarts the engine over the same directory: after persist(), or as
  /// after a crash (the device and host memory are lost without events).
  void restart(bool persist) {
    for (const int64_t seq : live_) engine_->seqs.release(seq);
    live_.clear();
    if (persist) {
      engine_->prefix.persist();
      if (!tiers_["device"].empty()) fail("persist() left pages on the device");
      if (use_disk_ && !tiers_["host"].empty()) fail("persist() left entries in host memory");
    }
    trace(persist ? "restart after persist" : "restart as after a crash");
    ++summary_.restarts;
    count_last_tier_loads();
    engine_.reset();  // the disk store writes what it queued
    tiers_["device"].clear();
    tiers_["host"].clear();
    start();
  }

  /// Damages the file of an entry the directory holds: a flipped byte after
  /// the header, or a truncation that keeps the header (a damaged header
  /// would hide the page's hashes from the events that remove it).
  void corrupt() {
    if (!use_disk_ || tiers_["disk"].empty()) return;
    engine_->disk->flush();
    auto it = tiers_["disk"].begin();
    std::advance(it, in_.range(0, static_cast<int64_t>(tiers_["disk"].size()) - 1));
    const uint64_t h = it->first;
    if (corrupt_["disk"].count(h) != 0) return;  // damaged already (maybe truncated to its header)
    const std::string path = dir_.path + "/" + pagedkv::PageKey{pages_.at(h).key}.name() + ".pkv";
    std::error_code ec;
    const auto size = static_cast<int64_t>(std::filesystem::file_size(path, ec));
    if (ec) fail("the directory lacks the file of an entry the events say it holds: ", path);
    constexpr int64_t kHeader = sizeof(pagedkv::page_store::Header);
    if (in_.flag()) {
      const int64_t at = in_.range(kHeader, size - 1);
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(at);
      const char c = static_cast<char>(f.get());
      f.seekp(at);
      f.put(static_cast<char>(c ^ static_cast<char>(1 + in_.range(0, 254))));
    } else {
      std::filesystem::resize_file(path, static_cast<uintmax_t>(in_.range(kHeader, size - 1)));
    }
    corrupt_["disk"].insert(h);
    ++summary_.corruptions;
    trace("corrupt the file of a page of " + std::to_string(it->second) + " tokens");
  }

  void step() {
    auto& e = *engine_;
    const int64_t kind = in_.range(0, 11);
    if (kind <= 4) return request();
    switch (kind) {
      case 5:
        if (!live_.empty()) {
          const auto i = static_cast<size_t>(in_.range(0, static_cast<int64_t>(live_.size()) - 1));
          e.seqs.release(live_[i]);
          live_.erase(live_.begin() + static_cast<std::ptrdiff_t>(i));
        }
        return;
      case 6:
      case 7:
        e.prefix.evict(in_.range(0, 4));
        return;
      case 8:
        e.prefix.clear();
        if (e.prefix.n_evictable() != 0) fail("clear() left evictable pages");
        return;
      case 9:
        e.prefix.persist();
        return;
      case 10:
        return restart(in_.flag());
      default:
        return corrupt();
    }
  }

  void verify() {
    auto& e = *engine_;
    if (!event_failure_.empty()) fail("events: ", event_failure_);
    try {
      e.prefix.check();
    } catch (const c10::Error& ex) {
      fail("check(): ", ex.what_without_backtrace());
    }
    if (e.prefix.n_cached() != static_cast<int64_t>(tiers_["device"].size()))
      fail("n_cached ", e.prefix.n_cached(), ", the events say ", tiers_["device"].size());
    const auto bytes_of = [&](const char* tier) {
      int64_t sum = 0;
      for (const auto& p : tiers_[tier]) sum += entry_bytes(p.second);
      return sum;
    };
    if (use_host_) {
      if (e.host->n_entries() != static_cast<int64_t>(tiers_["host"].size()) || e.host->bytes() != bytes_of("host"))
        fail("host memory holds ", e.host->n_entries(), " entries of ", e.host->bytes(), " bytes, the events say ",
             tiers_["host"].size(), " of ", bytes_of("host"));
      if (e.host->bytes() > host_budget_) fail("host memory is over its budget");
    }
    if (use_disk_) {
      // A truncated file counts its new size once a restart lists the directory.
      if (e.disk->n_entries() != static_cast<int64_t>(tiers_["disk"].size()) ||
          (corrupt_["disk"].empty() && e.disk->bytes() != bytes_of("disk")))
        fail("the directory holds ", e.disk->n_entries(), " entries of ", e.disk->bytes(), " bytes, the events say ",
             tiers_["disk"].size(), " of ", bytes_of("disk"));
      if (e.disk->bytes() > disk_budget_) fail("the directory is over its budget");
    }
    if (e.remote && options_.remote_entries) {
      const int64_t n = options_.remote_entries(*e.remote);
      if (n != static_cast<int64_t>(tiers_[remote_name_].size()))
        fail("the ", remote_name_, " tier holds ", n, " entries, the events say ", tiers_[remote_name_].size());
    }
  }

  Bytes& in_;
  TierOptions options_;
  int64_t page_size_;
  int64_t n_pages_;
  int64_t vocab_;
  pagedkv::KVQuant quant_;
  bool use_host_;
  bool use_disk_;
  bool ample_disk_;
  std::string remote_name_;  // empty: no remote tier
  int64_t host_budget_ = 0;
  int64_t disk_budget_ = 0;
  TempDir dir_;
  std::map<uint64_t, Page> pages_;                        // every page computed, by chained hash
  std::map<std::string, std::map<uint64_t, int64_t>> tiers_;  // tier -> hash -> tokens, from the events
  std::map<std::string, std::set<uint64_t>> corrupt_;  // tier -> hashes of damaged entries (files, what they moved to)
  uint64_t moving_damaged_ = 0;  // a damaged entry the last event removed from the directory
  std::set<uint64_t> removed_now_;                        // removed from a tier during the current acquire
  std::string event_failure_;
  std::vector<int64_t> live_;
  TierSummary summary_;
  std::unique_ptr<Engine> engine_;  // last: its listener uses the members above
};

}  // namespace tier_detail

/// Runs one script; throws Failure when the cache or a tier disagrees with the model.
inline TierSummary run_tier_script(const uint8_t* data, size_t size, const TierOptions& options = {}) {
  Bytes in(data, size);
  // The stores' warnings (an entry over a budget, a corrupt file) are expected here.
  pagedkv_test::Warnings quiet;
  const bool nhd = options.layout >= 0 ? options.layout == 0 : in.flag();
  const int formats = options.formats >= 0 ? options.formats : static_cast<int>(in.range(0, 3));
  const int tiers = options.tiers >= 0 ? options.tiers : static_cast<int>(in.range(0, 3) % 3);
  const bool ample = options.ample_disk >= 0 ? options.ample_disk == 1 : in.flag();
  const pagedkv::KVQuant quant = tier_detail::kFormats[formats];
  if (nhd) {
    return tier_detail::Runner<pagedkv::NHD>(in, options, quant, tiers, ample).run();
  }
  return tier_detail::Runner<pagedkv::HND>(in, options, quant, tiers, ample).run();
}

}  // namespace pagedkv_fuzz
