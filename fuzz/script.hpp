// The operation-script engine behind the fuzzer, the corpus replay test and
// the soak test. It decodes bytes into a cache configuration (native pages,
// or K and/or V quantized to fp8 e4m3 / int8) and a script of calls (alloc,
// alloc_n, free, retain, ref_count, write with an int or a tensor
// start_pos, gather with and without lengths, bind with total_len or
// lengths (rows may start with -1 columns, as a windowed table leaves them),
// and writes/gathers/in-place table edits through bound views), with
// random and garbage page tables, positions, lengths and K/V tensors, and runs
// it against a PagedCache and a simple reference model. After every call:
//
// - the model says whether the call must succeed; it must, or throw c10::Error
//   (a message naming the pagedkv function), and nothing else;
// - a call that throws left the cache's tensors (K/V codes and scales),
//   every ref_count and n_free bit-identical to before;
// - results (alloc ids, ref counts, gathered K/V) equal the model's; for a
//   quantized side the model applies the library's scalar codec
//   (cpu::quant::quantize_loop) to each written (token, head) vector, so it
//   predicts codes, scales and hence gathered values bit for bit (the
//   vector paths are tested bit-identical to the scalar one);
// - every check_every calls: PagedCache::check() and the whole K/V storage
//   against the model.
//
// Any disagreement throws pagedkv_fuzz::Failure (a bug in pagedkv or here).
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
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "pagedkv/pagedkv.hpp"
#include "pagedkv/cpu/quant/codecs.hpp"

namespace pagedkv_fuzz {

/// The cache disagreed with the model or broke a rule: a bug.
class Failure : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw Failure(os.str());
}

/// Reads the input; past its end every read returns 0.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  uint8_t u8() { return pos_ < size_ ? data_[pos_++] : uint8_t{0}; }
  /// The byte u8() would read next, not consumed.
  uint8_t peek() const { return pos_ < size_ ? data_[pos_] : uint8_t{0}; }
  /// A value in [lo, hi]; hi - lo < 65536.
  int64_t range(int64_t lo, int64_t hi) {
    const auto span = static_cast<uint32_t>(hi - lo + 1);
    uint32_t raw = u8();
    if (span > 256) raw |= static_cast<uint32_t>(u8()) << 8;
    return lo + static_cast<int64_t>(raw % span);
  }
  bool flag() { return (u8() & 1u) != 0; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

struct Options {
  int64_t max_layers = 2;
  int64_t max_pages = 12;
  int64_t max_page_size = 5;
  int64_t max_heads = 2;
  int64_t max_head_dim = 3;
  int64_t max_batch = 3;
  int64_t max_cols = 5;
  int64_t max_tokens = 9;
  /// PagedCache::check() and a full storage comparison every n calls.
  int64_t check_every = 1;
  int64_t max_ops = std::numeric_limits<int64_t>::max();
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  /// Prints every call to stderr.
  bool trace = false;
};

struct Stats {
  int64_t calls = 0;
  int64_t succeeded = 0;
  int64_t threw = 0;
  int64_t checks = 0;
};

namespace detail {

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int64_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kI32Min = std::numeric_limits<int32_t>::min();

inline bool index_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong;
}

/// A page table as the model reads it (now: views see in-place edits).
struct Table {
  bool ok = false;  // 2-D, int32/int64, on the CPU
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<int64_t> entries;  // row-major
  int64_t at(int64_t r, int64_t c) const { return entries[static_cast<size_t>(r * cols + c)]; }
};

inline Table read_table(const at::Tensor& t) {
  Table table;
  table.ok = t.defined() && t.dim() == 2 && index_dtype(t) && t.device().is_cpu();
  if (!table.ok) return table;
  table.rows = t.size(0);
  table.cols = t.size(1);
  const at::Tensor host = t.to(at::kLong).contiguous();
  const int64_t* data = host.data_ptr<int64_t>();
  table.entries.assign(data, data + host.numel());
  return table;
}

/// A per-sequence tensor [rows] of values >= 0, or nullopt when the cache must reject it.
inline std::optional<std::vector<int64_t>> read_per_sequence(const at::Tensor& t, int64_t rows) {
  if (!t.defined() || t.dim() != 1 || t.size(0) != rows || !index_dtype(t) || !t.device().is_cpu()) return {};
  const at::Tensor host = t.to(at::kLong).contiguous();
  std::vector<int64_t> values(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + rows);
  for (int64_t v : values)
    if (v < 0) return {};
  return values;
}

template <class T>
std::string join(const std::vector<T>& values) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < values.size(); ++i) os << (i ? "," : "") << values[i];
  return os.str() + ']';
}

inline std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  os << t.scalar_type() << t.sizes() << "/strides" << t.strides();
  if (index_dtype(t) && t.numel() <= 64) {
    const at::Tensor host = t.to(at::kLong).contiguous();
    os << join(std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel()));
  }
  return os.str();
}

/// The codes (as int64: 0..255 for fp8, -127..127 for int8) and the scale
/// of one head vector x, as the library's scalar codec computes them.
inline float quantize_head(pagedkv::KVFormat f, const float* x,  // [n]
                           int64_t n, int64_t* codes) {          // [n]
  if (f == pagedkv::KVFormat::fp8_e4m3) {
    std::vector<uint8_t> c(static_cast<size_t>(n));
    const float scale = pagedkv::cpu::quant::quantize_loop<pagedkv::KVFormat::fp8_e4m3>(x, n, c.data());
    std::copy(c.begin(), c.end(), codes);
    return scale;
  }
  std::vector<int8_t> c(static_cast<size_t>(n));
  const float scale = pagedkv::cpu::quant::quantize_loop<pagedkv::KVFormat::int8>(x, n, c.data());
  std::copy(c.begin(), c.end(), codes);
  return scale;
}

