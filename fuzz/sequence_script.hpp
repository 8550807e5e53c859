// The operation-script engine for SequenceTable (fuzz_sequences, the corpus
// replay test). It decodes bytes into a configuration (device and host
// layout, dtype float32/float16, K/V formats (native, or K and/or V
// quantized to fp8 e4m3 / int8, the same in every cache), kernel backend,
// 1-2 layers, a device cache
// of 1-16 pages, a host cache of 0-16 pages, page size 1-5, 1-2 heads, head
// dim 1-3) and a script of SequenceTable calls: create, fork, release,
// reserve, prepare_append, commit_append, truncate, batch, swap_out, swap_in
// and the inspection calls, with valid and invalid arguments (unknown and released
// ids, negative and huge counts, calls on swapped sequences and on host-side
// holders, commits past the capacity, the wrong host table: this one, one
// over the same cache, one of another geometry or dtype). Appends are real:
// prepare_append -> PagedCache::write(layer, batch() page table, start, k, v)
// for every layer -> commit_append, one sequence or a batch of them, with a
// distinct bit pattern per (token, layer, k/v, element).
//
// Up to two tables carry sequences: table 0 over the device cache and, when
// the host cache has pages, table 1 over it; either may swap out into the
// other (their layouts are drawn independently). For a quarter of the
// inputs table 0 has a window (1-12 tokens; table 1 too for half of those):
// after each commit the model releases the pages wholly before the next
// query's window, and truncate below the held window must throw. The model keeps, per table
// and id: live, holder (of another table's swapped sequence), swapped (and
// where to), length, the page list, and the token id at every position.
// After every call:
//
// - the call must succeed, return false (a pool that is short), or throw
//   c10::Error naming the pagedkv:: function, exactly as the model says;
// - a call that threw or returned false changed nothing: n_free, every
//   ref_count and the K/V storage (codes and scales) of every cache, and every sequence's
//   liveness, length, swapped state and pages in every table;
// - a call that succeeded returned the model's id / length / page table and
//   changed the pages as the model says (new pages were free before; after
//   prepare_append every page the append lands in has ref_count 1);
// - every table answers contains / length / swapped / pages / capacity /
//   size / window as the model, every ref_count equals the number of
//   sequences that hold the page, and PagedCache::check() and
//   SequenceTable::check() pass;
// - every check_every calls (and at the end): every live, resident sequence
//   of each table (host-side holders included) is gathered through batch()
//   (the held columns only, for rows with released ones)
//   and compared with the model bit for bit, layer by layer (a quantized
//   side: the written head vector through the library's scalar codec,
//   dequantized and rounded to the dtype; this catches
//   copy-on-write bugs: a fork's parent and child must not see each other's
//   later appends);
// - at the end every sequence is released (or, for some inputs, the tables
//   are destroyed) and every cache must have n_free == n_pages.
//
// Any disagreement throws pagedkv_fuzz::Failure (script.hpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "pagedkv/pagedkv.hpp"
#include "script.hpp"  // Failure, fail, Bytes, detail::join

namespace pagedkv_fuzz {

struct SequenceOptions {
  int64_t max_layers = 2;
  int64_t max_pages = 16;
  int64_t max_host_pages = 16;
  int64_t max_page_size = 5;
  int64_t max_heads = 2;
  int64_t max_head_dim = 3;
  /// Tokens per append (prepare_append / commit_append counts also go past it).
  int64_t max_tokens = 7;
  /// Sequences per batched append or batch() call.
  int64_t max_batch = 3;
  /// The gathered-tokens comparison every n calls (the rest runs after each).
  int64_t check_every = 4;
  int64_t max_ops = std::numeric_limits<int64_t>::max();
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  /// Prints every call to stderr.
  bool trace = false;
};

struct SequenceStats {
  int64_t calls = 0;
  int64_t succeeded = 0;
  int64_t threw = 0;
  int64_t short_pool = 0;  // returned false
  int64_t data_checks = 0;
  int64_t tokens_written = 0;
};

namespace seq_detail {

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max();
/// A position committed without a write: its value is not checked.
constexpr int64_t kUnknownToken = -1;
/// In learn_pages' expected list: a page that was free before the call.
constexpr int64_t kFresh = -2;

/// Table slots: 0 and 1 carry sequences (the device table and the host
/// table); 2-4 stay empty and serve as wrong hosts.
constexpr int kDev = 0;
constexpr int kHost = 1;
constexpr int kDevSame = 2;   // another table over the device cache
constexpr int kHostSame = 3;  // another table over the host cache
constexpr int kAlt = 4;       // a table over a cache of another geometry or dtype
constexpr int kTables = 5;
constexpr int kAltCache = 2;  // cache slots: 0 device, 1 host, 2 alt

struct SeqModel {
  bool live = false;
  bool holder = false;   // holds another table's swapped-out sequence
  bool swapped = false;  // an owner whose tokens are in table `host`
  int host = -1;
  int64_t host_seq = -1;
  int owner = -1;  // a holder's owner: table and id
  int64_t owner_seq = -1;
  int64_t length = 0;
  std::vector<int64_t> pages;
  std::vector<int64_t> tokens;  // owners: a token id per position, or kUnknownToken
};

struct TableModel {
  std::vector<SeqModel> seqs;  // indexed by id; mirrors the table's id space
  bool live(int64_t id) const { return id >= 0 && id < static_cast<int64_t>(seqs.size()) && at(id).live; }
  const SeqModel& at(int64_t id) const { return seqs[static_cast<size_t>(id)]; }
  SeqModel& at(int64_t id) { return seqs[static_cast<size_t>(id)]; }
  /// The id create() / fork() / a holder gets.
  int64_t lowest_unused() const {
    for (size_t i = 0; i < seqs.size(); ++i)
      if (!seqs[i].live) return static_cast<int64_t>(i);
    return static_cast<int64_t>(seqs.size());
  }
  SeqModel& slot(int64_t id) {
    if (id >= static_cast<int64_t>(seqs.size())) seqs.resize(static_cast<size_t>(id) + 1);
    return at(id);
  }
};

struct CacheState {
  at::Tensor k, v;
  at::Tensor k_scales, v_scales;  // undefined for a native side
  std::vector<int64_t> refs;
  int64_t n_free = 0;
};

struct SeqState {
  bool live = false;
  int64_t length = 0;
  bool swapped = false;
  std::vector<int64_t> pages;
  bool operator==(const SeqState& o) const {
    return live == o.live && length == o.length && swapped == o.swapped && pages == o.pages;
  }
};

struct TableState {
  int64_t size = 0;
  std::vector<SeqState> seqs;
};

struct State {
  std::vector<CacheState> caches;
  std::vector<TableState> tables;
};

struct Config {
  bool dev_hnd = false;
  bool host_hnd = false;
  at::ScalarType dtype = at::kFloat;
  int alt_kind = 0;  // what the alt cache differs in: dtype, page_size, head_dim, n_layers
  pagedkv::KVQuant quant;  // every cache's formats
  bool destroy_at_end = false;
  int64_t n_layers = 1, n_pages = 1, host_pages = 0, page_size = 1, n_heads = 1, head_dim = 1;
  int64_t windows[2] = {0, 0};  // of the tables that carry sequences (dev, host)
};

inline bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<size_t>(a.numel()) * a.element_size()) == 0;
}

