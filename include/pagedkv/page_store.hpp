// Prefix tiers: where the pages a PrefixCache evicts go instead of being
// lost, and where a later match finds them again (docs/tiers.md).
//
// - PageStore: one tier below the device pool, a map from PageKey to an
//   entry (a CPU byte tensor) with a budget. The interface is small so that
//   an engine can add its own (an object store, a transfer engine): a store
//   keeps bytes and never interprets them; the prefix cache builds every
//   entry and checks every entry it reads back.
// - host_store: host memory, LRU within max_bytes. disk_store: one file per
//   entry in a directory, LRU within max_bytes, readable by a later process
//   and by several at once. pagedkv/stores/redis.hpp: redis_store.
// - PageKey: a 64-bit hash of the cache's geometry, dtype and formats, the
//   salt and every token from position 0 to the page's end. It only names an
//   entry: the entry repeats all of that, and a load compares it in full, so
//   a hash collision or a store shared by other models is a miss, never K/V.
// - Entry format (page_store::): a header, the tokens, the payload (every
//   layer's K, its scales when quantized, V, its scales) in a
//   layout-independent order (token-major: an HND page loads into an NHD
//   cache) and a checksum of everything before it. Corrupt, truncated and
//   foreign entries are misses; the cache removes them and warns.
// - Failures inside a store (a full disk, an unreachable server) are misses
//   or refused puts with a warning: a store never throws into the engine.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <functional>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pagedkv/checks.hpp"
#include "pagedkv/cpu/copy.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/ops/backend.hpp"
#include "pagedkv/ops/page_copy.hpp"
#include "pagedkv/paged_cache.hpp"
#include "pagedkv/prefix_hash.hpp"

namespace pagedkv {

/// Names one page's entry in every store. Equal keys for equal (geometry,
/// dtype, formats, salt, tokens up to the page's end); a key alone never
/// decides a match (the entry's contents are compared).
struct PageKey {
  uint64_t hash = 0;

  /// 16 lowercase hex digits: a file name, a Redis key's suffix.
  std::string name() const {
    char text[17];
    std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(hash));
    return text;
  }
  bool operator==(const PageKey& other) const noexcept { return hash == other.hash; }
  bool operator!=(const PageKey& other) const noexcept { return hash != other.hash; }
};

/// An entry a store gave back to the cache (pushed out by its budget).
struct StoredPage {
  PageKey key;
  at::Tensor entry;  // 1-D kByte, contiguous, on the CPU
};

/// An entry a store reads as the cache asks (PageStore::open): a file read
/// into a buffer the cache keeps from entry to entry rather than into a
/// new tensor per entry (bench/NOTES.md, "Verifying while copying").
class EntryReader {
 public:
  virtual ~EntryReader() = default;
  /// The entry's size in bytes.
  virtual size_t size() const = 0;
  /// Reads the entry's next n bytes into dst; returns the bytes read, fewer
  /// than n only when the entry ends early or reading fails (the cache then
  /// counts the entry corrupt: a miss).
  virtual size_t read(uint8_t* dst, size_t n) = 0;
  /// The whole entry, when the reader only holds one in memory (the default
  /// PageStore::open's): the cache then reads it in place. Undefined otherwise.
  virtual at::Tensor whole() const { return at::Tensor(); }

 protected:
  EntryReader() = default;
  EntryReader(const EntryReader&) = default;
  EntryReader& operator=(const EntryReader&) = default;
};

namespace detail {

/// An entry in memory as an EntryReader.
class TensorReader final : public EntryReader {
 public:
  explicit TensorReader(at::Tensor entry) : entry_(std::move(entry)) {}
  size_t size() const override { return static_cast<size_t>(entry_.numel()); }
  size_t read(uint8_t* dst, size_t n) override {
    const size_t take = std::min(n, size() - done_);
    if (take > 0) std::memcpy(dst, entry_.data_ptr<uint8_t>() + done_, take);
    done_ += take;
    return take;
  }
  at::Tensor whole() const override { return entry_; }

 private:
  at::Tensor entry_;
  size_t done_ = 0;
};

}  // namespace detail

/// One tier below the device pool. Entries are 1-D contiguous kByte CPU
/// tensors that the store keeps as they are (it may keep the tensor itself:
/// the cache never writes to an entry after put). Implementations must not
/// throw for their own failures (I/O, network): they warn and miss or refuse;
/// the prefix cache still catches anything thrown and treats it as a miss.
/// A store is shared through shared_ptr and may be used by several caches.
class PageStore {
 public:
  virtual ~PageStore() = default;

  /// The tier's name in events and stats: "host", "disk", "remote", or an
  /// engine's own.
  virtual std::string tier() const = 0;

  /// Keeps `entry` under `key`, replacing any entry with that key. To stay
  /// within its budget it drops least recently used entries, and appends
  /// them to `pushed_out` (least recently used first) when that is not
  /// null, so that the next tier can keep them. Returns false, keeping
  /// nothing, when it cannot keep the entry (larger than the budget, a full
  /// disk, a server that does not answer).
  virtual bool put(const PageKey& key, const at::Tensor& entry, std::vector<StoredPage>* pushed_out) = 0;

  /// The entry under `key`, marked used; an undefined tensor on a miss.
  virtual at::Tensor get(const PageKey& key) = 0;

  /// Removes the entry under `key`, if any (the cache found it corrupt or foreign).
  virtual void erase(const PageKey& key) = 0;

  /// The entry under `key` to read, marked used; null on a miss. Optional:
  /// by default get()'s tensor (EntryReader::whole), which the cache reads
  /// in place. A store whose entries come from elsewhere (a file) may give a
  /// reader instead, and the cache reads the entry into a buffer of its own
  /// that it reuses from entry to entry (disk_store does).
  virtual std::unique_ptr<EntryReader> open(const PageKey& key) {
    at::Tensor entry = get(key);
    if (!entry.defined()) return nullptr;
    return std::make_unique<detail::TensorReader>(std::move(entry));
  }

  /// Removes and returns every entry, least recently used first, when the
  /// store's memory dies with the process (host memory), so that its
  /// entries can move to a tier that outlives it; stores that persist keep
  /// theirs and return nothing.
  virtual std::vector<StoredPage> drain() { return {}; }

  /// Whether every entry get() returns is a tensor that put() was given in
  /// this process (host memory): nothing between the two can corrupt it, so
  /// the cache skips its checksum on load (it still compares the geometry,
  /// the salt and the tokens). Stores that copy bytes anywhere say false.
  virtual bool in_process() const { return false; }

 protected:
  PageStore() = default;
  PageStore(const PageStore&) = default;
  PageStore& operator=(const PageStore&) = default;
};