/// decode(code) * scale, in float32 as the library dequantizes.
inline float dequantize(pagedkv::KVFormat f, int64_t code, float scale) {
  return f == pagedkv::KVFormat::fp8_e4m3 ? pagedkv::cpu::quant::decode_e4m3(static_cast<uint8_t>(code)) * scale
                                          : pagedkv::cpu::quant::decode_int8(static_cast<int8_t>(code)) * scale;
}

/// The reference model: ref counts and the stored K/V [L, N, P, H, D] (the
/// values of a native side, the codes of a quantized one, whose scales are
/// in k_scales / v_scales [L, N, P, H]) with, per (layer, page, offset),
/// whether the slot is determinate (two rows writing the same slot in one
/// call leave it either's).
struct Model {
  int64_t n_layers, n_pages, page_size, n_heads, head_dim;
  pagedkv::KVQuant quant;
  std::vector<int32_t> refs;
  std::vector<int64_t> k, v;
  std::vector<float> k_scales, v_scales;
  std::vector<uint8_t> known;

  Model(int64_t l, int64_t n, int64_t p, int64_t h, int64_t d, pagedkv::KVQuant q)
      : n_layers(l), n_pages(n), page_size(p), n_heads(h), head_dim(d), quant(q), refs(static_cast<size_t>(n), 0),
        k(static_cast<size_t>(l * n * p * h * d), 0), v(k.size(), 0),
        k_scales(static_cast<size_t>(l * n * p * h), 0.0f), v_scales(k_scales.size(), 0.0f),
        known(static_cast<size_t>(l * n * p), 1) {}

  bool allocated(int64_t page) const { return page >= 0 && page < n_pages && refs[static_cast<size_t>(page)] > 0; }
  bool in_range(int64_t page) const { return page >= 0 && page < n_pages; }
  int64_t n_free() const { return static_cast<int64_t>(std::count(refs.begin(), refs.end(), 0)); }
  int64_t lowest_free() const {
    for (int64_t p = 0; p < n_pages; ++p)
      if (refs[static_cast<size_t>(p)] == 0) return p;
    return -1;
  }
  size_t slot(int64_t layer, int64_t page, int64_t off) const {
    return static_cast<size_t>((layer * n_pages + page) * page_size + off);
  }
  /// Index of a (token slot, head) scale.
  size_t head(int64_t layer, int64_t page, int64_t off, int64_t h) const {
    return slot(layer, page, off) * static_cast<size_t>(n_heads) + static_cast<size_t>(h);
  }
  size_t elem(int64_t layer, int64_t page, int64_t off, int64_t h, int64_t d) const {
    return ((slot(layer, page, off) * static_cast<size_t>(n_heads)) + static_cast<size_t>(h)) *
               static_cast<size_t>(head_dim) +
           static_cast<size_t>(d);
  }

  /// Leading columns that map a page (>= 0) in at least one row.
  static int64_t mapped_columns(const Table& t) {
    for (int64_t c = 0; c < t.cols; ++c) {
      bool any = false;
      for (int64_t r = 0; r < t.rows; ++r) any = any || t.at(r, c) >= 0;
      if (!any) return c;
    }
    return t.cols;
  }
  /// Every entry of the first n_cols columns is -1 or allocated.
  bool readable(const Table& t, int64_t n_cols) const {
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t c = 0; c < n_cols; ++c)
        if (t.at(r, c) != pagedkv::kUnmappedPage && !allocated(t.at(r, c))) return false;
    return true;
  }
  /// Row r maps allocated pages over [0, length).
  bool mapped_prefix(const Table& t, int64_t r, int64_t length) const {
    if (length > t.cols * page_size) return false;
    for (int64_t c = 0; c * page_size < length; ++c)
      if (!allocated(t.at(r, c))) return false;
    return true;
  }
  /// Row r as bind(page_table, lengths) takes it: leading -1 columns (a
  /// windowed table's released pages), then allocated pages through the
  /// one that holds its last token.
  bool mapped_window(const Table& t, int64_t r, int64_t length) const {
    if (length == 0 || t.cols == 0 || t.at(r, 0) != pagedkv::kUnmappedPage) return mapped_prefix(t, r, length);
    if (length > t.cols * page_size) return false;
    const int64_t last = (length - 1) / page_size;
    int64_t c = 0;
    while (c < last && t.at(r, c) == pagedkv::kUnmappedPage) ++c;
    for (; c <= last; ++c)
      if (!allocated(t.at(r, c))) return false;
    return true;
  }
  bool mapped_windows(const Table& t, const std::vector<int64_t>& lengths) const {
    for (int64_t r = 0; r < t.rows; ++r)
      if (!mapped_window(t, r, lengths[static_cast<size_t>(r)])) return false;
    return true;
  }
  bool mapped_prefixes(const Table& t, const std::vector<int64_t>& lengths) const {
    for (int64_t r = 0; r < t.rows; ++r)
      if (!mapped_prefix(t, r, lengths[static_cast<size_t>(r)])) return false;
    return true;
  }
};

/// k/v values for a write: small integers, exact in every dtype used.
inline at::Tensor values(at::IntArrayRef shape, int64_t seed) {
  const int64_t n = c10::multiply_integers(shape);
  at::Tensor t = at::arange(n, at::kLong);
  return ((t * 37 + seed * 11) % 201 - 100).view(shape);
}

}  // namespace detail

template <class Layout>
class Runner {
 public:
  Runner(Bytes& in, const Options& opt, int64_t n_layers, int64_t n_pages, int64_t page_size, int64_t n_heads,
         int64_t head_dim, at::ScalarType dtype, pagedkv::KVQuant quant)
      : in_(in),
        opt_(opt),
        cache_(n_layers, n_pages, page_size, n_heads, head_dim, at::TensorOptions().dtype(dtype), quant),
        model_(n_layers, n_pages, page_size, n_heads, head_dim, quant),
        dtype_(dtype) {}

  Stats run() {
    full_check();
    while (!in_.empty() && stats_.calls < opt_.max_ops && std::chrono::steady_clock::now() < opt_.deadline) {
      step();
      ++stats_.calls;
      if (stats_.calls % opt_.check_every == 0) full_check();
    }
    full_check();
    return stats_;
  }