/// A distinct bit pattern per value index: float32 +-[0, 2^24) (exact
/// integers), float16 any finite pattern (subnormals and -0 included).
inline uint32_t value_bits(uint64_t index, bool half) {
  if (half) return static_cast<uint32_t>(((index & 1u) << 15) | ((index >> 1) % 0x7C00u));
  float f = static_cast<float>((index >> 1) % (uint64_t{1} << 24));
  if ((index & 1u) != 0) f = -f;
  uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline const char* name(int table) {
  static const char* const names[] = {"dev", "host", "dev_same", "host_same", "alt"};
  return table >= 0 && table < kTables ? names[table] : "?";
}

}  // namespace seq_detail

template <class DL, class HL>
class SequenceRunner {
  using SeqModel = seq_detail::SeqModel;
  using TableModel = seq_detail::TableModel;
  using State = seq_detail::State;
  using Config = seq_detail::Config;

 public:
  SequenceRunner(Bytes& in, const SequenceOptions& opt, const Config& cfg)
      : in_(in),
        opt_(opt),
        cfg_(cfg),
        hd_(cfg.n_heads * cfg.head_dim),
        half_(cfg.dtype == at::kHalf),
        dev_cache_(cfg.n_layers, cfg.n_pages, cfg.page_size, cfg.n_heads, cfg.head_dim, options(cfg.dtype), cfg.quant),
        alt_cache_(cfg.n_layers + (cfg.alt_kind == 3 ? 1 : 0), 2, cfg.page_size + (cfg.alt_kind == 1 ? 1 : 0),
                   cfg.n_heads, cfg.head_dim + (cfg.alt_kind == 2 ? 1 : 0),
                   options(cfg.alt_kind == 0 ? (half_ ? at::kFloat : at::kHalf) : cfg.dtype), cfg.quant) {
    if (cfg.host_pages > 0) {
      host_cache_.emplace(cfg.n_layers, cfg.host_pages, cfg.page_size, cfg.n_heads, cfg.head_dim, options(cfg.dtype),
                          cfg.quant);
      host_.emplace(*host_cache_, cfg.windows[seq_detail::kHost]);
      host_same_.emplace(*host_cache_);
    }
    dev_.emplace(dev_cache_, cfg.windows[seq_detail::kDev]);
    dev_same_.emplace(dev_cache_);
    alt_.emplace(alt_cache_);
  }

  SequenceStats run() {
    try {
      check_structure();
      while (!in_.empty() && stats_.calls < opt_.max_ops && std::chrono::steady_clock::now() < opt_.deadline) {
        step();
        ++stats_.calls;
        check_structure();
        if (stats_.calls % opt_.check_every == 0) check_data();
      }
      check_data();
      finish();
    } catch (const c10::Error& e) {
      fail("a checking call threw: ", e.what_without_backtrace());
    }
    return stats_;
  }

 private:
  enum class Want { ok, short_pool, error };

  static at::TensorOptions options(at::ScalarType dtype) { return at::TensorOptions().dtype(dtype); }
  static const char* name(Want w) {
    return w == Want::ok ? "success" : w == Want::short_pool ? "false (pool short)" : "a c10::Error";
  }

  bool has_host() const { return host_.has_value(); }
  int64_t P() const { return cfg_.page_size; }
  int64_t pages_for(int64_t n_tokens) const { return n_tokens / P() + (n_tokens % P() != 0 ? 1 : 0); }
  static int cache_of(int table) {
    switch (table) {
      case seq_detail::kDev: case seq_detail::kDevSame: return 0;
      case seq_detail::kHost: case seq_detail::kHostSame: return 1;
      default: return seq_detail::kAltCache;
    }
  }

  template <class F>
  void with_table(int t, F&& f) {
    switch (t) {
      case seq_detail::kDev: f(*dev_); break;
      case seq_detail::kHost: f(*host_); break;
      case seq_detail::kDevSame: f(*dev_same_); break;
      case seq_detail::kHostSame: f(*host_same_); break;
      default: f(*alt_); break;
    }
  }
  template <class F>
  void with_cache(int c, F&& f) {
    switch (c) {
      case 0: f(dev_cache_); break;
      case 1: f(*host_cache_); break;
      default: f(alt_cache_); break;
    }
  }
  bool table_exists(int t) const { return (t != seq_detail::kHost && t != seq_detail::kHostSame) || has_host(); }
  bool cache_exists(int c) const { return c != 1 || has_host(); }
  int64_t cache_pages(int c) const {
    return c == 0 ? cfg_.n_pages : c == 1 ? cfg_.host_pages : alt_cache_.n_pages();
  }

  // ---------------------------------------------------------------- the model's pool

  /// Per page of cache c: how many model sequences hold it.
  std::vector<int64_t> model_refs(int c) const {
    std::vector<int64_t> refs(static_cast<size_t>(cache_pages(c)), 0);
    if (c > 1) return refs;
    for (const SeqModel& s : model_[c].seqs)
      if (s.live)
        for (int64_t p : s.pages)
          if (p != pagedkv::kUnmappedPage) ++refs[static_cast<size_t>(p)];
    return refs;
  }
  /// Leading columns a sequence of table t with `length` tokens released:
  /// those wholly before the next query's window.
  int64_t dropped_for(int t, int64_t length) const {
    const int64_t w = cfg_.windows[t];
    return w == 0 || length < w ? 0 : (length - w + 1) / P();
  }
  /// The leading -1 columns of a model page list.
  static int64_t released(const std::vector<int64_t>& pages) {
    int64_t j = 0;
    while (j < static_cast<int64_t>(pages.size()) && pages[static_cast<size_t>(j)] == pagedkv::kUnmappedPage) ++j;
    return j;
  }
  int64_t model_n_free(int c) const {
    const std::vector<int64_t> refs = model_refs(c);
    return static_cast<int64_t>(std::count(refs.begin(), refs.end(), 0));
  }
  bool owned(int t, int64_t id) const {
    return model_[t].live(id) && !model_[t].at(id).holder && !model_[t].at(id).swapped;
  }
  /// A holder's tokens are its owner's.
  const std::vector<int64_t>& tokens_of(int t, int64_t id) const {
    const SeqModel& s = model_[t].at(id);
    return s.holder ? model_[s.owner].at(s.owner_seq).tokens : s.tokens;
  }

  // ---------------------------------------------------------------- state and calls

  /// Everything a failing call must leave unchanged; `full` false: only the
  /// ref counts (what learn_pages needs after a call that must succeed).
  State snapshot(bool full = true) {
    State s;
    for (int c = 0; c < 3; ++c) {
      s.caches.emplace_back();
      if (!cache_exists(c)) continue;
      with_cache(c, [&](const auto& cache) {
        seq_detail::CacheState& cs = s.caches.back();
        if (full) {
          cs.k = cache.k_cache().clone();
          cs.v = cache.v_cache().clone();
          if (cache.k_scales().defined()) cs.k_scales = cache.k_scales().clone();
          if (cache.v_scales().defined()) cs.v_scales = cache.v_scales().clone();
        }
        cs.n_free = cache.n_free();
        for (int64_t p = 0; p < cache.n_pages(); ++p) cs.refs.push_back(cache.ref_count(p));
      });
    }
    if (!full) return s;
    for (int t = 0; t < seq_detail::kTables; ++t) {
      s.tables.emplace_back();
      if (!table_exists(t)) continue;
      const int64_t span = (t <= seq_detail::kHost ? static_cast<int64_t>(model_[t].seqs.size()) : 0) + 2;
      with_table(t, [&](const auto& table) {
        seq_detail::TableState& ts = s.tables.back();
        ts.size = table.size();
        for (int64_t id = 0; id < span; ++id) {
          seq_detail::SeqState ss;
          ss.live = table.contains(id);
          if (ss.live) {
            ss.length = table.length(id);
            ss.swapped = table.swapped(id);
            ss.pages = table.pages(id);
          }
          ts.seqs.push_back(std::move(ss));
        }
      });
    }
    return s;
  }