namespace page_store {

/// What an entry holds besides its payload (all fixed-size fields, in the
/// host's byte order: on a host of the other order the magic differs and
/// every entry is foreign).
struct Header {
  char magic[8];          // kMagic
  uint64_t key;           // PageKey::hash
  uint64_t page_hash;     // the prefix cache's chained hash of the page (for events)
  uint64_t parent_hash;   // its parent's; 0 for a prompt's first page
  int64_t n_layers;
  int64_t page_size;
  int64_t n_kv_heads;
  int64_t head_dim;
  int32_t dtype;          // dtype_code()
  int32_t k_format;       // KVFormat
  int32_t v_format;
  int32_t reserved;       // 0
  uint64_t salt;
  int64_t n_tokens;       // tokens from position 0 to the page's end
  uint64_t payload_bytes;
};
static_assert(sizeof(Header) == 104, "the entry header is 104 bytes with no padding");

constexpr char kMagic[8] = {'P', 'K', 'V', 'P', 'A', 'G', 'E', '2'};
// Part of every key, so a new format never even names an old entry; the
// magic also differs, so an old entry read by any means is a corrupt miss.
// 2: the checksum folds two words per multiply.
constexpr uint64_t kFormatVersion = 2;

/// A stable code per dtype (c10's enum numbering is not a file format).
inline int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 1;
    case at::kHalf: return 2;
    case at::kBFloat16: return 3;
    case at::kDouble: return 4;
    default: return 1000 + static_cast<int32_t>(t);
  }
}

inline size_t padded(size_t n) noexcept { return (n + 7) & ~static_cast<size_t>(7); }

/// The cache properties an entry must match to load into it (not the layout).
struct Geometry {
  int64_t n_layers = 0;
  int64_t page_size = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  at::ScalarType dtype = at::kFloat;
  KVQuant quant{};

  template <class Layout>
  static Geometry of(const PagedCache<Layout>& cache) {
    return {cache.n_layers(), cache.page_size(), cache.n_kv_heads(), cache.head_dim(), cache.dtype(), cache.quant()};
  }

  size_t codes_bytes(KVFormat f) const noexcept {
    return static_cast<size_t>(n_layers * page_size * n_kv_heads * head_dim) *
           at::elementSize(storage_dtype(f, dtype));
  }
  size_t scales_bytes(KVFormat f) const noexcept {
    return is_quantized(f) ? static_cast<size_t>(n_layers * page_size * n_kv_heads) * sizeof(float) : 0;
  }
  /// Payload sections, each padded to 8 bytes (so that every section is
  /// aligned for its elements): K codes, K scales, V codes, V scales.
  size_t payload_bytes() const noexcept {
    return padded(codes_bytes(quant.k)) + padded(scales_bytes(quant.k)) + padded(codes_bytes(quant.v)) +
           padded(scales_bytes(quant.v));
  }
  size_t entry_bytes(int64_t n_tokens) const noexcept {
    return sizeof(Header) + static_cast<size_t>(n_tokens) * sizeof(int64_t) + payload_bytes() + sizeof(uint64_t);
  }
};

/// 64-bit checksum: eight independent lanes, each step folding two 8-byte
/// words a and b into its lane as (lane ^ a) * odd + b, a bijection of the
/// lane and of each word alone, so any change to one word always changes
/// the sum; then murmur3's finaliser over the lanes and the length. Two
/// words per multiply: one per multiply (format 1) was bound by the
/// multiplier's throughput, a fifth of a disk restore (bench/NOTES.md,
/// "Restores without a parallel region per page"). Fed in pieces (a load
/// sums the payload while it copies it into the page), it gives what
/// checksum() gives over their concatenation.
class Checksum {
 public:
  static constexpr size_t kBlock = 128;  // 16 words: two per lane

  Checksum() noexcept {
    constexpr uint64_t kInit[kLanes] = {0x243f6a8885a308d3ULL, 0x13198a2e03707344ULL, 0xa4093822299f31d0ULL,
                                        0x082efa98ec4e6c89ULL, 0x452821e638d01377ULL, 0xbe5466cf34e90c6cULL,
                                        0xc0ac29b7c97c50ddULL, 0x3f84d5b5b5470917ULL};
    for (int l = 0; l < kLanes; ++l) lane_[l] = kInit[l];
  }

  /// Sums the next n bytes.
  void update(const uint8_t* data, size_t n) noexcept {
    if (n == 0) return;
    total_ += n;
    if (carried_ > 0) {
      const size_t take = std::min(n, kBlock - carried_);
      std::memcpy(carry_ + carried_, data, take);
      carried_ += take;
      data += take;
      n -= take;
      if (carried_ < kBlock) return;
      fold(lane_, carry_, 1);
      carried_ = 0;
    }
    const size_t blocks = n / kBlock;
    fold(lane_, data, blocks);
    carried_ = n - blocks * kBlock;
    if (carried_ > 0) std::memcpy(carry_, data + blocks * kBlock, carried_);
  }

  /// update(src, n), and the same n bytes copied to dst, read once for both:
  /// the copy follows the sum 128 bytes at a time. kStream: with streaming
  /// stores when dst is 16-byte aligned and n a multiple of 16 (else the
  /// sum, then a memcpy of what the sum just read).
  template <bool kStream>
  void update_copy(char* dst, const uint8_t* src, size_t n) noexcept {
#if defined(__SSE2__)
    if (kStream && ((reinterpret_cast<uintptr_t>(dst) | n) & 15) == 0) {
      // The sum's blocks lie on the entry's 128-byte grid, the copy's on
      // dst's: the first `head` bytes complete the sum's partial block.
      const size_t head = std::min(n, carried_ == 0 ? size_t{0} : kBlock - carried_);
      update(src, head);
      const uint8_t* s = src + head;
      const size_t blocks = (n - head) / kBlock;
      uint64_t lane[kLanes];
      for (int l = 0; l < kLanes; ++l) lane[l] = lane_[l];
      for (size_t b = 0; b < blocks; ++b) {
        fold(lane, s + b * kBlock, 1);
        const uint8_t* from = src + b * kBlock;
        char* to = dst + b * kBlock;
        for (size_t i = 0; i < kBlock; i += 16)
          _mm_stream_si128(reinterpret_cast<__m128i*>(to + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i)));
      }
      for (int l = 0; l < kLanes; ++l) lane_[l] = lane[l];
      total_ += blocks * kBlock;
      const size_t copied = blocks * kBlock;
      cpu::copy_run<true>(dst + copied, reinterpret_cast<const char*>(src) + copied, static_cast<int64_t>(n - copied));
      update(s + copied, n - head - copied);
      return;
    }
#endif
    update(src, n);
    if (n > 0) std::memcpy(dst, src, n);
  }

  /// The sum of every byte fed; the object is spent.
  uint64_t finish() noexcept {
    // The tail: whole words, then the last bytes zero-extended.
    size_t i = 0;
    for (int l = 0; i < carried_; ++l) {
      uint64_t w = 0;
      const size_t take = std::min<size_t>(8, carried_ - i);
      std::memcpy(&w, carry_ + i, take);
      lane_[l % kLanes] = (lane_[l % kLanes] ^ w) * kMul[l % kLanes];
      i += take;
    }
    uint64_t h = static_cast<uint64_t>(total_);
    for (int l = 0; l < kLanes; ++l) h = prefix_hash::mix(h ^ lane_[l]) + static_cast<uint64_t>(l);
    return h;
  }

 private:
  static constexpr int kLanes = 8;
  static constexpr uint64_t kMul[kLanes] = {0x9e3779b97f4a7c15ULL, 0xc2b2ae3d27d4eb4fULL, 0x165667b19e3779f9ULL,
                                            0xd6e8feb86659fd93ULL, 0xa0761d6478bd642fULL, 0xe7037ed1a0b428dbULL,
                                            0x8ebc6af09c88c6e3ULL, 0x589965cc75374cc3ULL};

  static void fold(uint64_t* lanes, const uint8_t* data, size_t blocks) noexcept {
    uint64_t lane[kLanes];
    for (int l = 0; l < kLanes; ++l) lane[l] = lanes[l];
    for (size_t b = 0; b < blocks; ++b, data += kBlock) {
      for (int l = 0; l < kLanes; ++l) {
        uint64_t a, w;
        std::memcpy(&a, data + 16 * l, 8);
        std::memcpy(&w, data + 16 * l + 8, 8);
        lane[l] = (lane[l] ^ a) * kMul[l] + w;
      }
    }
    for (int l = 0; l < kLanes; ++l) lanes[l] = lane[l];
  }

  uint64_t lane_[kLanes];
  uint8_t carry_[kBlock] = {};  // only its first carried_ bytes are read; zeroed for the analysers
  size_t carried_ = 0;  // bytes in carry_: the start of a block not yet summed
  size_t total_ = 0;
};