 private:
  using Model = detail::Model;
  using Table = detail::Table;

  // ---------------------------------------------------------------- inputs

  int64_t pick_allocated() {
    std::vector<int64_t> pages;
    for (int64_t p = 0; p < model_.n_pages; ++p)
      if (model_.refs[static_cast<size_t>(p)] > 0) pages.push_back(p);
    if (pages.empty()) return pagedkv::kUnmappedPage;
    return pages[in_.u8() % pages.size()];
  }

  int64_t garbage_page(bool wide) {
    const int64_t n = model_.n_pages;
    const int64_t choices[] = {-2, n, n + 1, -1000, detail::kI32Max, detail::kI32Min,
                               wide ? detail::kI64Max : n + 7, wide ? detail::kI64Min : -7};
    return choices[in_.u8() % 8];
  }

  /// A page id for a pool call: mostly allocated, sometimes free or garbage.
  int64_t pool_page() {
    switch (in_.u8() % 8) {
      case 5: return in_.range(0, model_.n_pages - 1);
      case 6: return garbage_page(true);
      case 7: return model_.lowest_free() >= 0 ? model_.lowest_free() : pagedkv::kUnmappedPage;
      default: return pick_allocated();
    }
  }

  at::Tensor page_table() {
    const uint8_t shape_sel = in_.u8();
    if (shape_sel % 32 == 31) {  // malformed: 1-D, 3-D or a float table
      switch (in_.u8() % 3) {
        case 0: return at::zeros({in_.range(0, 3)}, at::kLong);
        case 1: return at::zeros({1, 1, 1}, at::kInt);
        default: return at::zeros({1, in_.range(0, 2)}, at::kFloat);
      }
    }
    const int64_t rows = in_.range(0, opt_.max_batch);
    const int64_t cols = in_.range(0, opt_.max_cols);
    const bool wide = in_.flag();
    const bool transposed = in_.flag();
    std::vector<int64_t> entries(static_cast<size_t>(rows * cols));
    for (auto& e : entries) {
      const uint8_t sel = in_.u8() % 16;
      if (sel < 10) e = pick_allocated();
      else if (sel < 13) e = pagedkv::kUnmappedPage;
      else if (sel < 15) e = in_.range(0, model_.n_pages - 1);
      else e = garbage_page(wide);
    }
    at::Tensor t = at::empty({rows, cols}, at::kLong);
    if (!entries.empty()) std::memcpy(t.data_ptr<int64_t>(), entries.data(), entries.size() * sizeof(int64_t));
    t = t.to(wide ? at::kLong : at::kInt);
    if (transposed) t = t.t().contiguous().t();  // column-major strides
    return t;
  }

  int64_t position(int64_t limit) {
    switch (in_.u8() % 8) {
      case 6: return -in_.range(1, 3);
      case 7: {
        const int64_t choices[] = {detail::kI64Max, detail::kI64Max - 1, detail::kI64Max / 2, int64_t{1} << 40,
                                   detail::kI64Min, detail::kI32Max, limit + 1, limit + 7};
        return choices[in_.u8() % 8];
      }
      default: return in_.range(0, std::max<int64_t>(limit, 0));
    }
  }

  at::Tensor per_sequence(int64_t rows, int64_t limit) {
    const uint8_t sel = in_.u8();
    if (sel % 16 == 15) {  // malformed
      switch (in_.u8() % 3) {
        case 0: return at::zeros({rows + 1}, at::kLong);
        case 1: return at::zeros({rows, 1}, at::kLong);
        default: return at::zeros({rows}, at::kFloat);
      }
    }
    const bool wide = in_.flag();
    std::vector<int64_t> v(static_cast<size_t>(rows));
    for (auto& x : v) {
      x = position(limit);
      if (!wide) x = std::max<int64_t>(detail::kI32Min, std::min<int64_t>(x, detail::kI32Max));
    }
    at::Tensor t = at::empty({rows}, at::kLong);
    if (rows > 0) std::memcpy(t.data_ptr<int64_t>(), v.data(), v.size() * sizeof(int64_t));
    return t.to(wide ? at::kLong : at::kInt);
  }

  /// k or v [B, S, H, D] with small integer values, in one of several
  /// stride patterns, sometimes malformed.
  at::Tensor key_or_value(int64_t batch, int64_t seq, int64_t seed, uint8_t malformed) {
    int64_t b = batch, s = seq, h = model_.n_heads, d = model_.head_dim;
    at::ScalarType dtype = dtype_;
    switch (malformed) {
      case 1: b += 1; break;
      case 2: h += 1; break;
      case 3: d += 1; break;
      case 4: dtype = dtype_ == at::kFloat ? at::kHalf : at::kFloat; break;
      case 5: return detail::values({b, s, h * d}, seed).to(dtype);
      default: break;
    }
    const at::Tensor vals = detail::values({b, s, h, d}, seed).to(dtype);
    switch (in_.u8() % 5) {
      case 1: {  // a slice of a fused QKV projection
        at::Tensor fused = at::zeros({b, s, 3 * h, d}, vals.options());
        at::Tensor k = fused.narrow(2, h, h);
        k.copy_(vals);
        return k;
      }
      case 2: {  // head-major memory
        at::Tensor hm = at::zeros({b, h, s, d}, vals.options());
        at::Tensor k = hm.transpose(1, 2);
        k.copy_(vals);
        return k;
      }
      case 3: {  // every other element of a wider last dim
        at::Tensor wide = at::zeros({b, s, h, 2 * d}, vals.options());
        at::Tensor k = wide.slice(3, 0, 2 * d, 2);
        k.copy_(vals);
        return k;
      }
      case 4:  // one row broadcast over the batch (stride 0)
        if (b > 0) return vals.narrow(0, 0, 1).expand({b, s, h, d});
        return vals;
      default: return vals;
    }
  }