  void expect_unchanged(const std::string& what, const char* how) {
    const State after = snapshot();
    for (size_t c = 0; c < after.caches.size(); ++c) {
      const auto& b = before_.caches[c];
      const auto& a = after.caches[c];
      if (!b.k.defined()) continue;
      if (!seq_detail::same_bytes(b.k, a.k) || !seq_detail::same_bytes(b.v, a.v))
        fail(what, " ", how, " but changed the K/V storage of cache ", c);
      if (!seq_detail::same_bytes(b.k_scales, a.k_scales) || !seq_detail::same_bytes(b.v_scales, a.v_scales))
        fail(what, " ", how, " but changed the K/V scales of cache ", c);
      if (a.refs != b.refs || a.n_free != b.n_free)
        fail(what, " ", how, " but changed the pool of cache ", c, ": refs ", detail::join(b.refs), " -> ",
             detail::join(a.refs), ", n_free ", b.n_free, " -> ", a.n_free);
    }
    for (size_t t = 0; t < after.tables.size(); ++t) {
      const auto& b = before_.tables[t];
      const auto& a = after.tables[t];
      if (a.size != b.size) fail(what, " ", how, " but changed table ", seq_detail::name(static_cast<int>(t)), "'s size");
      for (size_t id = 0; id < std::min(a.seqs.size(), b.seqs.size()); ++id)
        if (!(a.seqs[id] == b.seqs[id]))
          fail(what, " ", how, " but changed sequence ", id, " of table ", seq_detail::name(static_cast<int>(t)),
               ": length ", b.seqs[id].length, " -> ", a.seqs[id].length, ", pages ", detail::join(b.seqs[id].pages),
               " -> ", detail::join(a.seqs[id].pages));
    }
  }

  /// Runs `call` (returns the call's bool, or true); its outcome must be
  /// `want`, and a call that threw or returned false must change nothing.
  template <class F>
  Want attempt(const std::string& what, Want want, F&& call) {
    if (opt_.trace)
      std::fprintf(stderr, "[%lld] %s expect %s\n", static_cast<long long>(stats_.calls), what.c_str(), name(want));
    // A call that must succeed fails the run if it does not: no need to
    // compare what it left.
    before_ = snapshot(want != Want::ok);
    bool result = true;
    try {
      result = call();
    } catch (const c10::Error& e) {
      ++stats_.threw;
      const std::string message = e.what_without_backtrace();
      if (want != Want::error) fail(what, " threw but the model expected ", name(want), ": ", message);
      if (message.find("pagedkv::") == std::string::npos) fail(what, " threw a message without the function: ", message);
      expect_unchanged(what, "threw");
      return Want::error;
    } catch (const Failure&) {
      throw;
    } catch (const std::exception& e) {
      fail(what, " threw a non-c10::Error exception: ", e.what());
    }
    if (!result) {
      ++stats_.short_pool;
      if (want != Want::short_pool) fail(what, " returned false but the model expected ", name(want));
      expect_unchanged(what, "returned false");
      return Want::short_pool;
    }
    ++stats_.succeeded;
    if (want != Want::ok) fail(what, " succeeded but the model expected ", name(want));
    return Want::ok;
  }

  /// After a successful call: sequence id of table t has the pages
  /// `expected`, where kFresh stands for a page that was free before the
  /// call (each a different one). The model takes the actual list.
  void learn_pages(const std::string& what, int t, int64_t id, const std::vector<int64_t>& expected) {
    std::vector<int64_t> actual;
    with_table(t, [&](const auto& table) { actual = table.pages(id); });
    const std::vector<int64_t>& refs_before = before_.caches[static_cast<size_t>(cache_of(t))].refs;
    bool ok = actual.size() == expected.size();
    std::vector<int64_t> fresh;
    for (size_t j = 0; ok && j < actual.size(); ++j) {
      const int64_t p = actual[j];
      if (expected[j] != seq_detail::kFresh) {
        ok = p == expected[j];
      } else {
        ok = p >= 0 && p < static_cast<int64_t>(refs_before.size()) && refs_before[static_cast<size_t>(p)] == 0 &&
             std::find(fresh.begin(), fresh.end(), p) == fresh.end();
        fresh.push_back(p);
      }
    }
    if (!ok)
      fail(what, ": sequence ", id, " of table ", seq_detail::name(t), " has pages ", detail::join(actual),
           ", model ", detail::join(expected), " (-2: a page free before the call; free then: refs ",
           detail::join(refs_before), ")");
    model_[t].at(id).pages = std::move(actual);
  }

  // ---------------------------------------------------------------- checks

  void check_structure() {
    for (int t = 0; t <= seq_detail::kHost; ++t) {
      if (!table_exists(t)) continue;
      const TableModel& m = model_[t];
      with_table(t, [&](const auto& table) {
        int64_t n_live = 0;
        for (int64_t id = 0; id < static_cast<int64_t>(m.seqs.size()) + 2; ++id) {
          const bool live = m.live(id);
          if (table.contains(id) != live)
            fail("table ", seq_detail::name(t), ": contains(", id, ") = ", !live, ", model ", live);
          if (!live) continue;
          ++n_live;
          const SeqModel& s = m.at(id);
          if (table.length(id) != s.length)
            fail("table ", seq_detail::name(t), ": length(", id, ") = ", table.length(id), ", model ", s.length);
          if (table.swapped(id) != s.swapped)
            fail("table ", seq_detail::name(t), ": swapped(", id, ") = ", table.swapped(id), ", model ", s.swapped);
          if (table.pages(id) != s.pages)
            fail("table ", seq_detail::name(t), ": pages(", id, ") = ", detail::join(table.pages(id)), ", model ",
                 detail::join(s.pages));
          if (table.capacity(id) != static_cast<int64_t>(s.pages.size()) * P())
            fail("table ", seq_detail::name(t), ": capacity(", id, ") = ", table.capacity(id), " with ",
                 s.pages.size(), " pages of ", P());
          // The model's own invariants (a bug here is the harness's).
          if (s.holder) {
            const TableModel& owner = model_[s.owner];
            if (!owner.live(s.owner_seq) || !owner.at(s.owner_seq).swapped || owner.at(s.owner_seq).host != t ||
                owner.at(s.owner_seq).host_seq != id || owner.at(s.owner_seq).length != s.length ||
                static_cast<int64_t>(s.pages.size()) != pages_for(s.length))
              fail("harness: holder ", id, " of table ", seq_detail::name(t), " is inconsistent");
          } else if (s.swapped ? !s.pages.empty() || !model_[s.host].live(s.host_seq)
                               : static_cast<int64_t>(s.pages.size()) * P() < s.length ||
                                     static_cast<int64_t>(s.tokens.size()) != s.length ||
                                     released(s.pages) != dropped_for(t, s.length)) {
            fail("harness: sequence ", id, " of table ", seq_detail::name(t), " is inconsistent");
          }
        }
        if (table.size() != n_live) fail("table ", seq_detail::name(t), ": size() = ", table.size(), ", model ", n_live);
        if (table.window() != cfg_.windows[t])
          fail("table ", seq_detail::name(t), ": window() = ", table.window(), ", model ", cfg_.windows[t]);
        try {
          table.check();
        } catch (const c10::Error& e) {
          fail("SequenceTable::check() failed on table ", seq_detail::name(t), ": ", e.what_without_backtrace());
        }
      });
    }
    for (int t = seq_detail::kDevSame; t < seq_detail::kTables; ++t) {
      if (!table_exists(t)) continue;
      with_table(t, [&](const auto& table) {
        if (table.size() != 0 || table.contains(0))
          fail("table ", seq_detail::name(t), " (never given a sequence) has size ", table.size());
      });
    }
    for (int c = 0; c < 3; ++c) {
      if (!cache_exists(c)) continue;
      const std::vector<int64_t> refs = model_refs(c);
      with_cache(c, [&](const auto& cache) {
        try {
          cache.check();
        } catch (const c10::Error& e) {
          fail("PagedCache::check() failed on cache ", c, ": ", e.what_without_backtrace());
        }
        for (int64_t p = 0; p < cache.n_pages(); ++p)
          if (cache.ref_count(p) != refs[static_cast<size_t>(p)])
            fail("cache ", c, ": ref_count(", p, ") = ", cache.ref_count(p), ", but ", refs[static_cast<size_t>(p)],
                 " sequences hold it");
        const int64_t n_free = static_cast<int64_t>(std::count(refs.begin(), refs.end(), 0));
        if (cache.n_free() != n_free) fail("cache ", c, ": n_free() = ", cache.n_free(), ", model ", n_free);
      });
    }
  }