/// The checksum of n bytes (Checksum, in one piece).
inline uint64_t checksum(const uint8_t* data, size_t n) noexcept {
  Checksum sum;
  sum.update(data, n);
  return sum.finish();
}

/// The key chain's seed: the entry format, the geometry, the dtype, the formats and the salt.
inline uint64_t key_seed(const Geometry& g, uint64_t salt) noexcept {
  uint64_t h = prefix_hash::mix(kFormatVersion ^ 0x7f4a7c159e3779b9ULL);
  const uint64_t fields[] = {static_cast<uint64_t>(g.n_layers),       static_cast<uint64_t>(g.page_size),
                             static_cast<uint64_t>(g.n_kv_heads),     static_cast<uint64_t>(g.head_dim),
                             static_cast<uint64_t>(dtype_code(g.dtype)), static_cast<uint64_t>(g.quant.k),
                             static_cast<uint64_t>(g.quant.v),        salt};
  for (const uint64_t f : fields) h = prefix_hash::mix(h ^ f) * 0x100000001b3ULL;
  return prefix_hash::mix(h);
}

/// The key of the page after the one whose key (or, for a prompt's first
/// page, the seed) is `previous`, holding `page_tokens` [page_size].
inline PageKey next_key(uint64_t previous, const int64_t* page_tokens, int64_t page_size) noexcept {
  return PageKey{prefix_hash::page(previous, page_tokens, page_size)};
}

/// What the cache knows of a page it writes down.
struct Identity {
  PageKey key;
  uint64_t page_hash = 0;
  uint64_t parent_hash = 0;
  uint64_t salt = 0;
  const int64_t* tokens = nullptr;  // [n_tokens]: from position 0 to the page's end
  int64_t n_tokens = 0;
};

/// The header of `entry`, if it has one of the right size; nothing verified.
inline bool read_header(const at::Tensor& entry, Header* header) {
  if (!entry.defined() || entry.device().type() != at::kCPU || entry.scalar_type() != at::kByte ||
      entry.dim() != 1 || !entry.is_contiguous() || entry.numel() < static_cast<int64_t>(sizeof(Header)))
    return false;
  std::memcpy(header, entry.data_ptr<uint8_t>(), sizeof(Header));
  return std::memcmp(header->magic, kMagic, sizeof(kMagic)) == 0;
}

/// Views of a page's K or V codes and scales, token-major ([n_layers,
/// page_size, n_kv_heads, head_dim] and [n_layers, page_size, n_kv_heads])
/// whatever the layout: the order entries hold them in.
template <class Layout>
at::Tensor page_codes(const at::Tensor& storage, int64_t page) {
  const at::Tensor t = storage.select(1, page);  // [n_layers, <page>]
  return Layout::token_stride(1, 2, 1) == 1 ? t.transpose(1, 2) : t;  // HND pages are [H, P, D]
}
template <class Layout>
at::Tensor page_scales(const at::Tensor& scales, int64_t page, int64_t page_size, int64_t n_kv_heads) {
  const at::Tensor t = scales.select(1, page);  // [n_layers, page_size * n_kv_heads] in the layout's order
  if (Layout::token_stride(1, 2, 1) == 1) return t.view({t.size(0), n_kv_heads, page_size}).transpose(1, 2);
  return t.view({t.size(0), page_size, n_kv_heads});
}

/// The payload sections of an entry of geometry g, as tensors over its bytes.
struct Sections {
  at::Tensor k, k_scales, v, v_scales;  // scales undefined for a native side
};

inline Sections sections(const Geometry& g, uint8_t* payload) {
  const auto opts = [](at::ScalarType t) { return at::TensorOptions().dtype(t).device(at::kCPU); };
  Sections s;
  uint8_t* p = payload;
  const auto side = [&](KVFormat f, at::Tensor& codes, at::Tensor& scales) {
    codes = at::from_blob(p, {g.n_layers, g.page_size, g.n_kv_heads, g.head_dim}, opts(storage_dtype(f, g.dtype)));
    p += padded(g.codes_bytes(f));
    if (is_quantized(f)) {
      scales = at::from_blob(p, {g.n_layers, g.page_size, g.n_kv_heads}, opts(at::kFloat));
      p += padded(g.scales_bytes(f));
    }
  };
  side(g.quant.k, s.k, s.k_scales);
  side(g.quant.v, s.v, s.v_scales);
  return s;
}