  // ---------------------------------------------------------------- checks

  struct Snapshot {
    at::Tensor k, v;
    at::Tensor k_scales, v_scales;  // undefined for a native side
    std::vector<int64_t> refs;
    int64_t n_free;
  };

  static at::Tensor clone_if_defined(const at::Tensor& t) { return t.defined() ? t.clone() : at::Tensor(); }

  Snapshot snapshot() const {
    Snapshot s{cache_.k_cache().clone(), cache_.v_cache().clone(), clone_if_defined(cache_.k_scales()),
               clone_if_defined(cache_.v_scales()), {}, cache_.n_free()};
    for (int64_t p = 0; p < cache_.n_pages(); ++p) s.refs.push_back(cache_.ref_count(p));
    return s;
  }

  static bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
    if (!a.defined() || !b.defined()) return a.defined() == b.defined();
    return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
           std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<size_t>(a.numel()) * a.element_size()) == 0;
  }

  void expect_unchanged(const Snapshot& before, const std::string& what) const {
    if (!same_bytes(before.k, cache_.k_cache()) || !same_bytes(before.v, cache_.v_cache()))
      fail(what, " threw but changed the K/V storage");
    if (!same_bytes(before.k_scales, cache_.k_scales()) || !same_bytes(before.v_scales, cache_.v_scales()))
      fail(what, " threw but changed the K/V scales");
    const Snapshot after = snapshot();
    if (after.refs != before.refs || after.n_free != before.n_free)
      fail(what, " threw but changed the pool: refs ", detail::join(before.refs), " -> ", detail::join(after.refs));
  }

  /// Runs `call`; it must succeed iff `expect_ok`, throw only c10::Error,
  /// and leave everything unchanged when it throws.
  template <class F>
  bool attempt(const std::string& what, bool expect_ok, F&& call) {
    if (opt_.trace) std::fprintf(stderr, "[%lld] %s expect %s\n", static_cast<long long>(stats_.calls), what.c_str(),
                                 expect_ok ? "ok" : "throw");
    const Snapshot before = snapshot();
    try {
      call();
    } catch (const c10::Error& e) {
      ++stats_.threw;
      const std::string message = e.what_without_backtrace();
      if (expect_ok) fail(what, " threw but the model expected success: ", message);
      if (message.find("pagedkv::") == std::string::npos) fail(what, " threw a message without the function: ", message);
      expect_unchanged(before, what);
      return false;
    } catch (const Failure&) {
      throw;
    } catch (const std::exception& e) {
      fail(what, " threw a non-c10::Error exception: ", e.what());
    }
    ++stats_.succeeded;
    if (!expect_ok) fail(what, " succeeded but the model expected it to throw");
    return true;
  }

  void check_pool() const {
    for (int64_t p = 0; p < model_.n_pages; ++p) {
      if (cache_.ref_count(p) != model_.refs[static_cast<size_t>(p)])
        fail("ref_count(", p, ") = ", cache_.ref_count(p), ", model ", model_.refs[static_cast<size_t>(p)]);
    }
    if (cache_.n_free() != model_.n_free()) fail("n_free() = ", cache_.n_free(), ", model ", model_.n_free());
  }

  /// The cache's K or V storage as int64 [L, N, P, H, D] (token-major).
  at::Tensor logical(const at::Tensor& storage) const {
    at::Tensor t = storage;
    if (std::is_same<Layout, pagedkv::HND>::value) t = t.permute({0, 1, 3, 2, 4});
    return t.to(at::kLong).contiguous();
  }

  /// The cache's K or V scales as float32 [L, N, P, H] (token-major).
  at::Tensor logical_scales(const at::Tensor& scales) const {
    const int64_t L = model_.n_layers, N = model_.n_pages, P = model_.page_size, H = model_.n_heads;
    if (std::is_same<Layout, pagedkv::HND>::value) return scales.view({L, N, H, P}).permute({0, 1, 3, 2}).contiguous();
    return scales.view({L, N, P, H}).contiguous();
  }

  /// A quantized side's scales against the model's, bit for bit, on every determinate slot.
  void check_scales(const char* side, const at::Tensor& scales, const std::vector<float>& want) const {
    const at::Tensor got = logical_scales(scales);
    const float* data = got.data_ptr<float>();
    for (int64_t l = 0; l < model_.n_layers; ++l)
      for (int64_t p = 0; p < model_.n_pages; ++p)
        for (int64_t o = 0; o < model_.page_size; ++o) {
          if (!model_.known[model_.slot(l, p, o)]) continue;
          for (int64_t h = 0; h < model_.n_heads; ++h) {
            const size_t i = model_.head(l, p, o, h);
            if (pagedkv::cpu::quant::float_bits(data[i]) != pagedkv::cpu::quant::float_bits(want[i]))
              fail(side, " scale differs from the model at layer ", l, " page ", p, " offset ", o, " head ", h, ": ",
                   data[i], ", model ", want[i]);
          }
        }
  }

  void full_check() {
    ++stats_.checks;
    try {
      cache_.check();
    } catch (const c10::Error& e) {
      fail("PagedCache::check() failed: ", e.what_without_backtrace());
    }
    check_pool();
    const at::Tensor k = logical(cache_.k_cache());
    const at::Tensor v = logical(cache_.v_cache());
    const int64_t* kd = k.data_ptr<int64_t>();
    const int64_t* vd = v.data_ptr<int64_t>();
    const int64_t hd = model_.n_heads * model_.head_dim;
    for (int64_t l = 0; l < model_.n_layers; ++l)
      for (int64_t p = 0; p < model_.n_pages; ++p)
        for (int64_t o = 0; o < model_.page_size; ++o) {
          if (!model_.known[model_.slot(l, p, o)]) continue;
          const size_t base = model_.elem(l, p, o, 0, 0);
          for (int64_t i = 0; i < hd; ++i) {
            if (kd[base + static_cast<size_t>(i)] != model_.k[base + static_cast<size_t>(i)] ||
                vd[base + static_cast<size_t>(i)] != model_.v[base + static_cast<size_t>(i)])
              fail("storage differs from the model at layer ", l, " page ", p, " offset ", o);
          }
        }
    if (pagedkv::is_quantized(model_.quant.k)) check_scales("k", cache_.k_scales(), model_.k_scales);
    if (pagedkv::is_quantized(model_.quant.v)) check_scales("v", cache_.v_scales(), model_.v_scales);
  }

  /// A float32 value in the cache's dtype (round to nearest even, as gather narrows), as a double.
  double in_dtype(float x) const {
    if (dtype_ == at::kHalf) return static_cast<float>(c10::Half(x));
    if (dtype_ == at::kBFloat16) return static_cast<float>(c10::BFloat16(x));
    return x;
  }

  /// What gather returns for element i (of H x D) of a determinate slot, as a double.
  double gathered(pagedkv::KVFormat format, const std::vector<int64_t>& stored, const std::vector<float>& scales,
                  int64_t layer, int64_t page, int64_t off, int64_t i) const {
    const int64_t value = stored[model_.elem(layer, page, off, 0, 0) + static_cast<size_t>(i)];
    if (!pagedkv::is_quantized(format)) return static_cast<double>(value);
    const float scale = scales[model_.head(layer, page, off, i / model_.head_dim)];
    return in_dtype(detail::dequantize(format, value, scale));
  }

  /// out = (k, v) [B, T, H, D] must hold, for row b and t < lengths[b], the
  /// model's values of page table(b, t / P) (zeros when unmapped), and zeros
  /// past lengths[b]; a quantized side's values dequantized from the
  /// model's codes and scales, in the cache's dtype, exactly.
  void check_gathered(const std::string& what, const std::pair<at::Tensor, at::Tensor>& out, int64_t layer,
                      const Table& table, const std::vector<int64_t>& lengths, int64_t n_tokens) const {
    const std::vector<int64_t> shape{table.rows, n_tokens, model_.n_heads, model_.head_dim};
    for (const at::Tensor* t : {&out.first, &out.second}) {
      if (t->sizes() != at::IntArrayRef(shape) || t->scalar_type() != dtype_ || !t->is_contiguous())
        fail(what, " returned ", detail::describe(*t), ", expected contiguous ", dtype_, at::IntArrayRef(shape));
    }
    // Doubles hold every value of every dtype used exactly (int16/int8/float64 small integers).
    const at::Tensor k = out.first.to(at::kDouble).contiguous();
    const at::Tensor v = out.second.to(at::kDouble).contiguous();
    const double* kd = k.data_ptr<double>();
    const double* vd = v.data_ptr<double>();
    const int64_t hd = model_.n_heads * model_.head_dim;
    const int64_t P = model_.page_size;
    for (int64_t b = 0; b < table.rows; ++b)
      for (int64_t t = 0; t < n_tokens; ++t) {
        const int64_t page = t < lengths[static_cast<size_t>(b)] ? table.at(b, t / P) : pagedkv::kUnmappedPage;
        if (page != pagedkv::kUnmappedPage && !model_.known[model_.slot(layer, page, t % P)]) continue;
        const size_t out_base = static_cast<size_t>((b * n_tokens + t) * hd);
        for (int64_t i = 0; i < hd; ++i) {
          const double want_k = page == pagedkv::kUnmappedPage
                                    ? 0.0
                                    : gathered(model_.quant.k, model_.k, model_.k_scales, layer, page, t % P, i);
          const double want_v = page == pagedkv::kUnmappedPage
                                    ? 0.0
                                    : gathered(model_.quant.v, model_.v, model_.v_scales, layer, page, t % P, i);
          if (kd[out_base + static_cast<size_t>(i)] != want_k || vd[out_base + static_cast<size_t>(i)] != want_v)
            fail(what, " returned a wrong value at row ", b, " token ", t, " element ", i, ": k ",
                 kd[out_base + static_cast<size_t>(i)], " (want ", want_k, "), v ", vd[out_base + static_cast<size_t>(i)],
                 " (want ", want_v, ")");
        }
      }
  }

  // ---------------------------------------------------------------- model predictions

  bool kv_ok(const at::Tensor& t, int64_t batch) const {
    return t.defined() && t.dim() == 4 && t.size(0) == batch && t.size(2) == model_.n_heads &&
           t.size(3) == model_.head_dim && t.scalar_type() == dtype_ && t.device().is_cpu();
  }

  bool write_ok(int64_t layer, const Table& table, const std::optional<std::vector<int64_t>>& starts,
                const at::Tensor& k, const at::Tensor& v) const {
    if (layer < 0 || layer >= model_.n_layers || !table.ok) return false;
    if (!kv_ok(k, table.rows) || !kv_ok(v, table.rows) || k.sizes() != v.sizes()) return false;
    if (!starts) return false;
    const int64_t n = k.size(1);
    for (int64_t r = 0; r < table.rows; ++r) {
      const int64_t start = (*starts)[static_cast<size_t>(r)];
      if (start < 0) return false;
      if (n == 0) continue;
      if (start > table.cols * model_.page_size - n) return false;
      for (int64_t c = start / model_.page_size; c <= (start + n - 1) / model_.page_size; ++c)
        if (!model_.allocated(table.at(r, c))) return false;
    }
    return true;
  }

  void apply_write(int64_t layer, const Table& table, const std::vector<int64_t>& starts, const at::Tensor& k,
                   const at::Tensor& v) {
    const int64_t n = k.size(1);
    const int64_t hd = model_.n_heads * model_.head_dim;
    const at::Tensor kl = k.to(at::kLong).contiguous();
    const at::Tensor vl = v.to(at::kLong).contiguous();
    // The library quantizes the float32 widening of the input (exact for every dtype here).
    const at::Tensor kf = k.to(at::kFloat).contiguous();
    const at::Tensor vf = v.to(at::kFloat).contiguous();
    std::vector<int> writers(static_cast<size_t>(model_.n_pages * model_.page_size), 0);
    for (int64_t r = 0; r < table.rows; ++r)
      for (int64_t s = 0; s < n; ++s) {
        const int64_t pos = starts[static_cast<size_t>(r)] + s;
        const int64_t page = table.at(r, pos / model_.page_size);
        const int64_t off = pos % model_.page_size;
        const bool conflict = ++writers[static_cast<size_t>(page * model_.page_size + off)] > 1;
        model_.known[model_.slot(layer, page, off)] = conflict ? 0 : 1;
        const size_t src = static_cast<size_t>((r * n + s) * hd);
        store_side(model_.quant.k, kl, kf, src, layer, page, off, model_.k, model_.k_scales);
        store_side(model_.quant.v, vl, vf, src, layer, page, off, model_.v, model_.v_scales);
      }
  }

  /// The model's stored values (native) or codes and scales (quantized) of
  /// one written token: H x D inputs from element `src` of x_long / x_float.
  void store_side(pagedkv::KVFormat format, const at::Tensor& x_long, const at::Tensor& x_float, size_t src,
                  int64_t layer, int64_t page, int64_t off, std::vector<int64_t>& stored, std::vector<float>& scales) {
    const size_t base = model_.elem(layer, page, off, 0, 0);
    const int64_t hd = model_.n_heads * model_.head_dim;
    if (!pagedkv::is_quantized(format)) {
      for (int64_t i = 0; i < hd; ++i)
        stored[base + static_cast<size_t>(i)] = x_long.data_ptr<int64_t>()[src + static_cast<size_t>(i)];
      return;
    }
    for (int64_t h = 0; h < model_.n_heads; ++h) {
      const size_t first = static_cast<size_t>(h * model_.head_dim);
      scales[model_.head(layer, page, off, h)] = detail::quantize_head(
          format, x_float.data_ptr<float>() + src + first, model_.head_dim, stored.data() + base + first);
    }
  }

  // ---------------------------------------------------------------- operations

  int64_t layer() {
    const uint8_t sel = in_.u8();
    if (sel % 16 == 15) return sel % 2 ? model_.n_layers : -1;
    return sel % model_.n_layers;
  }

  struct Kv {
    at::Tensor k, v;
  };
  Kv kv_for(int64_t batch) {
    const int64_t seq = in_.range(0, opt_.max_tokens);
    const uint8_t mal = in_.u8();
    const uint8_t k_mal = mal % 16 < 13 ? 0 : static_cast<uint8_t>(in_.u8() % 6);
    const uint8_t v_mal = mal % 16 == 15 ? static_cast<uint8_t>(in_.u8() % 6) : 0;
    const int64_t v_seq = mal % 16 == 14 ? seq + 1 : seq;  // k and v shapes differ
    ++seed_;
    return {key_or_value(batch, seq, seed_, k_mal), key_or_value(batch, v_seq, seed_ + 1000, v_mal)};
  }

  template <class View>
  void do_write(const std::string& name, const at::Tensor& table_tensor, bool tensor_start, View&& write) {
    const int64_t l = layer();
    const Table table = detail::read_table(table_tensor);
    const int64_t rows = table.ok ? table.rows : (table_tensor.dim() >= 1 ? table_tensor.size(0) : 0);
    const Kv kv = kv_for(rows);
    const int64_t limit = table.cols * model_.page_size;
    std::optional<std::vector<int64_t>> starts;
    at::Tensor start_tensor;
    int64_t start_int = 0;
    if (tensor_start) {
      start_tensor = per_sequence(rows, limit);
      starts = detail::read_per_sequence(start_tensor, rows);
    } else {
      start_int = position(limit);
      starts = std::vector<int64_t>(static_cast<size_t>(rows), start_int);
      if (start_int < 0) starts.reset();
    }
    const bool ok = write_ok(l, table, starts, kv.k, kv.v);
    std::ostringstream what;
    what << name << "(layer " << l << ", table " << detail::describe(table_tensor) << ", start "
         << (tensor_start ? detail::describe(start_tensor) : std::to_string(start_int)) << ", k "
         << detail::describe(kv.k) << ", v " << detail::describe(kv.v) << ")";
    if (attempt(what.str(), ok, [&] { write(l, start_tensor, start_int, kv.k, kv.v); }))
      apply_write(l, table, *starts, kv.k, kv.v);
  }

  void op_alloc() {
    const int64_t want = model_.lowest_free();
    int64_t got = -2;
    attempt("alloc()", true, [&] { got = cache_.alloc(); });
    if (got != want) fail("alloc() = ", got, ", model ", want);
    if (got >= 0) model_.refs[static_cast<size_t>(got)] = 1;
  }

  void op_alloc_n() {
    const int64_t n = in_.range(-2, model_.n_pages + 2);
    std::vector<int64_t> got;
    if (!attempt("alloc_n(" + std::to_string(n) + ")", n >= 0, [&] { got = cache_.alloc_n(n); })) return;
    std::vector<int64_t> want;
    if (n <= model_.n_free()) {
      for (int64_t p = 0; p < model_.n_pages && static_cast<int64_t>(want.size()) < n; ++p)
        if (model_.refs[static_cast<size_t>(p)] == 0) want.push_back(p);
    }
    if (got != want) fail("alloc_n(", n, ") = ", detail::join(got), ", model ", detail::join(want));
    for (int64_t p : want) model_.refs[static_cast<size_t>(p)] = 1;
  }

  void op_free() {
    const int64_t page = pool_page();
    if (attempt("free(" + std::to_string(page) + ")", model_.allocated(page), [&] { cache_.free(page); }))
      --model_.refs[static_cast<size_t>(page)];
  }

  void op_retain() {
    const int64_t page = pool_page();
    if (attempt("retain(" + std::to_string(page) + ")", model_.allocated(page), [&] { cache_.retain(page); }))
      ++model_.refs[static_cast<size_t>(page)];
  }

  void op_ref_count() {
    const int64_t page = pool_page();
    int64_t got = -1;
    if (attempt("ref_count(" + std::to_string(page) + ")", model_.in_range(page), [&] { got = cache_.ref_count(page); }) &&
        got != model_.refs[static_cast<size_t>(page)])
      fail("ref_count(", page, ") = ", got, ", model ", model_.refs[static_cast<size_t>(page)]);
  }

  void op_write(bool tensor_start) {
    const at::Tensor table = page_table();
    do_write(tensor_start ? "write[tensor start]" : "write", table, tensor_start,
             [&](int64_t l, const at::Tensor& st, int64_t si, const at::Tensor& k, const at::Tensor& v) {
               if (tensor_start) cache_.write(l, table, st, k, v);
               else cache_.write(l, table, si, k, v);
             });
  }

  void op_gather() {
    const int64_t l = layer();
    const at::Tensor table_tensor = page_table();
    const Table table = detail::read_table(table_tensor);
    bool ok = l >= 0 && l < model_.n_layers && table.ok;
    const int64_t cols = ok ? Model::mapped_columns(table) : 0;
    ok = ok && model_.readable(table, cols);
    const std::string what = "gather(layer " + std::to_string(l) + ", " + detail::describe(table_tensor) + ")";
    std::pair<at::Tensor, at::Tensor> out;
    if (attempt(what, ok, [&] { out = cache_.gather(l, table_tensor); })) {
      const int64_t n = cols * model_.page_size;
      check_gathered(what, out, l, table, std::vector<int64_t>(static_cast<size_t>(table.rows), n), n);
    }
  }

  void op_gather_lengths() {
    const int64_t l = layer();
    const at::Tensor table_tensor = page_table();
    const Table table = detail::read_table(table_tensor);
    const int64_t rows = table.ok ? table.rows : 0;
    const at::Tensor lengths_tensor = per_sequence(rows, table.cols * model_.page_size);
    const auto lengths = detail::read_per_sequence(lengths_tensor, rows);
    const bool ok = l >= 0 && l < model_.n_layers && table.ok && lengths && model_.mapped_prefixes(table, *lengths);
    const std::string what = "gather(layer " + std::to_string(l) + ", " + detail::describe(table_tensor) +
                             ", lengths " + detail::describe(lengths_tensor) + ")";
    std::pair<at::Tensor, at::Tensor> out;
    if (attempt(what, ok, [&] { out = cache_.gather(l, table_tensor, lengths_tensor); })) {
      const int64_t n = lengths->empty() ? 0 : *std::max_element(lengths->begin(), lengths->end());
      check_gathered(what, out, l, table, *lengths, n);
    }
  }

  void op_bind() {
    const at::Tensor table_tensor = page_table();
    const Table table = detail::read_table(table_tensor);
    std::optional<pagedkv::CacheView<Layout>> view;
    if (in_.flag()) {
      const int64_t total = position(table.ok ? Model::mapped_columns(table) * model_.page_size : 0);
      const bool ok = table.ok && total >= 0 && total <= Model::mapped_columns(table) * model_.page_size;
      attempt("bind(" + detail::describe(table_tensor) + ", total_len " + std::to_string(total) + ")", ok,
              [&] { view.emplace(cache_.bind(table_tensor, total)); });
    } else {
      const int64_t rows = table.ok ? table.rows : 0;
      const at::Tensor lengths_tensor = per_sequence(rows, table.cols * model_.page_size);
      const auto lengths = detail::read_per_sequence(lengths_tensor, rows);
      const bool ok = table.ok && lengths && model_.mapped_windows(table, *lengths);
      attempt("bind(" + detail::describe(table_tensor) + ", lengths " + detail::describe(lengths_tensor) + ")", ok,
              [&] { view.emplace(cache_.bind(table_tensor, lengths_tensor)); });
    }
    if (!view) return;
    if (views_.size() >= 3) views_.erase(views_.begin());
    views_.push_back(*view);
  }

  void op_view_gather() {
    if (views_.empty()) return;
    const pagedkv::CacheView<Layout>& view = views_[in_.u8() % views_.size()];
    const int64_t l = layer();
    const Table table = detail::read_table(view.page_table());
    bool ok = l >= 0 && l < model_.n_layers && table.ok;
    std::vector<int64_t> lengths;
    int64_t n = 0;
    if (ok && view.lengths().defined()) {
      const auto lens = detail::read_per_sequence(view.lengths(), table.rows);
      ok = lens && model_.mapped_prefixes(table, *lens);
      if (ok) lengths = *lens;
      n = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
    } else if (ok && view.total_len() > 0) {
      n = view.total_len();
      ok = n <= Model::mapped_columns(table) * model_.page_size &&
           model_.readable(table, (n + model_.page_size - 1) / model_.page_size);
      lengths.assign(static_cast<size_t>(table.rows), n);
    } else if (ok) {
      const int64_t cols = Model::mapped_columns(table);
      ok = model_.readable(table, cols);
      n = cols * model_.page_size;
      lengths.assign(static_cast<size_t>(table.rows), n);
    }
    const std::string what = "view.gather(layer " + std::to_string(l) + ", " + detail::describe(view.page_table()) +
                             ", total_len " + std::to_string(view.total_len()) + ", lengths " +
                             detail::describe(view.lengths()) + ")";
    std::pair<at::Tensor, at::Tensor> out;
    if (attempt(what, ok, [&] { out = view.gather(l); })) check_gathered(what, out, l, table, lengths, n);
  }

  void op_view_write() {
    if (views_.empty()) return;
    const pagedkv::CacheView<Layout> view = views_[in_.u8() % views_.size()];
    const bool tensor_start = in_.flag();
    do_write(tensor_start ? "view.write[tensor start]" : "view.write", view.page_table(), tensor_start,
             [&](int64_t l, const at::Tensor& st, int64_t si, const at::Tensor& k, const at::Tensor& v) {
               if (tensor_start) view.write(l, st, k, v);
               else view.write(l, si, k, v);
             });
  }

  /// The engine edits a bound page table (or lengths) in place: the view
  /// must see it, and re-validate.
  void op_view_edit() {
    if (views_.empty()) return;
    const pagedkv::CacheView<Layout>& view = views_[in_.u8() % views_.size()];
    const at::Tensor& target = in_.flag() && view.lengths().defined() ? view.lengths() : view.page_table();
    if (target.numel() == 0 || !detail::index_dtype(target)) return;
    const int64_t flat = in_.range(0, target.numel() - 1);
    const uint8_t sel = in_.u8() % 4;
    int64_t value = sel == 0 ? pagedkv::kUnmappedPage : sel == 1 ? garbage_page(false) : pick_allocated();
    if (target.dim() == 1 && sel == 3) value = in_.range(0, opt_.max_cols * model_.page_size);
    if (target.scalar_type() == at::kInt) value = std::max<int64_t>(detail::kI32Min, std::min<int64_t>(value, detail::kI32Max));
    at::Tensor element = target.dim() == 1 ? target.select(0, flat)
                                           : target.select(0, flat / target.size(1)).select(0, flat % target.size(1));
    element.fill_(value);
    if (opt_.trace) std::fprintf(stderr, "[%lld] edit bound tensor element %lld = %lld\n",
                                 static_cast<long long>(stats_.calls), static_cast<long long>(flat),
                                 static_cast<long long>(value));
  }

  /// A constructor call with garbage sizes: only invalid ones are tried (a
  /// valid one could ask for terabytes); it must throw c10::Error.
  void op_construct_invalid() {
    const int64_t choices[] = {-1, 0, 1, 3, int64_t{1} << 31, int64_t{1} << 40, int64_t{1} << 62, detail::kI64Max};
    int64_t dims[5];
    for (auto& d : dims) d = choices[in_.u8() % 8];
    bool valid = true;
    int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype_));
    for (const int64_t d : dims) {
      valid = valid && d >= 1 && d <= detail::kI64Max / bytes;
      if (valid) bytes *= d;
    }
    valid = valid && dims[1] <= detail::kI32Max;  // the pool's bound on n_pages
    if (valid) return;
    std::ostringstream what;
    what << "PagedCache(" << dims[0] << ", " << dims[1] << ", " << dims[2] << ", " << dims[3] << ", " << dims[4] << ")";
    attempt(what.str(), false, [&] {
      pagedkv::PagedCache<Layout>(dims[0], dims[1], dims[2], dims[3], dims[4], at::TensorOptions().dtype(dtype_));
    });
  }

  void step() {
    switch (in_.u8() % 15) {
      case 14: op_construct_invalid(); break;
      case 0: case 1: op_alloc(); break;
      case 2: op_alloc_n(); break;
      case 3: op_free(); break;
      case 4: op_retain(); break;
      case 5: op_ref_count(); break;
      case 6: case 7: op_write(false); break;
      case 8: op_write(true); break;
      case 9: op_gather(); break;
      case 10: op_gather_lengths(); break;
      case 11: op_bind(); break;
      case 12: op_view_gather(); break;
      default:
        switch (in_.u8() % 3) {
          case 0: op_view_write(); break;
          case 1: op_view_edit(); break;
          default: op_view_gather(); break;
        }
    }
  }

  Bytes& in_;
  const Options& opt_;
  pagedkv::PagedCache<Layout> cache_;
  Model model_;
  at::ScalarType dtype_;
  std::vector<pagedkv::CacheView<Layout>> views_;
  Stats stats_;
  int64_t seed_ = 0;
};

