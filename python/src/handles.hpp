// The C++ objects behind the Python classes: one class per C++ class,
// holding the NHD or the HND instance (the layout is a constructor
// argument in Python, a template argument in C++). Methods forward to the
// C++ API unchanged, so the classes validate, throw and compute exactly as
// the C++ library does.
//
// Methods are defined by topic in separate files (cache.cpp: pool, write,
// gather, copies; attention.cpp; sequences.cpp) so that the heavy kernel
// templates are instantiated once each and the files compile in parallel;
// module.cpp only binds them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "pagedkv/cache_view.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/paged_cache.hpp"
#include "pagedkv/prefix_cache.hpp"
#include "pagedkv/sequences.hpp"

namespace pagedkv_py {

/// The Layout of a PagedCache<Layout> or SequenceTable<Layout>.
template <class T>
struct LayoutOf;
template <class L>
struct LayoutOf<pagedkv::PagedCache<L>> {
  using type = L;
};
template <class L>
struct LayoutOf<pagedkv::SequenceTable<L>> {
  using type = L;
};
template <class T>
using layout_of_t = typename LayoutOf<std::remove_cv_t<std::remove_reference_t<T>>>::type;

/// "native", "fp8" / "fp8_e4m3" or "int8" as a KVFormat; throws naming `arg` otherwise.
pagedkv::KVFormat parse_format(const char* arg, const std::string& name);

class View;

/// pagedkv.PagedCache: PagedCache<NHD> or PagedCache<HND>.
class Cache {
 public:
  /// Device and dtype are those of `like` (the Python side passes an empty tensor).
  Cache(int64_t n_layers, int64_t n_pages, int64_t page_size, int64_t n_kv_heads, int64_t head_dim,
        const at::Tensor& like, const std::string& layout, const std::string& k_format,
        const std::string& v_format);

  int64_t alloc();
  std::vector<int64_t> alloc_n(int64_t n);
  void free(int64_t page);
  void retain(int64_t page);
  int64_t ref_count(int64_t page) const;
  int64_t n_free() const;

  void write(int64_t layer, const at::Tensor& page_table, int64_t start_pos, const at::Tensor& k,
             const at::Tensor& v);
  void write(int64_t layer, const at::Tensor& page_table, const at::Tensor& start_pos, const at::Tensor& k,
             const at::Tensor& v);
  std::pair<at::Tensor, at::Tensor> gather(int64_t layer, const at::Tensor& page_table) const;
  std::pair<at::Tensor, at::Tensor> gather(int64_t layer, const at::Tensor& page_table,
                                           const at::Tensor& lengths) const;
  View bind(const at::Tensor& page_table, int64_t total_len);
  View bind(const at::Tensor& page_table, const at::Tensor& lengths);
  void copy_pages(const at::Tensor& src, const at::Tensor& dst);
  void copy_pages_from(const Cache& other, const at::Tensor& src, const at::Tensor& dst);
  void check() const;

  const at::Tensor& k_cache() const;
  const at::Tensor& v_cache() const;
  /// Undefined for a native side (None in Python).
  const at::Tensor& k_scales() const;
  const at::Tensor& v_scales() const;
  pagedkv::KVQuant quant() const;
  at::ScalarType dtype() const;
  int64_t n_layers() const;
  int64_t n_pages() const;
  int64_t page_size() const;
  int64_t n_kv_heads() const;
  int64_t head_dim() const;
  /// "NHD" or "HND".
  const char* layout() const;

  /// Calls f(PagedCache<Layout>&).
  template <class F>
  decltype(auto) visit(F&& f) {
    return std::visit([&](auto& c) -> decltype(auto) { return f(*c); }, cache_);
  }
  template <class F>
  decltype(auto) visit(F&& f) const {
    return std::visit(
        [&](const auto& c) -> decltype(auto) {
          const auto& cache = *c;
          return f(cache);
        },
        cache_);
  }