/// Copies page `page` of `cache`, every layer, K and V with their scales,
/// into an entry's sections (to_entry) or from them.
template <class Layout>
void copy_page(const PagedCache<Layout>& cache, int64_t page, const Sections& s, bool to_entry) {
  if (ops::use_cpu_kernels(cache.device())) {
    // On the calling thread, one memcpy per contiguous run: each section is
    // a few hundred KiB, over ATen's grain, so a copy_ per section was a
    // parallel region per section, and a restore of a long prefix entered
    // hundreds of them, each stalling whenever an OpenMP worker was
    // descheduled (bench/NOTES.md, "Restores without a parallel region per page").
    // Into the cache, the library's policy for writes (cpu::use_streaming_stores):
    // a restored page is a cold slot, and a page of 1 MiB or more streams.
    const int64_t code_bytes = static_cast<int64_t>(cache.k_cache().element_size());
    const bool stream =
        !to_entry && cpu::use_streaming_stores(static_cast<int64_t>(Geometry::of(cache).payload_bytes()),
                                               cpu::page_strides(cache.geometry(), code_bytes), cache.geometry(),
                                               code_bytes);
    const auto tensors = ops::page_tensors(cache.storage());  // k, v, k scales, v scales
    const at::Tensor* entry_sections[4] = {&s.k, &s.v, &s.k_scales, &s.v_scales};
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor& t = tensors[i].first;
      if (!t.defined()) continue;
      const PageGeometry& pg = tensors[i].second;
      const int64_t es = static_cast<int64_t>(t.element_size());
      const cpu::BlockShape shape{pg.page_size, pg.n_heads, pg.head_dim, es};
      const cpu::BlockStrides in_cache = cpu::page_strides(pg, es);
      const cpu::BlockStrides in_entry{pg.n_heads * pg.head_dim * es, pg.head_dim * es, es};  // token-major
      const int64_t cache_layer_bytes = t.stride(0) * es;
      const int64_t entry_layer_bytes = pg.page_elems * es;
      char* cache_page = static_cast<char*>(t.data_ptr()) + page * t.stride(1) * es;
      char* entry = static_cast<char*>(entry_sections[i]->data_ptr());
      for (int64_t layer = 0; layer < t.size(0); ++layer) {
        char* c = cache_page + layer * cache_layer_bytes;
        char* e = entry + layer * entry_layer_bytes;
        if (to_entry) {
          cpu::copy_block(e, in_entry, c, in_cache, shape);
        } else if (stream) {
          cpu::copy_block<true>(c, in_cache, e, in_entry, shape);
        } else {
          cpu::copy_block(c, in_cache, e, in_entry, shape);
        }
      }
    }
    if (stream) cpu::streaming_fence();
    return;
  }
  // Blocking copies, also from pinned memory to a CUDA cache (a DMA at
  // full speed): the views over the entry do not own its memory, so the
  // host allocator could not tell that an asynchronous copy still reads it
  // once the store lets the entry go.
  const int64_t ps = cache.page_size(), heads = cache.n_kv_heads();
  const std::pair<at::Tensor, at::Tensor> pairs[4] = {
      {page_codes<Layout>(cache.k_cache(), page), s.k},
      {page_codes<Layout>(cache.v_cache(), page), s.v},
      {s.k_scales.defined() ? page_scales<Layout>(cache.k_scales(), page, ps, heads) : at::Tensor(), s.k_scales},
      {s.v_scales.defined() ? page_scales<Layout>(cache.v_scales(), page, ps, heads) : at::Tensor(), s.v_scales}};
  for (const auto& [in_cache, in_entry] : pairs) {
    if (!in_entry.defined()) continue;
    if (to_entry) {
      in_entry.copy_(in_cache);
    } else {
      in_cache.copy_(in_entry);
    }
  }
}

/// A new entry holding page `page` of `cache` under `id` (pinned host
/// memory for a CUDA cache, so that a later load is a DMA at full speed).
template <class Layout>
at::Tensor encode(const PagedCache<Layout>& cache, int64_t page, const Identity& id) {
  const Geometry g = Geometry::of(cache);
  const size_t size = g.entry_bytes(id.n_tokens);
  at::TensorOptions opts = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
  if (cache.device().is_cuda()) opts = opts.pinned_memory(true);
  at::Tensor entry = at::empty({static_cast<int64_t>(size)}, opts);
  uint8_t* data = entry.data_ptr<uint8_t>();
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.key = id.key.hash;
  h.page_hash = id.page_hash;
  h.parent_hash = id.parent_hash;
  h.n_layers = g.n_layers;
  h.page_size = g.page_size;
  h.n_kv_heads = g.n_kv_heads;
  h.head_dim = g.head_dim;
  h.dtype = dtype_code(g.dtype);
  h.k_format = static_cast<int32_t>(g.quant.k);
  h.v_format = static_cast<int32_t>(g.quant.v);
  h.salt = id.salt;
  h.n_tokens = id.n_tokens;
  h.payload_bytes = g.payload_bytes();
  std::memcpy(data, &h, sizeof(h));
  std::memcpy(data + sizeof(h), id.tokens, static_cast<size_t>(id.n_tokens) * sizeof(int64_t));
  uint8_t* payload = data + sizeof(h) + static_cast<size_t>(id.n_tokens) * sizeof(int64_t);
  const Sections s = sections(g, payload);
  {  // the padding after each section is checksummed too
    const size_t sizes[4] = {g.codes_bytes(g.quant.k), g.scales_bytes(g.quant.k), g.codes_bytes(g.quant.v),
                             g.scales_bytes(g.quant.v)};
    uint8_t* p = payload;
    for (const size_t n : sizes) {
      std::memset(p + n, 0, padded(n) - n);
      p += padded(n);
    }
  }
  copy_page(cache, page, s, /*to_entry=*/true);
  const uint64_t sum = checksum(data, size - sizeof(uint64_t));
  std::memcpy(data + size - sizeof(uint64_t), &sum, sizeof(sum));
  return entry;
}

enum class Verdict { ok, corrupt, foreign };

/// Whether `entry` is a whole, intact entry of page `key` for a cache of
/// geometry g with `salt` and `tokens` [n_tokens]; `why` says what is wrong.
inline Verdict verify_bytes(const uint8_t* data, size_t size, const Geometry& g, const PageKey& key, uint64_t salt,
                            const int64_t* tokens, int64_t n_tokens, std::string* why, bool check_sum);

inline Verdict verify(const at::Tensor& entry, const Geometry& g, const PageKey& key, uint64_t salt,
                      const int64_t* tokens, int64_t n_tokens, std::string* why, bool check_sum = true) {
  Header h{};
  if (!read_header(entry, &h)) {
    *why = entry.defined() && entry.numel() >= static_cast<int64_t>(sizeof(Header))
               ? "no pagedkv entry header (bad magic, or not a contiguous 1-D uint8 CPU tensor)"
               : "shorter than an entry header";
    return Verdict::corrupt;
  }
  return verify_bytes(entry.data_ptr<uint8_t>(), static_cast<size_t>(entry.numel()), g, key, salt, tokens, n_tokens,
                      why, check_sum);
}

/// verify() of an entry of `size` bytes at `data` (an entry a store read
/// into the cache's buffer). Without check_sum only the first min(size,
/// sizeof(Header) + 8 x n_tokens) bytes are read.
inline Verdict verify_bytes(const uint8_t* data, size_t size, const Geometry& g, const PageKey& key, uint64_t salt,
                            const int64_t* tokens, int64_t n_tokens, std::string* why, bool check_sum) {
  Header h{};
  if (size < sizeof(Header)) {
    *why = "shorter than an entry header";
    return Verdict::corrupt;
  }
  std::memcpy(&h, data, sizeof(h));
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) {
    *why = "no pagedkv entry header (bad magic)";
    return Verdict::corrupt;
  }
  if (h.n_tokens < 0 || h.n_tokens > static_cast<int64_t>(size / sizeof(int64_t)) ||
      h.payload_bytes > size ||
      sizeof(Header) + static_cast<size_t>(h.n_tokens) * sizeof(int64_t) + h.payload_bytes + sizeof(uint64_t) != size) {
    *why = "its size " + std::to_string(size) + " does not match its header (truncated or corrupt)";
    return Verdict::corrupt;
  }
  if (check_sum) {
    uint64_t sum;
    std::memcpy(&sum, data + size - sizeof(uint64_t), sizeof(sum));
    if (checksum(data, size - sizeof(uint64_t)) != sum) {
      *why = "its checksum does not match its contents (corrupt)";
      return Verdict::corrupt;
    }
  }
  if (h.n_layers != g.n_layers || h.page_size != g.page_size || h.n_kv_heads != g.n_kv_heads ||
      h.head_dim != g.head_dim || h.dtype != dtype_code(g.dtype) || h.k_format != static_cast<int32_t>(g.quant.k) ||
      h.v_format != static_cast<int32_t>(g.quant.v) || h.payload_bytes != g.payload_bytes()) {
    *why = "it holds a page of another geometry, dtype or format (a foreign entry)";
    return Verdict::foreign;
  }
  if (h.key != key.hash || h.salt != salt || h.n_tokens != n_tokens ||
      std::memcmp(data + sizeof(Header), tokens, static_cast<size_t>(n_tokens) * sizeof(int64_t)) != 0) {
    *why = "it holds another prefix (another salt or other tokens under a colliding key)";
    return Verdict::foreign;
  }
  return Verdict::ok;
}