  /// batch(ids)'s page table and lengths against the model.
  void check_batch(const std::string& what, int t, const std::vector<int64_t>& ids, const at::Tensor& table,
                   const at::Tensor& lengths) const {
    int64_t cols = 0;
    for (int64_t id : ids) cols = std::max<int64_t>(cols, static_cast<int64_t>(model_[t].at(id).pages.size()));
    const auto rows = static_cast<int64_t>(ids.size());
    if (!table.defined() || table.dim() != 2 || table.size(0) != rows || table.size(1) != cols ||
        table.scalar_type() != at::kInt || !table.device().is_cpu() || !lengths.defined() || lengths.dim() != 1 ||
        lengths.size(0) != rows || lengths.scalar_type() != at::kLong || !lengths.device().is_cpu())
      fail(what, " returned ", detail::describe(table), " and ", detail::describe(lengths), ", expected int32 [", rows,
           ", ", cols, "] and int64 [", rows, "] on the cpu");
    const at::Tensor tab = table.contiguous();
    const at::Tensor len = lengths.contiguous();
    for (int64_t b = 0; b < rows; ++b) {
      const SeqModel& s = model_[t].at(ids[static_cast<size_t>(b)]);
      if (len.data_ptr<int64_t>()[b] != s.length)
        fail(what, ": row ", b, " length ", len.data_ptr<int64_t>()[b], ", model ", s.length);
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t want = j < static_cast<int64_t>(s.pages.size()) ? s.pages[static_cast<size_t>(j)]
                                                                       : pagedkv::kUnmappedPage;
        if (tab.data_ptr<int32_t>()[b * cols + j] != want)
          fail(what, ": row ", b, " column ", j, " = ", tab.data_ptr<int32_t>()[b * cols + j], ", model ", want);
      }
    }
  }

  uint64_t value_index(int64_t token, int64_t layer, int kv, int64_t elem) const {
    return ((static_cast<uint64_t>(token) * static_cast<uint64_t>(cfg_.n_layers) + static_cast<uint64_t>(layer)) * 2 +
            static_cast<uint64_t>(kv)) *
               static_cast<uint64_t>(hd_) +
           static_cast<uint64_t>(elem);
  }
  uint32_t raw(const unsigned char* base, int64_t flat) const {
    if (half_) {
      uint16_t b = 0;
      std::memcpy(&b, base + flat * 2, 2);
      return b;
    }
    uint32_t b = 0;
    std::memcpy(&b, base + flat * 4, 4);
    return b;
  }

  /// A written element's bits (value_bits) as a float32.
  float written_value(uint64_t index) const {
    const uint32_t bits = seq_detail::value_bits(index, half_);
    return half_ ? static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()))
                 : pagedkv::cpu::quant::bits_float(bits);
  }

  /// The bits gather returns for element e of a token's layer and side: the
  /// written bits for a native side; for a quantized one the written head
  /// vector through the library's scalar codec, dequantized, in the dtype.
  uint32_t gathered_bits(int64_t token, int64_t layer, int which, int64_t e) const {
    const pagedkv::KVFormat format = which == 0 ? cfg_.quant.k : cfg_.quant.v;
    if (!pagedkv::is_quantized(format)) return seq_detail::value_bits(value_index(token, layer, which, e), half_);
    const int64_t D = cfg_.head_dim;
    const int64_t first = e / D * D;
    std::vector<float> head(static_cast<size_t>(D));
    for (int64_t d = 0; d < D; ++d)
      head[static_cast<size_t>(d)] = written_value(value_index(token, layer, which, first + d));
    std::vector<int64_t> codes(static_cast<size_t>(D));
    const float scale = detail::quantize_head(format, head.data(), D, codes.data());
    const float value = detail::dequantize(format, codes[static_cast<size_t>(e - first)], scale);
    return half_ ? c10::Half(value).x : pagedkv::cpu::quant::float_bits(value);
  }

  /// Gathers every live resident sequence of each table (holders included)
  /// and compares every written token with the model, bit for bit.
  void check_data() {
    ++stats_.data_checks;
    for (int t = 0; t <= seq_detail::kHost; ++t) {
      if (!table_exists(t)) continue;
      std::vector<int64_t> ids;
      for (int64_t id = 0; id < static_cast<int64_t>(model_[t].seqs.size()); ++id)
        if (model_[t].live(id) && !model_[t].at(id).swapped) ids.push_back(id);
      if (ids.empty()) continue;
      at::Tensor table, lengths;
      with_table(t, [&](const auto& tb) { std::tie(table, lengths) = tb.batch(ids); });
      const std::string what = std::string("data check: table ") + seq_detail::name(t) + " batch(" + detail::join(ids) + ")";
      check_batch(what, t, ids, table, lengths);
      // Rows with released columns: gather their held columns only (a gather
      // without a window refuses -1 below a length), positions shifted.
      std::vector<int64_t> skip(ids.size(), 0);
      int64_t max_len = 0;
      for (size_t b = 0; b < ids.size(); ++b) {
        skip[b] = released(model_[t].at(ids[b]).pages);
        max_len = std::max(max_len, model_[t].at(ids[b]).length - skip[b] * P());
      }
      if (std::any_of(skip.begin(), skip.end(), [](int64_t x) { return x > 0; })) {
        const at::Tensor full = table;
        table = at::full({full.size(0), full.size(1)}, pagedkv::kUnmappedPage, at::kInt);
        for (size_t b = 0; b < ids.size(); ++b) {
          const auto row = static_cast<int64_t>(b);
          const int64_t cols = full.size(1) - skip[b];
          table[row].narrow(0, 0, cols).copy_(full[row].narrow(0, skip[b], cols));
          lengths[row] -= skip[b] * P();
        }
      }
      with_cache(cache_of(t), [&](const auto& cache) {
        for (int64_t layer = 0; layer < cfg_.n_layers; ++layer) {
          const auto kv = cache.gather(layer, table, lengths);
          for (int which = 0; which < 2; ++which) {
            const at::Tensor& out = which == 0 ? kv.first : kv.second;
            if (out.dim() != 4 || out.size(0) != static_cast<int64_t>(ids.size()) || out.size(1) != max_len ||
                out.size(2) != cfg_.n_heads || out.size(3) != cfg_.head_dim || out.scalar_type() != cfg_.dtype ||
                !out.is_contiguous())
              fail(what, ": gather returned ", detail::describe(out));
            const auto* base = static_cast<const unsigned char*>(out.data_ptr());
            for (size_t b = 0; b < ids.size(); ++b) {
              const std::vector<int64_t>& tokens = tokens_of(t, ids[b]);
              const int64_t shift = skip[b] * P();
              for (int64_t pos = shift; pos < model_[t].at(ids[b]).length; ++pos) {
                const int64_t token = tokens[static_cast<size_t>(pos)];
                if (token == seq_detail::kUnknownToken) continue;
                for (int64_t e = 0; e < hd_; ++e) {
                  const uint32_t got = raw(base, (static_cast<int64_t>(b) * max_len + pos - shift) * hd_ + e);
                  const uint32_t want = gathered_bits(token, layer, which, e);
                  if (got != want)
                    fail(what, ": sequence ", ids[b], " layer ", layer, (which == 0 ? " k" : " v"), " position ", pos,
                         " element ", e, " has bits ", got, ", model ", want, " (token ", token, ")");
                }
              }
            }
          }
        }
      });
    }
  }

  void finish() {
    if (cfg_.destroy_at_end) {
      // The destructors free the pages each table holds in its own cache.
      dev_.reset();
      check_all_free(0, "after ~SequenceTable of table dev");
      if (has_host()) {
        host_.reset();
        check_all_free(1, "after ~SequenceTable of table host");
      }
      return;
    }
    for (int t = 0; t <= seq_detail::kHost; ++t) {
      if (!table_exists(t)) continue;
      for (int64_t id = 0; id < static_cast<int64_t>(model_[t].seqs.size()); ++id) {
        if (!model_[t].live(id) || model_[t].at(id).holder) continue;
        attempt(std::string("final release(") + std::to_string(id) + ") on table " + seq_detail::name(t), Want::ok, [&] {
          with_table(t, [&](auto& table) { table.release(id); });
          return true;
        });
        model_release(t, id);
        check_structure();
      }
    }
    for (int t = 0; t <= seq_detail::kHost; ++t)
      if (table_exists(t))
        with_table(t, [&](const auto& table) {
          if (table.size() != 0) fail("table ", seq_detail::name(t), " has ", table.size(), " sequences after releasing all");
        });
    for (int c = 0; c < 3; ++c) check_all_free(c, "after releasing every sequence");
  }

  void check_all_free(int c, const char* when) {
    if (!cache_exists(c)) return;
    with_cache(c, [&](const auto& cache) {
      if (cache.n_free() != cache.n_pages())
        fail("cache ", c, " leaked pages ", when, ": n_free ", cache.n_free(), " of ", cache.n_pages());
      try {
        cache.check();
      } catch (const c10::Error& e) {
        fail("PagedCache::check() failed on cache ", c, " ", when, ": ", e.what_without_backtrace());
      }
    });
  }

  // ---------------------------------------------------------------- inputs

  int pick_table() { return has_host() && in_.u8() % 4 == 3 ? seq_detail::kHost : seq_detail::kDev; }

  /// Mostly a live id (owned, swapped or a holder), sometimes a released or
  /// never used one, sometimes garbage.
  int64_t pick_seq(int t) {
    const TableModel& m = model_[t];
    std::vector<int64_t> live, dead;
    for (int64_t id = 0; id < static_cast<int64_t>(m.seqs.size()); ++id) (m.live(id) ? live : dead).push_back(id);
    const uint8_t sel = in_.u8() % 16;
    if (sel < 12 && !live.empty()) return live[in_.u8() % live.size()];
    const auto n = static_cast<int64_t>(m.seqs.size());
    if (sel < 14) return dead.empty() ? n : dead[in_.u8() % dead.size()];
    const int64_t choices[] = {-1, -2, n, n + 3, seq_detail::kI64Max, seq_detail::kI64Min, seq_detail::kI32Max,
                               int64_t{1} << 40};
    return choices[in_.u8() % 8];
  }

  /// A token count: mostly in [0, limit], sometimes negative, larger than
  /// any pool, or extreme.
  int64_t count(int64_t limit) {
    const uint8_t sel = in_.u8() % 16;
    if (sel < 11) return in_.range(0, limit);
    if (sel < 13) return -in_.range(1, 3);
    if (sel == 13) return in_.range(limit + 1, limit + 100);
    const int64_t far[] = {seq_detail::kI32Max, int64_t{1} << 40, int64_t{1} << 62, seq_detail::kI64Max / 2,
                           seq_detail::kI64Min, seq_detail::kI64Max - 64};
    // length + n and n + page_size - 1 overflow int64 for these.
    const int64_t near_max[] = {seq_detail::kI64Max, seq_detail::kI64Max - 1, seq_detail::kI64Max - 3};
    const uint8_t which = in_.u8();
    return sel == 15 ? near_max[which % 3] : far[which % 6];
  }

  /// The host for a swap: mostly the other table with sequences, sometimes
  /// a wrong one (this table, one over the same cache, the alt geometry).
  int pick_host(int t) {
    const int other = t == seq_detail::kDev ? seq_detail::kHost : seq_detail::kDev;
    const int same = t == seq_detail::kDev ? seq_detail::kDevSame : seq_detail::kHostSame;
    const uint8_t sel = in_.u8() % 8;
    if (sel < 5 && has_host()) return other;
    const int wrong[] = {t, same, seq_detail::kAlt, has_host() ? other : seq_detail::kAlt};
    return wrong[sel % 4];
  }

  std::vector<int64_t> fresh_tokens(int64_t n) {
    std::vector<int64_t> ids(static_cast<size_t>(n));
    for (auto& id : ids) id = next_token_++;
    return ids;
  }

  /// k (kv = 0) or v [rows, n, H, D] holding tokens[row][s]'s values for
  /// `layer`, contiguous or head-major.
  at::Tensor make_kv(const std::vector<std::vector<int64_t>>& tokens, int64_t n, int64_t layer, int kv,
                     bool head_major) const {
    const auto rows = static_cast<int64_t>(tokens.size());
    at::Tensor t = head_major ? at::empty({rows, cfg_.n_heads, n, cfg_.head_dim}, options(cfg_.dtype)).transpose(1, 2)
                              : at::empty({rows, n, cfg_.n_heads, cfg_.head_dim}, options(cfg_.dtype));
    auto* base = static_cast<unsigned char*>(t.data_ptr());
    const int64_t es = half_ ? 2 : 4;
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t s = 0; s < n; ++s)
        for (int64_t h = 0; h < cfg_.n_heads; ++h)
          for (int64_t d = 0; d < cfg_.head_dim; ++d) {
            const int64_t off = b * t.stride(0) + s * t.stride(1) + h * t.stride(2) + d * t.stride(3);
            const uint32_t bits = seq_detail::value_bits(
                value_index(tokens[static_cast<size_t>(b)][static_cast<size_t>(s)], layer, kv, h * cfg_.head_dim + d),
                half_);
            if (half_) {
              const auto b16 = static_cast<uint16_t>(bits);
              std::memcpy(base + off * es, &b16, 2);
            } else {
              std::memcpy(base + off * es, &bits, 4);
            }
          }
    return t;
  }

  static std::string label(const char* fn, int t, const std::string& args) {
    return std::string(seq_detail::name(t)) + "." + fn + "(" + args + ")";
  }
  static std::string str(int64_t v) { return std::to_string(v); }

  // ---------------------------------------------------------------- model updates

  void model_release(int t, int64_t id) {
    const SeqModel s = model_[t].at(id);
    if (s.swapped) model_[s.host].at(s.host_seq) = SeqModel{};
    model_[t].at(id) = SeqModel{};
  }

  // ---------------------------------------------------------------- operations

  void op_create(int t) {
    const int64_t want = model_[t].lowest_unused();
    int64_t got = -1;
    attempt(label("create", t, ""), Want::ok, [&] {
      with_table(t, [&](auto& table) { got = table.create(); });
      return true;
    });
    if (got != want) fail(label("create", t, ""), " = ", got, ", model ", want);
    model_[t].slot(got).live = true;
  }

  void op_fork(int t) {
    const int64_t id = pick_seq(t);
    const int64_t want = model_[t].lowest_unused();
    int64_t got = -1;
    const std::string what = label("fork", t, str(id));
    if (attempt(what, owned(t, id) ? Want::ok : Want::error, [&] {
          with_table(t, [&](auto& table) { got = table.fork(id); });
          return true;
        }) != Want::ok)
      return;
    if (got != want) fail(what, " = ", got, ", model ", want);
    const SeqModel parent = model_[t].at(id);
    SeqModel& child = model_[t].slot(got);
    child.live = true;
    child.length = parent.length;
    child.pages = parent.pages;
    child.tokens = parent.tokens;
  }

  void op_release(int t) {
    const int64_t id = pick_seq(t);
    const bool ok = model_[t].live(id) && !model_[t].at(id).holder;
    if (attempt(label("release", t, str(id)), ok ? Want::ok : Want::error, [&] {
          with_table(t, [&](auto& table) { table.release(id); });
          return true;
        }) == Want::ok)
      model_release(t, id);
  }

  void op_reserve(int t) {
    const int64_t id = pick_seq(t);
    const int64_t n = count((cfg_.n_pages + 2) * P());
    Want want = Want::error;
    int64_t need = 0;
    if (owned(t, id) && n >= 0) {
      need = pages_for(n) - static_cast<int64_t>(model_[t].at(id).pages.size());
      want = need > model_n_free(cache_of(t)) ? Want::short_pool : Want::ok;
    }
    const std::string what = label("reserve", t, str(id) + ", " + str(n));
    if (attempt(what, want, [&] {
          bool r = false;
          with_table(t, [&](auto& table) { r = table.reserve(id, n); });
          return r;
        }) != Want::ok)
      return;
    std::vector<int64_t> expected = model_[t].at(id).pages;
    expected.resize(expected.size() + static_cast<size_t>(std::max<int64_t>(need, 0)), seq_detail::kFresh);
    learn_pages(what, t, id, expected);
  }

  /// prepare_append(id, n) against the model: reserves, and replaces every
  /// shared page among those the append lands in by a page of its own.
  Want prepare(int t, int64_t id, int64_t n) {
    Want want = Want::error;
    std::vector<int64_t> expected;
    int64_t first = 0, end = 0;
    if (owned(t, id) && n >= 0) {
      const SeqModel& s = model_[t].at(id);
      const auto have_pages = static_cast<int64_t>(s.pages.size());
      expected = s.pages;
      want = Want::ok;
      if (n > seq_detail::kI64Max - s.length) {
        want = Want::short_pool;  // no pool holds length + n tokens
      } else if (n > 0) {
        first = s.length / P();
        end = pages_for(s.length + n);
        const std::vector<int64_t> refs = model_refs(cache_of(t));
        int64_t need = std::max<int64_t>(0, end - have_pages);
        for (int64_t j = first; j < std::min(end, have_pages); ++j)
          if (refs[static_cast<size_t>(s.pages[static_cast<size_t>(j)])] > 1) {
            expected[static_cast<size_t>(j)] = seq_detail::kFresh;
            ++need;
          }
        if (need > model_n_free(cache_of(t))) want = Want::short_pool;
        else expected.resize(static_cast<size_t>(std::max(end, have_pages)), seq_detail::kFresh);
      }
    }
    const std::string what = label("prepare_append", t, str(id) + ", " + str(n));
    const Want got = attempt(what, want, [&] {
      bool r = false;
      with_table(t, [&](auto& table) { r = table.prepare_append(id, n); });
      return r;
    });
    if (got != Want::ok) return got;
    learn_pages(what, t, id, expected);
    const std::vector<int64_t>& pages = model_[t].at(id).pages;
    with_cache(cache_of(t), [&](const auto& cache) {
      for (int64_t j = first; j < end; ++j)
        if (cache.ref_count(pages[static_cast<size_t>(j)]) != 1)
          fail(what, ": page ", pages[static_cast<size_t>(j)], " (column ", j, ") the append lands in has ref_count ",
               cache.ref_count(pages[static_cast<size_t>(j)]), " (copy-on-write left it shared)");
    });
    return got;
  }

  /// commit_append(id, n); positions past `written` are committed unknown.
  Want commit(int t, int64_t id, int64_t n, const std::vector<int64_t>& written) {
    bool ok = owned(t, id) && n >= 0;
    if (ok) {
      const SeqModel& s = model_[t].at(id);
      ok = n <= static_cast<int64_t>(s.pages.size()) * P() - s.length;
    }
    const Want got = attempt(label("commit_append", t, str(id) + ", " + str(n)), ok ? Want::ok : Want::error, [&] {
      with_table(t, [&](auto& table) { table.commit_append(id, n); });
      return true;
    });
    if (got != Want::ok) return got;
    SeqModel& s = model_[t].at(id);
    for (int64_t i = 0; i < n; ++i)
      s.tokens.push_back(i < static_cast<int64_t>(written.size()) ? written[static_cast<size_t>(i)]
                                                                   : seq_detail::kUnknownToken);
    s.length += n;
    const int64_t drop = dropped_for(t, s.length);  // out of the next query's window: back to the pool
    std::fill(s.pages.begin(), s.pages.begin() + static_cast<std::ptrdiff_t>(drop), pagedkv::kUnmappedPage);
    return got;
  }

  /// truncate(id, n): keeps pages_for(n) columns; refused below the held window.
  void op_truncate(int t) {
    const int64_t id = pick_seq(t);
    const uint8_t sel = in_.u8() % 8;
    int64_t n = count(opt_.max_tokens);
    if (sel < 5 && model_[t].live(id)) {
      const int64_t length = model_[t].at(id).length;
      n = sel < 3 ? length - in_.range(0, std::min<int64_t>(length, 8)) : in_.range(0, std::max<int64_t>(length, 0));
    }
    Want want = Want::error;
    if (owned(t, id) && n >= 0 && n <= model_[t].at(id).length) {
      const int64_t first_held = released(model_[t].at(id).pages) * P();
      want = first_held > 0 && n - first_held < cfg_.windows[t] - 1 ? Want::error : Want::ok;
    }
    const std::string what = label("truncate", t, str(id) + ", " + str(n));
    if (attempt(what, want, [&] {
          with_table(t, [&](auto& table) { table.truncate(id, n); });
          return true;
        }) != Want::ok)
      return;
    SeqModel& s = model_[t].at(id);
    std::vector<int64_t> expected(s.pages.begin(), s.pages.begin() + static_cast<std::ptrdiff_t>(pages_for(n)));
    learn_pages(what, t, id, expected);
    s.length = n;
    s.tokens.resize(static_cast<size_t>(n));
  }

  /// Writes tokens[row] at the end of each sequence `ids[row]` (prepared),
  /// every layer, through batch()'s page table.
  void write_rows(int t, const std::vector<int64_t>& ids, const std::vector<std::vector<int64_t>>& tokens, int64_t n,
                  bool tensor_start, bool head_major) {
    at::Tensor table, lengths;
    const std::string what = label("batch", t, detail::join(ids));
    attempt(what, Want::ok, [&] {
      with_table(t, [&](const auto& tb) { std::tie(table, lengths) = tb.batch(ids); });
      return true;
    });
    check_batch(what, t, ids, table, lengths);
    const int64_t start = ids.size() == 1 ? model_[t].at(ids[0]).length : 0;
    for (int64_t layer = 0; layer < cfg_.n_layers; ++layer) {
      const at::Tensor k = make_kv(tokens, n, layer, 0, head_major);
      const at::Tensor v = make_kv(tokens, n, layer, 1, head_major);
      std::ostringstream w;
      w << "cache " << cache_of(t) << ".write(layer " << layer << ", " << detail::describe(table) << ", start "
        << (tensor_start ? detail::describe(lengths) : std::to_string(start)) << ", k/v " << detail::describe(k) << ")";
      attempt(w.str(), Want::ok, [&] {
        with_cache(cache_of(t), [&](auto& cache) {
          if (tensor_start) cache.write(layer, table, lengths, k, v);
          else cache.write(layer, table, start, k, v);
        });
        return true;
      });
    }
    stats_.tokens_written += n * static_cast<int64_t>(ids.size());
  }

  void op_prepare(int t) {
    const int64_t id = pick_seq(t);
    prepare(t, id, count(opt_.max_tokens));
  }

  void op_commit(int t) {
    const int64_t id = pick_seq(t);
    commit(t, id, count(opt_.max_tokens), {});
  }

  /// prepare_append -> write every layer -> commit_append; sometimes fewer
  /// tokens written than prepared, fewer committed than written, or more
  /// committed than written (unknown values) or than the capacity.
  void op_append(int t) {
    const int64_t id = pick_seq(t);
    const int64_t n = count(opt_.max_tokens);
    if (prepare(t, id, n) != Want::ok || n <= 0 || n > opt_.max_tokens) return;
    const uint8_t sel = in_.u8();
    const int64_t w = sel % 4 == 0 ? in_.range(0, n) : n;
    const std::vector<int64_t> tokens = fresh_tokens(w);
    if (w > 0) write_rows(t, {id}, {tokens}, w, (sel & 4u) != 0, (sel & 8u) != 0);
    int64_t c = w;
    switch ((sel >> 4) % 8) {
      case 0: c = in_.range(0, w); break;
      case 1: c = w + in_.range(1, 3); break;  // unknown values, or past the capacity
      default: break;
    }
    commit(t, id, c, tokens);
  }

  /// Several sequences append n tokens each in one write per layer, with
  /// per-sequence start positions (batch()'s lengths).
  void op_batch_append(int t) {
    std::vector<int64_t> candidates;
    for (int64_t id = 0; id < static_cast<int64_t>(model_[t].seqs.size()); ++id)
      if (owned(t, id)) candidates.push_back(id);
    if (candidates.empty()) return;
    const int64_t rows = in_.range(1, opt_.max_batch);
    std::vector<int64_t> ids;
    for (int64_t r = 0; r < rows && !candidates.empty(); ++r) {
      const size_t i = in_.u8() % candidates.size();
      ids.push_back(candidates[i]);
      candidates.erase(candidates.begin() + static_cast<std::ptrdiff_t>(i));
    }
    const int64_t n = in_.range(0, opt_.max_tokens);
    const bool head_major = in_.flag();
    std::vector<int64_t> kept;
    for (int64_t id : ids)
      if (prepare(t, id, n) == Want::ok) kept.push_back(id);
    if (n == 0 || kept.empty()) return;
    std::vector<std::vector<int64_t>> tokens;
    for (size_t r = 0; r < kept.size(); ++r) tokens.push_back(fresh_tokens(n));
    write_rows(t, kept, tokens, n, true, head_major);
    for (size_t r = 0; r < kept.size(); ++r) commit(t, kept[r], n, tokens[r]);
  }

  void op_swap_out(int t) {
    const int64_t id = pick_seq(t);
    const int h = pick_host(t);
    const bool good_host = (t == seq_detail::kDev && h == seq_detail::kHost) || (t == seq_detail::kHost && h == seq_detail::kDev);
    Want want = Want::error;
    int64_t n = 0, skip = 0;
    if (owned(t, id) && good_host) {
      skip = released(model_[t].at(id).pages);
      n = pages_for(model_[t].at(id).length) - skip;
      want = n > model_n_free(cache_of(h)) ? Want::short_pool : Want::ok;
    }
    const int64_t holder = good_host ? model_[h].lowest_unused() : -1;
    const std::string what = label("swap_out", t, str(id) + ", " + seq_detail::name(h));
    if (attempt(what, want, [&] {
          bool r = false;
          with_table(t, [&](auto& a) { with_table(h, [&](auto& b) { r = a.swap_out(id, b); }); });
          return r;
        }) != Want::ok)
      return;
    SeqModel& hs = model_[h].slot(holder);
    hs.live = true;
    hs.holder = true;
    hs.owner = t;
    hs.owner_seq = id;
    hs.length = model_[t].at(id).length;
    std::vector<int64_t> expected(static_cast<size_t>(skip), pagedkv::kUnmappedPage);
    expected.resize(static_cast<size_t>(skip + n), seq_detail::kFresh);
    learn_pages(what, h, holder, expected);
    SeqModel& s = model_[t].at(id);
    s.swapped = true;
    s.host = h;
    s.host_seq = holder;
    s.pages.clear();
  }

  void op_swap_in(int t) {
    std::vector<int64_t> swapped;
    for (int64_t id = 0; id < static_cast<int64_t>(model_[t].seqs.size()); ++id)
      if (model_[t].live(id) && model_[t].at(id).swapped) swapped.push_back(id);
    const uint8_t sel = in_.u8() % 8;
    const int64_t id = sel < 6 && !swapped.empty() ? swapped[in_.u8() % swapped.size()] : pick_seq(t);
    int h = seq_detail::kAlt;
    if (model_[t].live(id) && model_[t].at(id).swapped && in_.u8() % 8 < 6) {
      h = model_[t].at(id).host;
    } else {
      std::vector<int> hosts;
      for (int x = 0; x < seq_detail::kTables; ++x)
        if (table_exists(x)) hosts.push_back(x);
      h = hosts[in_.u8() % hosts.size()];
    }
    Want want = Want::error;
    int64_t n = 0, skip = 0;
    if (model_[t].live(id) && !model_[t].at(id).holder && model_[t].at(id).swapped && model_[t].at(id).host == h) {
      const std::vector<int64_t>& host_pages = model_[h].at(model_[t].at(id).host_seq).pages;
      skip = released(host_pages);
      n = static_cast<int64_t>(host_pages.size()) - skip;
      want = n > model_n_free(cache_of(t)) ? Want::short_pool : Want::ok;
    }
    const std::string what = label("swap_in", t, str(id) + ", " + seq_detail::name(h));
    if (attempt(what, want, [&] {
          bool r = false;
          with_table(t, [&](auto& a) { with_table(h, [&](auto& b) { r = a.swap_in(id, b); }); });
          return r;
        }) != Want::ok)
      return;
    SeqModel& s = model_[t].at(id);
    model_[h].at(s.host_seq) = SeqModel{};
    s.swapped = false;
    s.host = -1;
    s.host_seq = -1;
    std::vector<int64_t> expected(static_cast<size_t>(skip), pagedkv::kUnmappedPage);
    expected.resize(static_cast<size_t>(skip + n), seq_detail::kFresh);
    learn_pages(what, t, id, expected);
  }

  void op_batch(int t) {
    const int64_t rows = in_.range(0, opt_.max_batch);
    std::vector<int64_t> ids;
    bool ok = true;
    for (int64_t r = 0; r < rows; ++r) {
      ids.push_back(pick_seq(t));
      ok = ok && model_[t].live(ids.back()) && !model_[t].at(ids.back()).swapped;
    }
    at::Tensor table, lengths;
    const std::string what = label("batch", t, detail::join(ids));
    if (attempt(what, ok ? Want::ok : Want::error, [&] {
          with_table(t, [&](const auto& tb) { std::tie(table, lengths) = tb.batch(ids); });
          return true;
        }) == Want::ok)
      check_batch(what, t, ids, table, lengths);
  }

  /// The inspection calls, on any id: they answer for live ids (holders and
  /// swapped sequences included) and throw for others.
  void op_query(int t) {
    const int64_t id = pick_seq(t);
    const bool live = model_[t].live(id);
    const uint8_t which = in_.u8() % 5;
    static const char* const fns[] = {"length", "capacity", "swapped", "pages", "contains"};
    int64_t got = 0, want_value = 0;
    std::vector<int64_t> pages;
    const std::string what = label(fns[which], t, str(id));
    if (attempt(what, live || which == 4 ? Want::ok : Want::error, [&] {
          with_table(t, [&](const auto& table) {
            switch (which) {
              case 0: got = table.length(id); break;
              case 1: got = table.capacity(id); break;
              case 2: got = table.swapped(id) ? 1 : 0; break;
              case 3: pages = table.pages(id); break;
              default: got = table.contains(id) ? 1 : 0; break;
            }
          });
          return true;
        }) != Want::ok)
      return;
    if (which == 3) {
      if (pages != model_[t].at(id).pages) fail(what, " = ", detail::join(pages), ", model ", detail::join(model_[t].at(id).pages));
      return;
    }
    switch (which) {
      case 0: want_value = model_[t].at(id).length; break;
      case 1: want_value = static_cast<int64_t>(model_[t].at(id).pages.size()) * P(); break;
      case 2: want_value = model_[t].at(id).swapped ? 1 : 0; break;
      default: want_value = live ? 1 : 0; break;
    }
    if (got != want_value) fail(what, " = ", got, ", model ", want_value);
  }

  void step() {
    const int t = pick_table();
    switch (in_.u8() % 20) {
      case 0: case 1: op_create(t); break;
      case 2: case 3: op_fork(t); break;
      case 4: case 5: op_release(t); break;
      case 6: op_reserve(t); break;
      case 7: op_prepare(t); break;
      case 8: case 9: case 10: case 11: op_append(t); break;
      case 12: case 13: op_batch_append(t); break;
      case 14: op_commit(t); break;
      case 15: op_swap_out(t); break;
      case 16: op_swap_in(t); break;
      case 17: op_batch(t); break;
      case 18: op_query(t); break;
      default:  // an extra byte, so that older inputs keep their other operations
        if (in_.u8() % 2 == 0) op_truncate(t);
        else check_data();
        break;
    }
  }

  Bytes& in_;
  const SequenceOptions& opt_;
  const Config cfg_;
  const int64_t hd_;
  const bool half_;
  pagedkv::PagedCache<DL> dev_cache_;
  std::optional<pagedkv::PagedCache<HL>> host_cache_;
  pagedkv::PagedCache<DL> alt_cache_;
  // After the caches: destroyed before them.
  std::optional<pagedkv::SequenceTable<DL>> dev_;
  std::optional<pagedkv::SequenceTable<HL>> host_;
  std::optional<pagedkv::SequenceTable<DL>> dev_same_;
  std::optional<pagedkv::SequenceTable<HL>> host_same_;
  std::optional<pagedkv::SequenceTable<DL>> alt_;
  TableModel model_[2];
  State before_;
  SequenceStats stats_;
  int64_t next_token_ = 0;
};