 private:
  /// The C++ cache; by pointer, since views, tables and prefix caches hold its address.
  std::variant<std::unique_ptr<pagedkv::PagedCache<pagedkv::NHD>>, std::unique_ptr<pagedkv::PagedCache<pagedkv::HND>>>
      cache_;
};

/// pagedkv.CacheView: a CacheView<NHD> or CacheView<HND> (Python keeps its cache alive).
class View {
 public:
  explicit View(pagedkv::CacheView<pagedkv::NHD> view) : view_(std::move(view)) {}
  explicit View(pagedkv::CacheView<pagedkv::HND> view) : view_(std::move(view)) {}

  void write(int64_t layer, int64_t start_pos, const at::Tensor& k, const at::Tensor& v) const;
  void write(int64_t layer, const at::Tensor& start_pos, const at::Tensor& k, const at::Tensor& v) const;
  std::pair<at::Tensor, at::Tensor> gather(int64_t layer) const;
  /// pagedkv::paged_attention(view, layer, q, options) (attention.cpp).
  at::Tensor paged_attention(int64_t layer, const at::Tensor& q, const pagedkv::AttentionOptions& options) const;

  const at::Tensor& page_table() const;
  /// Undefined when bound with a total length.
  const at::Tensor& lengths() const;
  int64_t total_len() const;

 private:
  /// The C++ view, of the cache's layout.
  std::variant<pagedkv::CacheView<pagedkv::NHD>, pagedkv::CacheView<pagedkv::HND>> view_;
};

/// pagedkv.SequenceTable over a Cache (Python keeps the cache alive).
class Sequences {
 public:
  Sequences(Cache& cache, int64_t window);

  int64_t create();
  bool reserve(int64_t seq, int64_t n_tokens);
  int64_t fork(int64_t seq);
  void release(int64_t seq);
  int64_t length(int64_t seq) const;
  bool prepare_append(int64_t seq, int64_t n_tokens);
  void commit_append(int64_t seq, int64_t n_tokens);
  void truncate(int64_t seq, int64_t n_tokens);
  std::pair<at::Tensor, at::Tensor> batch(const std::vector<int64_t>& seqs) const;
  bool swap_out(int64_t seq, Sequences& host);
  bool swap_in(int64_t seq, Sequences& host);
  std::vector<int64_t> pages(int64_t seq) const;
  int64_t capacity(int64_t seq) const;
  bool swapped(int64_t seq) const;
  bool contains(int64_t seq) const;
  int64_t size() const;
  int64_t window() const;
  void check() const;

  /// Calls f(SequenceTable<Layout>&).
  template <class F>
  decltype(auto) visit(F&& f) {
    return std::visit([&](auto& t) -> decltype(auto) { return f(*t); }, table_);
  }

 private:
  /// The C++ table (neither copyable nor movable: held by pointer), of the cache's layout.
  std::variant<std::unique_ptr<pagedkv::SequenceTable<pagedkv::NHD>>,
               std::unique_ptr<pagedkv::SequenceTable<pagedkv::HND>>>
      table_;
};

/// pagedkv.PrefixCache over a Sequences (Python keeps the table alive).
class Prefix {
 public:
  explicit Prefix(Sequences& seqs);

  int64_t peek(const at::Tensor& tokens, uint64_t salt, int64_t max_tokens) const;
  std::pair<int64_t, int64_t> acquire(const at::Tensor& tokens, uint64_t salt, int64_t max_tokens);
  int64_t insert(int64_t seq, const at::Tensor& tokens, uint64_t salt);
  int64_t evict(int64_t n_pages);
  void clear();
  int64_t n_cached() const;
  int64_t n_evictable() const;
  pagedkv::PrefixStats stats() const;
  void reset_stats();
  void check() const;

 private:
  /// The C++ prefix cache (attached to the table by address: held by pointer), of the table's layout.
  std::variant<std::unique_ptr<pagedkv::PrefixCache<pagedkv::NHD>>,
               std::unique_ptr<pagedkv::PrefixCache<pagedkv::HND>>>
      prefix_;
};

}  // namespace pagedkv_py