/// Writes a verified entry's K/V into page `page` of `cache` (bit for bit;
/// relaid out for the cache's layout).
template <class Layout>
void load(PagedCache<Layout>& cache, int64_t page, const uint8_t* data) {
  const Geometry g = Geometry::of(cache);
  Header h{};
  std::memcpy(&h, data, sizeof(h));
  // Only read: the sections are views that the copy reads from.
  uint8_t* payload = const_cast<uint8_t*>(data) + sizeof(Header) + static_cast<size_t>(h.n_tokens) * sizeof(int64_t);
  copy_page(cache, page, sections(g, payload), /*to_entry=*/false);
}
template <class Layout>
void load(PagedCache<Layout>& cache, int64_t page, const at::Tensor& entry) {
  load(cache, page, entry.data_ptr<uint8_t>());
}

/// Copies an entry's payload into a page of a CPU cache while checksumming
/// the entry, so that its bytes are read once for both (bench/NOTES.md,
/// "Verifying while copying"): the header and tokens go to prefix() (summed
/// only), then the payload to feed() in order, then finish() compares the
/// sum. The page is written before the sum is known: when finish() says
/// false, the caller gives the page back (a page nobody else can see yet).
/// Entries hold the payload token-major (Sections); the pieces below follow
/// that order, each a run of whole tokens of one layer of one section, at
/// most kPieceBytes (a piece copied head vector by head vector is summed
/// first, then copied from the L1 cache; a contiguous one both at once).
template <class Layout>
class CheckedLoad {
 public:
  static constexpr int64_t kPieceBytes = int64_t{16} << 10;
  static constexpr int64_t kRunPieceBytes = int64_t{64} << 10;  // contiguous in the cache too

  CheckedLoad(PagedCache<Layout>& cache, int64_t page) {
    const int64_t code_bytes = static_cast<int64_t>(cache.k_cache().element_size());
    stream_ = cpu::use_streaming_stores(static_cast<int64_t>(Geometry::of(cache).payload_bytes()),
                                        cpu::page_strides(cache.geometry(), code_bytes), cache.geometry(), code_bytes);
    const auto tensors = ops::page_tensors(cache.storage());  // k, v, k scales, v scales
    for (const size_t i : {size_t{0}, size_t{2}, size_t{1}, size_t{3}}) {  // the entry's order: K, its scales, V, its scales
      const at::Tensor& t = tensors[i].first;
      if (!t.defined()) continue;
      const PageGeometry& pg = tensors[i].second;
      const int64_t es = static_cast<int64_t>(t.element_size());
      const cpu::BlockStrides in_cache = cpu::page_strides(pg, es);
      const int64_t row_bytes = pg.head_dim * es;
      const int64_t token_bytes = pg.n_heads * row_bytes;
      const bool contiguous = (pg.n_heads == 1 || in_cache.head == row_bytes) &&
                              (pg.page_size == 1 || in_cache.token == token_bytes);
      const int64_t per_piece =
          std::max<int64_t>(1, (contiguous ? kRunPieceBytes : kPieceBytes) / std::max<int64_t>(1, token_bytes));
      char* cache_page = static_cast<char*>(t.data_ptr()) + page * t.stride(1) * es;
      for (int64_t layer = 0; layer < t.size(0); ++layer) {
        for (int64_t t0 = 0; t0 < pg.page_size; t0 += per_piece) {
          const int64_t n = std::min(per_piece, pg.page_size - t0);
          pieces_.push_back(Piece{static_cast<size_t>(n * token_bytes),
                                  cache_page + layer * t.stride(0) * es + t0 * in_cache.token, in_cache,
                                  cpu::BlockShape{n, pg.n_heads, pg.head_dim, es}, contiguous});
        }
      }
      const size_t section = static_cast<size_t>(t.size(0) * pg.page_elems * es);
      if (padded(section) != section) pieces_.push_back(Piece{padded(section) - section, nullptr, {}, {}, false});
    }
  }

  /// The entry's header and tokens (already compared with the cache's).
  void prefix(const uint8_t* data, size_t n) noexcept { sum_.update(data, n); }

  /// Copies and sums the whole pieces at the start of the next n bytes of
  /// the payload; returns the bytes used (the rest starts the next piece).
  size_t feed(const uint8_t* data, size_t n) {
    size_t used = 0;
    while (next_ < pieces_.size() && pieces_[next_].bytes <= n - used) {
      if (stream_) {
        copy(pieces_[next_], data + used, std::true_type());
      } else {
        copy(pieces_[next_], data + used, std::false_type());
      }
      used += pieces_[next_].bytes;
      ++next_;
    }
    return used;
  }

  ~CheckedLoad() {
    if (stream_) cpu::streaming_fence();
  }
  CheckedLoad(const CheckedLoad&) = delete;
  CheckedLoad& operator=(const CheckedLoad&) = delete;

  /// Whether the whole payload was fed and the sum of everything fed is
  /// `expected` (the entry's last 8 bytes).
  bool finish(uint64_t expected) noexcept {
    if (stream_) cpu::streaming_fence();
    return next_ == pieces_.size() && sum_.finish() == expected;
  }

 private:
  struct Piece {
    size_t bytes;
    char* dst;  // null: a section's padding, summed only
    cpu::BlockStrides in_cache;
    cpu::BlockShape shape;
    bool contiguous;  // in the cache too: one run
  };

  template <bool kStream>
  void copy(const Piece& p, const uint8_t* data, std::integral_constant<bool, kStream>) {
    if (p.dst == nullptr) {
      sum_.update(data, p.bytes);
    } else if (p.contiguous) {
      sum_.update_copy<kStream>(p.dst, data, p.bytes);
    } else {
      sum_.update(data, p.bytes);  // now in the L1 cache for the copy
      const int64_t es = p.shape.elem_size;
      const cpu::BlockStrides in_entry{p.shape.heads * p.shape.head_dim * es, p.shape.head_dim * es, es};
      cpu::copy_block<kStream>(p.dst, p.in_cache, reinterpret_cast<const char*>(data), in_entry, p.shape);
    }
  }

  Checksum sum_;
  std::vector<Piece> pieces_;
  size_t next_ = 0;
  bool stream_ = false;
};