/// Decodes a configuration from the first bytes and runs the rest as a script.
inline SequenceStats run_sequence_script(const uint8_t* data, size_t size,
                                         const SequenceOptions& opt = SequenceOptions()) {
  Bytes in(data, size);
  const uint8_t head = in.u8();
  seq_detail::Config cfg;
  cfg.dev_hnd = (head & 1u) != 0;
  cfg.host_hnd = (head & 2u) != 0;
  cfg.dtype = (head & 4u) != 0 ? at::kHalf : at::kFloat;
  cfg.alt_kind = (head >> 3) % 4;
  cfg.destroy_at_end = (head >> 5) % 4 == 3;
  const pagedkv::ScopedBackend backend((head & 0x80u) != 0 && (head & 0x40u) == 0 ? pagedkv::Backend::generic
                                                                                   : pagedkv::Backend::automatic);
  cfg.quant = quant_of(in.peek(), cfg.dtype);  // script.hpp: from the n_layers byte's unused bits
  cfg.n_layers = in.range(1, opt.max_layers);
  // The windows come from bits n_pages and n_heads leave unused, so that
  // adding them changed no other choice an input makes.
  const uint8_t windowed = static_cast<uint8_t>(in.peek() >> 4);
  cfg.n_pages = in.range(1, opt.max_pages);
  cfg.host_pages = in.range(0, opt.max_host_pages);
  cfg.page_size = in.range(1, opt.max_page_size);
  const int64_t window = 1 + (in.peek() >> 1) % 12;
  cfg.n_heads = in.range(1, opt.max_heads);
  if (windowed >= 12) cfg.windows[seq_detail::kDev] = window;
  if (windowed >= 12 && windowed % 2 == 1) cfg.windows[seq_detail::kHost] = window;
  cfg.head_dim = in.range(1, opt.max_head_dim);
  using pagedkv::HND;
  using pagedkv::NHD;
  if (cfg.dev_hnd && cfg.host_hnd) return SequenceRunner<HND, HND>(in, opt, cfg).run();
  if (cfg.dev_hnd) return SequenceRunner<HND, NHD>(in, opt, cfg).run();
  if (cfg.host_hnd) return SequenceRunner<NHD, HND>(in, opt, cfg).run();
  return SequenceRunner<NHD, NHD>(in, opt, cfg).run();
}

}  // namespace pagedkv_fuzz