/// The K/V formats, from the n_layers byte: with the default max_layers (2)
/// n_layers reads only its bit 0, and scripts before quantized pages ignored
/// the rest. Bits 1-3 == 4 (1 in 8 inputs; few committed seeds have it, so
/// most keep their native meaning) selects quantized pages, bits 4-7 the
/// formats (K = bits % 3, V = bits / 3 % 3: native, fp8, int8; K and V
/// both native is native). Only for the dtypes quantized pages take.
inline pagedkv::KVQuant quant_of(uint8_t layers_byte, at::ScalarType dtype) {
  const bool quantizable = dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
  if (!quantizable || ((layers_byte >> 1) & 7u) != 4u) return {};
  const pagedkv::KVFormat formats[] = {pagedkv::KVFormat::native, pagedkv::KVFormat::fp8_e4m3,
                                       pagedkv::KVFormat::int8};
  const unsigned sel = layers_byte >> 4;
  return {formats[sel % 3], formats[sel / 3 % 3]};
}

/// Decodes a configuration from the first bytes and runs the rest as a script.
inline Stats run_script(const uint8_t* data, size_t size, const Options& opt = Options()) {
  Bytes in(data, size);
  const uint8_t head = in.u8();
  const bool hnd = (head & 1u) != 0;
  const at::ScalarType dtypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble, at::kShort, at::kChar};
  const at::ScalarType dtype = dtypes[(head >> 1) % 6];
  const pagedkv::ScopedBackend backend((head >> 5) % 4 == 3 ? pagedkv::Backend::generic : pagedkv::Backend::automatic);
  const pagedkv::KVQuant quant = quant_of(in.peek(), dtype);
  const int64_t n_layers = in.range(1, opt.max_layers);
  const int64_t n_pages = in.range(1, opt.max_pages);
  const int64_t page_size = in.range(1, opt.max_page_size);
  const int64_t n_heads = in.range(1, opt.max_heads);
  const int64_t head_dim = in.range(1, opt.max_head_dim);
  if (hnd) return Runner<pagedkv::HND>(in, opt, n_layers, n_pages, page_size, n_heads, head_dim, dtype, quant).run();
  return Runner<pagedkv::NHD>(in, opt, n_layers, n_pages, page_size, n_heads, head_dim, dtype, quant).run();
}

}  // namespace pagedkv_fuzz