/// load() of an entry of `size` bytes at `data` whose size, header,
/// geometry and tokens verify_bytes() accepted without its checksum, into
/// page `page` of a CPU cache, checksumming it during the copy
/// (CheckedLoad); false when the checksum does not match: the page then
/// holds some of the entry's bytes and the caller gives it back.
template <class Layout>
bool load_checked(PagedCache<Layout>& cache, int64_t page, const uint8_t* data, size_t size) {
  Header h{};
  std::memcpy(&h, data, sizeof(h));
  const size_t head = sizeof(Header) + static_cast<size_t>(h.n_tokens) * sizeof(int64_t);
  CheckedLoad<Layout> load(cache, page);
  load.prefix(data, head);
  load.feed(data + head, size - sizeof(uint64_t) - head);
  uint64_t sum;
  std::memcpy(&sum, data + size - sizeof(uint64_t), sizeof(sum));
  return load.finish(sum);
}

/// load_checked() of an entry tensor that verify() accepted without its checksum.
template <class Layout>
bool load_checked(PagedCache<Layout>& cache, int64_t page, const at::Tensor& entry) {
  return load_checked(cache, page, entry.data_ptr<uint8_t>(), static_cast<size_t>(entry.numel()));
}

}  // namespace page_store

namespace detail {

/// Warns through c10 (TORCH_WARN), but a store that keeps failing (a full
/// disk, a server that is down) warns the first few times, then once per
/// 1024 failures: an engine must not drown in one repeated message.
class Warner {
 public:
  template <class... Args>
  void operator()(const Args&... parts) {
    const uint64_t n = count_.fetch_add(1);
    if (n < 8 || (n & 1023) == 0) {
      TORCH_WARN(parts..., n >= 8 ? " (repeated warnings of this store are thinned out)" : "");
    }
  }

 private:
  std::atomic<uint64_t> count_{0};
};

/// Entries in least-recently-used order, with their byte sizes.
template <class Value>
class LruIndex {
 public:
  struct Item {
    uint64_t key;
    int64_t bytes;
    Value value;
  };

  Item* find(uint64_t key) {
    const auto it = where_.find(key);
    return it == where_.end() ? nullptr : &*it->second;
  }
  void touch(uint64_t key) {
    const auto it = where_.find(key);
    if (it != where_.end()) items_.splice(items_.end(), items_, it->second);
  }
  /// Inserts or replaces, as the most recently used.
  void put(uint64_t key, int64_t bytes, Value value) {
    erase(key);
    items_.push_back(Item{key, bytes, std::move(value)});
    where_[key] = std::prev(items_.end());
    bytes_ += bytes;
  }
  /// Inserts as the least recently used (entries found on disk, oldest last).
  void put_oldest(uint64_t key, int64_t bytes, Value value) {
    erase(key);
    items_.push_front(Item{key, bytes, std::move(value)});
    where_[key] = items_.begin();
    bytes_ += bytes;
  }
  bool erase(uint64_t key) {
    const auto it = where_.find(key);
    if (it == where_.end()) return false;
    bytes_ -= it->second->bytes;
    items_.erase(it->second);
    where_.erase(it);
    return true;
  }
  Item* oldest() { return items_.empty() ? nullptr : &items_.front(); }
  std::vector<Item> take_all() {
    std::vector<Item> all(std::make_move_iterator(items_.begin()), std::make_move_iterator(items_.end()));
    items_.clear();
    where_.clear();
    bytes_ = 0;
    return all;
  }
  int64_t bytes() const noexcept { return bytes_; }
  int64_t size() const noexcept { return static_cast<int64_t>(where_.size()); }

 private:
  std::list<Item> items_;  // oldest first
  std::unordered_map<uint64_t, typename std::list<Item>::iterator> where_;
  int64_t bytes_ = 0;
};

/// Writes off the caller's path: a slow store's put queues the entry (the
/// tensor itself, no copy) and returns, and one thread writes the queue in
/// order. Until its write is done, a queued entry is served from memory
/// (pending()), so a page evicted a moment ago is found at once. Queued
/// bytes are bounded: past max_pending_bytes a put waits for the writer.
/// A write that fails is warned about by `write` and its key is reported by
/// take_failed(), for the store to forget it.
class WriteBehind {
 public:
  using Write = std::function<bool(uint64_t key, const at::Tensor& entry)>;
  using Remove = std::function<void(uint64_t key)>;

  WriteBehind(Write write, Remove remove, int64_t max_pending_bytes)
      : write_(std::move(write)), remove_(std::move(remove)), max_pending_bytes_(max_pending_bytes),
        thread_([this] { run(); }) {}

  ~WriteBehind() {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_writer_.notify_all();
    thread_.join();  // after the queue is empty: entries put before the end are on disk
  }

  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;

  void put(uint64_t key, const at::Tensor& entry) {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_caller_.wait(lock, [&] { return pending_bytes_ <= max_pending_bytes_; });
    auto it = pending_.find(key);
    if (it != pending_.end()) pending_bytes_ -= it->second.numel();
    pending_[key] = entry;
    pending_bytes_ += entry.numel();
    jobs_.push_back(Job{key, entry});
    wake_writer_.notify_one();
  }

  /// Cancels a queued write of key and queues its removal.
  void remove(uint64_t key) {
    std::unique_lock<std::mutex> lock(mutex_);
    forget(key);
    ++removing_[key];
    jobs_.push_back(Job{key, at::Tensor()});
    wake_writer_.notify_one();
  }

  /// Whether a removal of key is queued (its file, if any, is as good as gone).
  bool removing(uint64_t key) const {
    std::unique_lock<std::mutex> lock(mutex_);
    return removing_.count(key) != 0;
  }

  /// The entry under key while its write is queued; undefined otherwise.
  at::Tensor pending(uint64_t key) const {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto it = pending_.find(key);
    return it == pending_.end() ? at::Tensor() : it->second;
  }

  /// Returns once every job queued before the call has run.
  void flush() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t target = queued_ + jobs_.size();
    wake_caller_.wait(lock, [&] { return done_ >= target; });
  }

  std::vector<uint64_t> take_failed() {
    std::unique_lock<std::mutex> lock(mutex_);
    std::vector<uint64_t> failed;
    failed.swap(failed_);
    return failed;
  }

 private:
  struct Job {
    uint64_t key;
    at::Tensor entry;  // undefined: a removal
  };

  void forget(uint64_t key) {
    const auto it = pending_.find(key);
    if (it == pending_.end()) return;
    pending_bytes_ -= it->second.numel();
    pending_.erase(it);
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_writer_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_, and nothing left to write
      Job job = std::move(jobs_.front());
      jobs_.pop_front();
      ++queued_;
      // A write whose entry was replaced or removed since is skipped: the
      // newer job does what is needed.
      const auto it = pending_.find(job.key);
      const bool current = job.entry.defined() && it != pending_.end() && it->second.is_same(job.entry);
      lock.unlock();
      bool ok = true;
      if (current) {
        ok = write_(job.key, job.entry);
      } else if (!job.entry.defined()) {
        remove_(job.key);
      }
      lock.lock();
      if (!job.entry.defined()) {
        const auto r = removing_.find(job.key);
        if (r != removing_.end() && --r->second == 0) removing_.erase(r);
      }
      if (current) {
        const auto now = pending_.find(job.key);
        if (now != pending_.end() && now->second.is_same(job.entry)) forget(job.key);  // on disk (or failed) now
        if (!ok) failed_.push_back(job.key);
      }
      ++done_;
      wake_caller_.notify_all();
    }
  }

  Write write_;
  Remove remove_;
  int64_t max_pending_bytes_;
  mutable std::mutex mutex_;
  std::condition_variable wake_writer_;
  std::condition_variable wake_caller_;
  std::deque<Job> jobs_;
  std::unordered_map<uint64_t, at::Tensor> pending_;
  std::unordered_map<uint64_t, int> removing_;  // queued removals per key
  std::vector<uint64_t> failed_;
  int64_t pending_bytes_ = 0;
  uint64_t queued_ = 0;  // jobs taken off the queue
  uint64_t done_ = 0;    // jobs finished
  bool stop_ = false;
  std::thread thread_;  // last: starts once everything above is initialised
};

inline bool valid_entry_tensor(const at::Tensor& entry) {
  return entry.defined() && entry.device().type() == at::kCPU && entry.scalar_type() == at::kByte &&
         entry.dim() == 1 && entry.is_contiguous();
}

}  // namespace detail

/// Host memory: entries kept as the tensors the cache made (pinned when the
/// cache is on CUDA), least recently used dropped beyond max_bytes.
class HostStore final : public PageStore {
 public:
  explicit HostStore(int64_t max_bytes) : max_bytes_(max_bytes) {
    checks::positive(checks::Caller{"host_store", nullptr, nullptr}, "max_bytes", max_bytes);
  }

  std::string tier() const override { return "host"; }

  bool put(const PageKey& key, const at::Tensor& entry, std::vector<StoredPage>* pushed_out) override {
    if (!detail::valid_entry_tensor(entry) || entry.numel() > max_bytes_) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    index_.put(key.hash, entry.numel(), entry);
    while (index_.bytes() > max_bytes_) {
      auto* old = index_.oldest();
      if (pushed_out != nullptr) pushed_out->push_back(StoredPage{PageKey{old->key}, old->value});
      index_.erase(old->key);
    }
    return true;
  }

  at::Tensor get(const PageKey& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto* item = index_.find(key.hash);
    if (item == nullptr) return at::Tensor();
    index_.touch(key.hash);
    return item->value;
  }

  void erase(const PageKey& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    index_.erase(key.hash);
  }

  std::vector<StoredPage> drain() override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<StoredPage> all;
    for (auto& item : index_.take_all()) all.push_back(StoredPage{PageKey{item.key}, std::move(item.value)});
    return all;
  }

  int64_t n_entries() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return index_.size();
  }
  int64_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return index_.bytes();
  }
  int64_t max_bytes() const noexcept { return max_bytes_; }
  bool in_process() const override { return true; }

 private:
  int64_t max_bytes_;
  mutable std::mutex mutex_;
  detail::LruIndex<at::Tensor> index_;
};

/// A directory: one file per entry (<key>.pkv), written to a temporary file
/// and renamed into place, so that no reader (this process, another one, a
/// later one) ever sees half an entry. Files are written off the caller's
/// path by one thread of the store (detail::WriteBehind: a put queues
/// the entry and returns; until its file is written, get serves it from
/// memory; flush() waits for the queue; the destructor writes what is
/// queued). Last use is the file's mtime, so the least recently used order
/// survives restarts. Each process keeps the budget over the entries it
/// knows: those it wrote and those it found when it last scanned the
/// directory (at construction and every kRescanPuts writes), least recently
/// used first; a file another process removed is a miss. Not fsynced: after
/// a power loss an entry may be short or empty, which its checksum makes a
/// miss.
class DiskStore final : public PageStore {
 public:
  static constexpr int64_t kRescanPuts = 256;
  static constexpr int64_t kMaxPendingBytes = int64_t{256} << 20;  // queued for writing at most

  DiskStore(const std::string& dir, int64_t max_bytes) : dir_(dir), max_bytes_(max_bytes) {
    const checks::Caller caller{"disk_store", nullptr, nullptr};
    TORCH_CHECK(!dir.empty(), caller, ": argument 'dir' expected a directory path, got an empty string");
    checks::positive(caller, "max_bytes", max_bytes);
    if (::mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, caller, ": argument 'dir' expected a directory that exists or can be created, got '", dir,
                  "' (", std::strerror(errno), ")");
    }
    struct stat st {};
    TORCH_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && ::access(dir.c_str(), R_OK | W_OK | X_OK) == 0,
                caller, ": argument 'dir' expected a directory this process can read and write, got '", dir, "'");
    scan();
    writer_ = std::make_unique<detail::WriteBehind>(
        [this](uint64_t key, const at::Tensor& entry) { return write_entry(key, entry); },
        [this](uint64_t key) { ::unlink(path(key).c_str()); }, kMaxPendingBytes);
  }

  ~DiskStore() override { writer_.reset(); }  // writes what is queued, before the members it uses go

  std::string tier() const override { return "disk"; }

  bool put(const PageKey& key, const at::Tensor& entry, std::vector<StoredPage>* pushed_out) override {
    if (!detail::valid_entry_tensor(entry)) return false;
    if (entry.numel() > max_bytes_) {
      warn_("pagedkv::disk_store('", dir_, "'): an entry of ", entry.numel(), " bytes exceeds the budget of ",
            max_bytes_, " bytes; not stored");
      return false;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    forget_failed();
    writer_->put(key.hash, entry);
    index_.put(key.hash, entry.numel(), 0);
    if (++n_puts_ % kRescanPuts == 0) scan();
    while (index_.bytes() > max_bytes_) {
      const uint64_t old = index_.oldest()->key;
      if (old == key.hash) break;  // cannot happen (the entry fits and is the newest)
      if (pushed_out != nullptr) {
        at::Tensor bytes = writer_->pending(old);  // still queued: no need to read it back
        if (!bytes.defined()) bytes = read_file(path(old));
        if (bytes.defined()) pushed_out->push_back(StoredPage{PageKey{old}, std::move(bytes)});
      }
      writer_->remove(old);
      index_.erase(old);
    }
    return true;
  }

  at::Tensor get(const PageKey& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    forget_failed();
    at::Tensor entry = writer_->pending(key.hash);
    const std::string p = path(key.hash);
    if (!entry.defined()) {
      if (writer_->removing(key.hash)) return entry;  // pushed out or erased: its unlink is queued
      entry = read_file(p);
      if (!entry.defined()) {
        index_.erase(key.hash);
        return entry;
      }
      ::utimensat(AT_FDCWD, p.c_str(), nullptr, 0);  // last use, for later processes' LRU order
    }
    if (index_.find(key.hash) == nullptr) index_.put(key.hash, entry.numel(), 0);
    index_.touch(key.hash);
    return entry;
  }

  /// get(), but the file is read as the cache asks (an EntryReader over
  /// its open descriptor): into a buffer the cache reuses from entry to
  /// entry, not a new tensor per entry. An entry still queued for writing
  /// is given from memory.
  std::unique_ptr<EntryReader> open(const PageKey& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    forget_failed();
    at::Tensor entry = writer_->pending(key.hash);
    if (entry.defined()) {
      if (index_.find(key.hash) == nullptr) index_.put(key.hash, entry.numel(), 0);
      index_.touch(key.hash);
      return std::make_unique<detail::TensorReader>(std::move(entry));
    }
    if (writer_->removing(key.hash)) return nullptr;  // pushed out or erased: its unlink is queued
    const std::string p = path(key.hash);
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno != ENOENT) warn_("pagedkv::disk_store('", dir_, "'): cannot open ", p, " (", std::strerror(errno), ")");
      index_.erase(key.hash);
      return nullptr;
    }
    auto reader = std::make_unique<FileReader>(fd);  // closes it
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      index_.erase(key.hash);
      return nullptr;
    }
    reader->size_ = static_cast<size_t>(st.st_size);
    ::utimensat(AT_FDCWD, p.c_str(), nullptr, 0);  // last use, for later processes' LRU order
    if (index_.find(key.hash) == nullptr) index_.put(key.hash, static_cast<int64_t>(st.st_size), 0);
    index_.touch(key.hash);
    return reader;
  }

  void erase(const PageKey& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    writer_->remove(key.hash);
    index_.erase(key.hash);
  }

  /// Returns once every entry put so far is in its file (or failed, warned).
  void flush() { writer_->flush(); }

  int64_t n_entries() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return index_.size();
  }
  int64_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return index_.bytes();
  }
  const std::string& dir() const noexcept { return dir_; }

 private:
  std::string path(uint64_t key) const { return dir_ + "/" + PageKey{key}.name() + ".pkv"; }

  /// An entry's file, read as the cache asks. A file that shrank under us
  /// reads short: a corrupt entry for the cache.
  struct FileReader final : EntryReader {
    explicit FileReader(int fd) : fd_(fd) {}
    ~FileReader() override { ::close(fd_); }
    FileReader(const FileReader&) = delete;
    FileReader& operator=(const FileReader&) = delete;
    size_t size() const override { return size_; }
    size_t read(uint8_t* dst, size_t n) override {
      size_t done = 0;
      while (done < n) {
        const ssize_t r = ::read(fd_, dst + done, n - done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        done += static_cast<size_t>(r);
      }
      return done;
    }
    int fd_;
    size_t size_ = 0;
  };

  /// The writer thread's job: a temporary file, renamed into place.
  bool write_entry(uint64_t key, const at::Tensor& entry) {
    const std::string final_path = path(key);
    const std::string temp = dir_ + "/.tmp." + std::to_string(::getpid()) + "." + std::to_string(++n_temps_) + "." +
                             PageKey{key}.name();
    if (!write_file(temp, entry.data_ptr<uint8_t>(), static_cast<size_t>(entry.numel())) ||
        ::rename(temp.c_str(), final_path.c_str()) != 0) {
      warn_("pagedkv::disk_store('", dir_, "'): cannot write entry ", PageKey{key}.name(), " (", std::strerror(errno),
            "); not stored");
      ::unlink(temp.c_str());
      return false;
    }
    return true;
  }

  /// Entries whose write failed are not there: the index forgets them.
  void forget_failed() {
    for (const uint64_t key : writer_->take_failed()) index_.erase(key);
  }

  static bool write_file(const std::string& p, const uint8_t* data, size_t n) {
    const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) return false;
    size_t done = 0;
    while (done < n) {
      const ssize_t w = ::write(fd, data + done, n - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const int err = w < 0 ? errno : ENOSPC;
        ::close(fd);
        errno = err;
        return false;
      }
      done += static_cast<size_t>(w);
    }
    return ::close(fd) == 0;
  }

  /// The whole file, or an undefined tensor when it is missing or unreadable.
  at::Tensor read_file(const std::string& p) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno != ENOENT) warn_("pagedkv::disk_store('", dir_, "'): cannot open ", p, " (", std::strerror(errno), ")");
      return at::Tensor();
    }
    struct stat st {};
    at::Tensor entry;
    if (::fstat(fd, &st) == 0) {
      entry = at::empty({static_cast<int64_t>(st.st_size)}, at::TensorOptions().dtype(at::kByte));
      uint8_t* data = entry.data_ptr<uint8_t>();
      size_t done = 0;
      const size_t n = static_cast<size_t>(st.st_size);
      while (done < n) {
        const ssize_t r = ::read(fd, data + done, n - done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        done += static_cast<size_t>(r);
      }
      // A file that shrank under us reads short: what was read is given
      // back, and the checksum decides.
      if (done < n) entry = entry.narrow(0, 0, static_cast<int64_t>(done)).clone();
    }
    ::close(fd);
    return entry;
  }

  /// Learns the entries in the directory (other processes', earlier runs'),
  /// oldest mtime least recently used; removes temporary files a crashed
  /// writer left behind (older than an hour).
  void scan() {
    DIR* d = ::opendir(dir_.c_str());
    if (d == nullptr) {
      warn_("pagedkv::disk_store('", dir_, "'): cannot list the directory (", std::strerror(errno), ")");
      return;
    }
    struct Found {
      int64_t mtime_ns;
      uint64_t key;
      int64_t bytes;
    };
    std::vector<Found> found;
    const int64_t now = static_cast<int64_t>(::time(nullptr));
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      struct stat st {};
      const std::string p = dir_ + "/" + name;
      if (name.rfind(".tmp.", 0) == 0) {
        if (::stat(p.c_str(), &st) == 0 && now - static_cast<int64_t>(st.st_mtime) > 3600) ::unlink(p.c_str());
        continue;
      }
      if (name.size() != 20 || name.compare(16, 4, ".pkv") != 0) continue;
      const std::string hex = name.substr(0, 16);  // outlives `end`, which points into it
      char* end = nullptr;
      const uint64_t key = std::strtoull(hex.c_str(), &end, 16);
      if (end == nullptr || *end != '\0' || ::stat(p.c_str(), &st) != 0) continue;
      found.push_back({static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec, key,
                       static_cast<int64_t>(st.st_size)});
    }
    ::closedir(d);
    std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime_ns > b.mtime_ns; });
    for (const Found& f : found) {
      if (index_.find(f.key) != nullptr) continue;  // known here: keep this process's order
      if (writer_ != nullptr && writer_->removing(f.key)) continue;
      index_.put_oldest(f.key, f.bytes, 0);  // newest first, each before the last: oldest ends first
    }
  }

  std::string dir_;
  int64_t max_bytes_;
  mutable std::mutex mutex_;
  detail::LruIndex<int> index_;
  std::atomic<int64_t> n_temps_{0};
  int64_t n_puts_ = 0;
  detail::Warner warn_;
  std::unique_ptr<detail::WriteBehind> writer_;  // after what its thread uses
};

/// A tier in host memory of at most max_bytes (>= 1) bytes of entries.
inline std::shared_ptr<PageStore> host_store(int64_t max_bytes) { return std::make_shared<HostStore>(max_bytes); }

/// A tier in directory `dir` (created when missing) of at most max_bytes
/// (>= 1) bytes of entries; survives restarts and is shared by processes.
inline std::shared_ptr<PageStore> disk_store(const std::string& dir, int64_t max_bytes) {
  return std::make_shared<DiskStore>(dir, max_bytes);
}

}  // namespace pagedkv
