// Prefix tiers (page_store.hpp and PrefixCache's tiers): the entry format
// (bit-for-bit round trips across layouts and page formats, every corrupt
// byte and every truncation rejected, foreign entries rejected), host and
// disk stores (budget and LRU, restart, two processes at once), and a
// prefix cache over tiers: evicted pages come back bit for bit, a full tier
// moves its oldest entries down, corrupt entries and a tiny disk budget are
// misses with a warning, the pool bounds a match, events against a model of
// every tier, and bad input throws with nothing changed.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pagedkv/page_store.hpp"
#include "pagedkv/prefix_cache.hpp"
#include "pagedkv/torch_compat.hpp"
#include "warnings_capture.hpp"

namespace {

using pagedkv::HND;
using pagedkv::KVFormat;
using pagedkv::KVQuant;
using pagedkv::NHD;
using pagedkv::PagedCache;
using pagedkv::PageKey;
using pagedkv::PageStore;
using pagedkv::PrefixCache;
using pagedkv::PrefixEvent;
using pagedkv::SequenceTable;
using pagedkv::StoredPage;
namespace page_store = pagedkv::page_store;

constexpr int64_t kLayers = 2;
constexpr int64_t kPage = 4;
constexpr int64_t kHeads = 2;
constexpr int64_t kDim = 8;

using pagedkv_test::Warnings;

/// A fresh directory, removed with everything in it at the end of the scope.
struct TempDir {
  std::string path;
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pagedkv-store-XXXXXX").string();
    path = ::mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path)) names.push_back(e.path().filename().string());
    return names;
  }
};

template <class L>
PagedCache<L> make_cache(int64_t n_pages, KVQuant quant = {}, at::ScalarType dtype = at::kFloat,
                         int64_t n_layers = kLayers, at::DeviceType device = at::kCPU) {
  return PagedCache<L>(n_layers, n_pages, kPage, kHeads, kDim, at::TensorOptions().dtype(dtype).device(device), quant);
}

/// A page's codes and scales, token-major, as bytes: what must survive a round trip.
template <class L>
std::vector<uint8_t> page_bytes(const PagedCache<L>& cache, int64_t page) {
  std::vector<uint8_t> out;
  const auto append = [&](const at::Tensor& t) {
    const at::Tensor c = t.to(at::kCPU).contiguous();
    const auto* p = static_cast<const uint8_t*>(c.data_ptr());
    out.insert(out.end(), p, p + c.numel() * static_cast<int64_t>(c.element_size()));
  };
  append(page_store::page_codes<L>(cache.k_cache(), page));
  append(page_store::page_codes<L>(cache.v_cache(), page));
  if (cache.k_scales().defined()) append(page_store::page_scales<L>(cache.k_scales(), page, kPage, kHeads));
  if (cache.v_scales().defined()) append(page_store::page_scales<L>(cache.v_scales(), page, kPage, kHeads));
  return out;
}

at::Tensor ids(const std::vector<int64_t>& tokens) { return at::tensor(tokens, at::kLong); }

/// A request as an engine runs it: acquire, prefill the rest with random
/// K/V, commit, insert. Returns the sequence.
template <class L>
int64_t run_request(SequenceTable<L>& seqs, PrefixCache<L>& prefix, const std::vector<int64_t>& prompt,
                    uint64_t salt = 0) {
  const at::Tensor tokens = ids(prompt);
  const auto [seq, cached] = prefix.acquire(tokens, salt);
  const int64_t n = static_cast<int64_t>(prompt.size()) - cached;
  EXPECT_TRUE(seqs.prepare_append(seq, n));
  auto [table, lengths] = seqs.batch({seq});
  auto& cache = seqs.cache();
  const auto view = cache.bind(table, lengths + n);
  for (int64_t layer = 0; layer < cache.n_layers(); ++layer) {
    const at::Tensor k = (at::randn({1, n, kHeads, kDim}) * 3).to(cache.dtype());
    const at::Tensor v = (at::randn({1, n, kHeads, kDim}) * 3).to(cache.dtype());
    view.write(layer, cached, k, v);
  }
  seqs.commit_append(seq, n);
  prefix.insert(seq, tokens, salt);
  return seq;
}

std::vector<int64_t> prompt_of(int64_t n, int64_t first) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[static_cast<size_t>(i)] = first + i * 7;
  return p;
}

/// An entry for page `page` of `cache` as the prefix cache would write it
/// for a prompt's first page with `tokens` [kPage] and `salt`.
template <class L>
std::pair<PageKey, at::Tensor> entry_for(const PagedCache<L>& cache, int64_t page, const std::vector<int64_t>& tokens,
                                         uint64_t salt = 0) {
  const auto g = page_store::Geometry::of(cache);
  const PageKey key = page_store::next_key(page_store::key_seed(g, salt), tokens.data(), kPage);
  const page_store::Identity id{key, 11, 0, salt, tokens.data(), static_cast<int64_t>(tokens.size())};
  return {key, page_store::encode(cache, page, id)};
}

template <class L>
void fill_page(PagedCache<L>& cache, int64_t page) {
  const at::Tensor table = at::full({1, 1}, page, at::kInt);
  const auto view = cache.bind(table, at::tensor({kPage}, at::kLong));
  for (int64_t layer = 0; layer < cache.n_layers(); ++layer) {
    const std::vector<int64_t> shape = {1, kPage, cache.n_kv_heads(), cache.head_dim()};
    view.write(layer, 0, (at::randn(shape) * 5).to(cache.dtype()), (at::randn(shape) * 5).to(cache.dtype()));
  }
}

const std::vector<KVQuant> kFormats = {KVQuant{},
                                       KVQuant{KVFormat::fp8_e4m3, KVFormat::fp8_e4m3},
                                       KVQuant{KVFormat::int8, KVFormat::int8},
                                       KVQuant{KVFormat::fp8_e4m3, KVFormat::int8}};

/// An entry read as a file is (EntryReader): says it has `claimed` bytes and
/// gives at most the first `available` (a file that shrank under the reader).
class FileLikeReader final : public pagedkv::EntryReader {
 public:
  FileLikeReader(at::Tensor entry, size_t claimed, size_t available)
      : entry_(std::move(entry)), claimed_(claimed), available_(available) {}
  explicit FileLikeReader(const at::Tensor& entry)
      : FileLikeReader(entry, static_cast<size_t>(entry.numel()), static_cast<size_t>(entry.numel())) {}
  size_t size() const override { return claimed_; }
  size_t read(uint8_t* dst, size_t n) override {
    const size_t take = std::min(n, available_ - done_);
    if (take > 0) std::memcpy(dst, entry_.data_ptr<uint8_t>() + done_, take);
    done_ += take;
    return take;
  }

 private:
  at::Tensor entry_;
  size_t claimed_, available_, done_ = 0;
};

/// What PrefixCache does with a reader: the entry read whole, its size,
/// header and tokens (n_tokens) checked, then page_store::load_checked.
/// Verdict ok only when the page got the entry.
template <class L>
page_store::Verdict load_from_reader(PagedCache<L>& cache, int64_t page, pagedkv::EntryReader& reader,
                                     const PageKey& key, const std::vector<int64_t>& tokens) {
  const size_t size = reader.size();
  std::vector<uint8_t> buffer(size);
  if (reader.read(buffer.data(), size) != size) return page_store::Verdict::corrupt;
  std::string why;
  const page_store::Verdict v = page_store::verify_bytes(buffer.data(), size, page_store::Geometry::of(cache), key, 0,
                                                         tokens.data(), static_cast<int64_t>(tokens.size()), &why,
                                                         /*check_sum=*/false);
  if (v != page_store::Verdict::ok) return v;
  return page_store::load_checked(cache, page, buffer.data(), size) ? page_store::Verdict::ok
                                                                   : page_store::Verdict::corrupt;
}

// ---- the entry format ----

template <class From, class To>
void round_trip(const KVQuant& quant, at::ScalarType dtype) {
  SCOPED_TRACE(std::string(From::name) + " -> " + To::name + ", K " + pagedkv::format_name(quant.k) + ", V " +
               pagedkv::format_name(quant.v) + ", " + c10::toString(dtype));
  PagedCache<From> from = make_cache<From>(4, quant, dtype);
  PagedCache<To> to = make_cache<To>(4, quant, dtype);
  from.alloc_n(3);
  to.alloc_n(3);
  fill_page(from, 2);
  const std::vector<int64_t> tokens = {5, 6, 7, 8};
  const auto [key, entry] = entry_for(from, 2, tokens);
  std::string why;
  ASSERT_EQ(page_store::verify(entry, page_store::Geometry::of(to), key, 0, tokens.data(), 4, &why),
            page_store::Verdict::ok)
      << why;
  page_store::load(to, 1, entry);
  EXPECT_EQ(page_bytes(to, 1), page_bytes(from, 2));
  EXPECT_NE(page_bytes(to, 0), page_bytes(from, 2));  // a page it did not load stays as it was (zeros)
  // The loads that checksum during their copy (an entry in memory, one a
  // store reads: a disk tier's) load the same page.
  EXPECT_TRUE(page_store::load_checked(to, 3, entry));
  EXPECT_EQ(page_bytes(to, 3), page_bytes(from, 2));
  to.k_cache().select(1, 3).zero_();
  to.v_cache().select(1, 3).zero_();
  FileLikeReader reader(entry);
  EXPECT_EQ(load_from_reader(to, 3, reader, key, tokens), page_store::Verdict::ok);
  EXPECT_EQ(page_bytes(to, 3), page_bytes(from, 2));
  {  // ATen's copies (what a CUDA cache takes) make the same entry and load the same page as the CPU path
    pagedkv::ScopedBackend generic(pagedkv::Backend::generic);
    EXPECT_TRUE(at::equal(entry_for(from, 2, tokens).second, entry));
    page_store::load(to, 2, entry);
  }
  EXPECT_EQ(page_bytes(to, 2), page_bytes(from, 2));
}

TEST(PageEntry, RoundTripIsBitForBitAcrossLayoutsAndFormats) {
  at::manual_seed(1);
  for (const KVQuant& q : kFormats) {
    const at::ScalarType dtype = pagedkv::is_quantized(q) ? at::kHalf : at::kBFloat16;
    round_trip<NHD, NHD>(q, dtype);
    round_trip<NHD, HND>(q, dtype);
    round_trip<HND, NHD>(q, dtype);
    round_trip<HND, HND>(q, at::kFloat);
  }
}

TEST(PageEntry, EveryCorruptByteAndEveryTruncationIsRejected) {
  at::manual_seed(2);
  // A small geometry keeps the entry short enough to corrupt every byte.
  PagedCache<NHD> cache(1, 2, kPage, 1, 2, at::TensorOptions().dtype(at::kFloat),
                        KVQuant{KVFormat::int8, KVFormat::native});
  cache.alloc_n(1);
  fill_page(cache, 0);
  const std::vector<int64_t> tokens = {1, 2, 3, 4};
  const auto [key, entry] = entry_for(cache, 0, tokens);
  const auto g = page_store::Geometry::of(cache);
  std::string why;
  ASSERT_EQ(page_store::verify(entry, g, key, 0, tokens.data(), 4, &why), page_store::Verdict::ok);
  const int64_t size = entry.numel();
  for (int64_t i = 0; i < size; ++i) {
    for (const uint8_t flip : {uint8_t{0x01}, uint8_t{0x80}, uint8_t{0xff}}) {
      at::Tensor bad = entry.clone();
      bad.data_ptr<uint8_t>()[i] ^= flip;
      EXPECT_NE(page_store::verify(bad, g, key, 0, tokens.data(), 4, &why), page_store::Verdict::ok)
          << "byte " << i << " of " << size << " xor " << int(flip);
      // What passes the checks before a checked load fails during its copy.
      if (page_store::verify(bad, g, key, 0, tokens.data(), 4, &why, /*check_sum=*/false) == page_store::Verdict::ok) {
        EXPECT_FALSE(page_store::load_checked(cache, 1, bad)) << "byte " << i << " of " << size << " xor " << int(flip);
      }
      FileLikeReader reader(bad);
      EXPECT_NE(load_from_reader(cache, 1, reader, key, tokens), page_store::Verdict::ok)
          << "read: byte " << i << " of " << size << " xor " << int(flip);
    }
  }
  for (int64_t n = 0; n < size; ++n) {
    EXPECT_NE(page_store::verify(entry.narrow(0, 0, n).clone(), g, key, 0, tokens.data(), 4, &why),
              page_store::Verdict::ok)
        << "truncated to " << n << " bytes";
    FileLikeReader truncated(entry.narrow(0, 0, n).clone());
    EXPECT_NE(load_from_reader(cache, 1, truncated, key, tokens), page_store::Verdict::ok) << "truncated to " << n;
    // A file that shrinks after its size was read reads short.
    FileLikeReader shrunk(entry, static_cast<size_t>(size), static_cast<size_t>(n));
    EXPECT_NE(load_from_reader(cache, 1, shrunk, key, tokens), page_store::Verdict::ok) << "shrunk to " << n;
  }
  {
    FileLikeReader intact(entry);
    EXPECT_EQ(load_from_reader(cache, 1, intact, key, tokens), page_store::Verdict::ok);
  }
  at::Tensor longer = at::cat({entry, at::zeros({8}, at::kByte)});
  EXPECT_NE(page_store::verify(longer, g, key, 0, tokens.data(), 4, &why), page_store::Verdict::ok);
  EXPECT_NE(page_store::verify(entry.to(at::kChar), g, key, 0, tokens.data(), 4, &why), page_store::Verdict::ok);
}

TEST(PageEntry, ForeignEntriesAreRejected) {
  at::manual_seed(3);
  PagedCache<NHD> cache = make_cache<NHD>(2);
  cache.alloc_n(1);
  fill_page(cache, 0);
  const std::vector<int64_t> tokens = {1, 2, 3, 4};
  const auto [key, entry] = entry_for(cache, 0, tokens, /*salt=*/9);
  std::string why;
  const auto g = page_store::Geometry::of(cache);
  ASSERT_EQ(page_store::verify(entry, g, key, 9, tokens.data(), 4, &why), page_store::Verdict::ok);
  const std::vector<int64_t> other = {1, 2, 3, 5};
  EXPECT_EQ(page_store::verify(entry, g, key, 9, other.data(), 4, &why), page_store::Verdict::foreign);
  EXPECT_EQ(page_store::verify(entry, g, key, 8, tokens.data(), 4, &why), page_store::Verdict::foreign);
  EXPECT_EQ(page_store::verify(entry, g, PageKey{key.hash + 1}, 9, tokens.data(), 4, &why),
            page_store::Verdict::foreign);
  for (int change = 0; change < 6; ++change) {
    page_store::Geometry other_g = g;
    if (change == 0) other_g.n_layers += 1;
    if (change == 1) other_g.page_size += 1;
    if (change == 2) other_g.n_kv_heads += 1;
    if (change == 3) other_g.head_dim += 1;
    if (change == 4) other_g.dtype = at::kHalf;
    if (change == 5) other_g.quant.v = KVFormat::int8;
    EXPECT_EQ(page_store::verify(entry, other_g, key, 9, tokens.data(), 4, &why), page_store::Verdict::foreign)
        << "change " << change;
    // Every property is in the key too: a store shared by another model never even names this entry.
    EXPECT_NE(page_store::key_seed(other_g, 9), page_store::key_seed(g, 9)) << "change " << change;
  }
}

/// Bytes 0..n-1 of a fixed pseudo-random sequence.
std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

TEST(PageEntry, TheChecksumFedInPiecesIsTheChecksumOfTheWhole) {
  std::mt19937 rng(21);
  for (const size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{127}, size_t{128}, size_t{129}, size_t{1000},
                         size_t{5003}, size_t{70000}}) {
    const std::vector<uint8_t> data = random_bytes(n, static_cast<uint32_t>(n));
    const uint64_t whole = page_store::checksum(data.data(), n);
    for (int round = 0; round < 8; ++round) {
      // Pieces of random sizes, some a multiple of 16 (the streaming copy's
      // case), copied to a destination at a random 8-byte offset.
      std::vector<char> out(n + 64, 0);
      const size_t offset = 8 * (rng() % 4);
      page_store::Checksum plain, copying, streaming;
      std::vector<char> streamed(n + 64, 0);
      for (size_t at = 0; at < n;) {
        size_t piece = 1 + rng() % 700;
        if (round % 2 == 0) piece = 16 * (1 + rng() % 40);
        piece = std::min(piece, n - at);
        plain.update(data.data() + at, piece);
        copying.update_copy<false>(out.data() + offset + at, data.data() + at, piece);
        streaming.update_copy<true>(streamed.data() + offset + at, data.data() + at, piece);
        at += piece;
      }
      pagedkv::cpu::streaming_fence();
      SCOPED_TRACE("n " + std::to_string(n) + ", round " + std::to_string(round));
      EXPECT_EQ(plain.finish(), whole);
      EXPECT_EQ(copying.finish(), whole);
      EXPECT_EQ(streaming.finish(), whole);
      if (n > 0) {  // data.data() may be null when empty: memcmp's arguments must not be
        EXPECT_EQ(std::memcmp(out.data() + offset, data.data(), n), 0);
        EXPECT_EQ(std::memcmp(streamed.data() + offset, data.data(), n), 0);
      }
    }
  }
}

TEST(PageEntry, ACheckedLoadOfALargePageStreamsAndIsBitForBit) {
  at::manual_seed(22);
  // 1 MiB of K/V per page, NHD: the copy streams (cpu::use_streaming_stores),
  // the checksum runs in the same pass (Checksum::update_copy).
  PagedCache<NHD> from(16, 2, 16, 8, 128, at::TensorOptions().dtype(at::kBFloat16));
  PagedCache<NHD> to(16, 3, 16, 8, 128, at::TensorOptions().dtype(at::kBFloat16));
  from.k_cache().uniform_(-4, 4);
  from.v_cache().uniform_(-4, 4);
  std::vector<int64_t> tokens(16 * 3);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>(i) * 3 + 1;
  const auto g = page_store::Geometry::of(from);
  const PageKey key{12345};
  // A third page of a prompt: the payload starts off the checksum's 128-byte grid.
  const at::Tensor entry = page_store::encode(from, 1, page_store::Identity{key, 1, 2, 0, tokens.data(), 48});
  std::string why;
  ASSERT_EQ(page_store::verify(entry, g, key, 0, tokens.data(), 48, &why), page_store::Verdict::ok) << why;
  ASSERT_TRUE(page_store::load_checked(to, 2, entry));
  EXPECT_TRUE(at::equal(to.k_cache().select(1, 2), from.k_cache().select(1, 1)));
  EXPECT_TRUE(at::equal(to.v_cache().select(1, 2), from.v_cache().select(1, 1)));
  const size_t payload = sizeof(page_store::Header) + 48 * sizeof(int64_t);
  for (const size_t at_byte : {payload, payload + 1, payload + g.payload_bytes() / 2 + 5, payload + g.payload_bytes() - 1,
                               static_cast<size_t>(entry.numel()) - 1}) {
    at::Tensor bad = entry.clone();
    bad.data_ptr<uint8_t>()[at_byte] ^= 0x10;
    ASSERT_EQ(page_store::verify(bad, g, key, 0, tokens.data(), 48, &why, /*check_sum=*/false),
              page_store::Verdict::ok);
    EXPECT_FALSE(page_store::load_checked(to, 0, bad)) << "byte " << at_byte;
    FileLikeReader reader(bad);
    EXPECT_EQ(load_from_reader(to, 0, reader, key, tokens), page_store::Verdict::corrupt) << "byte " << at_byte;
  }
  // Read from a reader, bit for bit.
  to.k_cache().zero_();
  to.v_cache().zero_();
  FileLikeReader reader(entry);
  ASSERT_EQ(load_from_reader(to, 1, reader, key, tokens), page_store::Verdict::ok);
  EXPECT_TRUE(at::equal(to.k_cache().select(1, 1), from.k_cache().select(1, 1)));
  EXPECT_TRUE(at::equal(to.v_cache().select(1, 1), from.v_cache().select(1, 1)));
}

// ---- stores ----

/// n bytes of `fill` (memset, not an ATen kernel: forked children must not enter OpenMP).
at::Tensor bytes_of(int64_t n, uint8_t fill) {
  at::Tensor t = at::empty({n}, at::TensorOptions().dtype(at::kByte));
  std::memset(t.data_ptr<uint8_t>(), fill, static_cast<size_t>(n));
  return t;
}

TEST(HostStore, KeepsTheBudgetLeastRecentlyUsedFirst) {
  auto store = std::make_shared<pagedkv::HostStore>(300);
  std::vector<StoredPage> out;
  EXPECT_TRUE(store->put(PageKey{1}, bytes_of(100, 1), &out));
  EXPECT_TRUE(store->put(PageKey{2}, bytes_of(100, 2), &out));
  EXPECT_TRUE(store->put(PageKey{3}, bytes_of(100, 3), &out));
  EXPECT_TRUE(out.empty());
  EXPECT_TRUE(store->get(PageKey{1}).defined());  // 1 is now the most recent: 2 goes first
  EXPECT_TRUE(store->put(PageKey{4}, bytes_of(100, 4), &out));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].key.hash, 2u);
  EXPECT_EQ(out[0].entry.data_ptr<uint8_t>()[0], 2);
  EXPECT_FALSE(store->get(PageKey{2}).defined());
  EXPECT_EQ(store->bytes(), 300);
  EXPECT_EQ(store->n_entries(), 3);
  EXPECT_FALSE(store->put(PageKey{5}, bytes_of(301, 5), &out));  // larger than the budget
  EXPECT_EQ(store->n_entries(), 3);
  EXPECT_TRUE(store->put(PageKey{3}, bytes_of(50, 9), &out));  // a replacement
  EXPECT_EQ(store->get(PageKey{3}).numel(), 50);
  EXPECT_EQ(store->bytes(), 250);
  const std::vector<StoredPage> all = store->drain();
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].key.hash, 1u);  // least recently used first
  EXPECT_EQ(all[2].key.hash, 3u);
  EXPECT_EQ(store->n_entries(), 0);
}

TEST(DiskStore, KeepsTheBudgetAndSurvivesARestart) {
  TempDir dir;
  {
    pagedkv::DiskStore store(dir.path, 300);
    std::vector<StoredPage> out;
    for (uint64_t k = 1; k <= 3; ++k) {
      EXPECT_TRUE(store.put(PageKey{k}, bytes_of(100, static_cast<uint8_t>(k)), &out));
      store.flush();  // written now (puts return before their file is written)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // distinct mtimes
    }
    EXPECT_TRUE(store.get(PageKey{1}).defined());  // 2 is now the least recently used
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_TRUE(store.put(PageKey{4}, bytes_of(100, 4), &out));
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].key.hash, 2u);
    EXPECT_EQ(out[0].entry.numel(), 100);
    EXPECT_EQ(store.n_entries(), 3);
    store.flush();
    EXPECT_EQ(dir.entries().size(), 3u);  // no temporary file left behind
  }
  // A new store (a restarted process) finds the entries and their order.
  pagedkv::DiskStore again(dir.path, 300);
  EXPECT_EQ(again.n_entries(), 3);
  EXPECT_EQ(again.bytes(), 300);
  const at::Tensor e4 = again.get(PageKey{4});
  ASSERT_TRUE(e4.defined());
  EXPECT_TRUE(at::equal(e4, bytes_of(100, 4)));
  std::vector<StoredPage> out;
  EXPECT_TRUE(again.put(PageKey{5}, bytes_of(100, 5), &out));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].key.hash, 3u);  // 3 was the oldest on disk (1 was read after it, 4 just now)
  EXPECT_FALSE(again.get(PageKey{3}).defined());
  again.erase(PageKey{1});
  EXPECT_FALSE(again.get(PageKey{1}).defined());
  again.flush();
  EXPECT_EQ(dir.entries().size(), 2u);
}

TEST(DiskStore, WritesOffTheCallersPathAndLosesNothingAtTheEnd) {
  TempDir dir;
  constexpr int kEntries = 40;
  {
    pagedkv::DiskStore store(dir.path, int64_t{1} << 30);
    for (int k = 0; k < kEntries; ++k) {
      const at::Tensor entry = bytes_of(64 * 1024, static_cast<uint8_t>(k));
      ASSERT_TRUE(store.put(PageKey{static_cast<uint64_t>(k)}, entry, nullptr));
      // Found at once, whether its file is written yet or not.
      const at::Tensor got = store.get(PageKey{static_cast<uint64_t>(k)});
      ASSERT_TRUE(got.defined() && at::equal(got, entry)) << k;
    }
    store.erase(PageKey{0});  // queued behind its own write: the file ends up gone
    EXPECT_FALSE(store.get(PageKey{0}).defined());
  }  // the destructor writes what is still queued
  pagedkv::DiskStore again(dir.path, int64_t{1} << 30);
  EXPECT_EQ(again.n_entries(), kEntries - 1);
  EXPECT_EQ(static_cast<int>(dir.entries().size()), kEntries - 1);  // no temporary file left
  EXPECT_FALSE(again.get(PageKey{0}).defined());
  EXPECT_TRUE(at::equal(again.get(PageKey{kEntries - 1}), bytes_of(64 * 1024, kEntries - 1)));
}

TEST(DiskStore, TwoProcessesWriteAndReadAtOnce) {
  TempDir dir;
  constexpr int kKeys = 24;
  constexpr int64_t kBytes = 256 * 1024;  // several writes per entry: a torn read would mix two writers
  std::vector<pid_t> children;
  for (int writer = 0; writer < 2; ++writer) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int bad = 0;
      {
        pagedkv::DiskStore store(dir.path, int64_t{1} << 40);
        for (int round = 0; round < 3; ++round) {
          for (int k = 0; k < kKeys; ++k) {
            const uint8_t fill = static_cast<uint8_t>(1 + writer * 100 + k);
            if (!store.put(PageKey{static_cast<uint64_t>(k)}, bytes_of(kBytes, fill), nullptr)) ++bad;
            const at::Tensor e = store.get(PageKey{static_cast<uint64_t>((k * 7) % kKeys)});
            if (!e.defined()) continue;  // not written yet by either
            const uint8_t* p = e.data_ptr<uint8_t>();
            const uint8_t first = p[0];
            const int key = (k * 7) % kKeys;
            if (e.numel() != kBytes || (first != 1 + key && first != 101 + key)) ++bad;
            for (int64_t i = 0; i < e.numel(); ++i) bad += p[i] != first;
          }
        }
      }
      ::_exit(bad == 0 ? 0 : 1);
    }
    children.push_back(pid);
  }
  for (const pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "a writer saw a torn or foreign entry";
  }
  pagedkv::DiskStore store(dir.path, int64_t{1} << 40);
  EXPECT_EQ(store.n_entries(), kKeys);
  EXPECT_EQ(static_cast<int>(dir.entries().size()), kKeys);  // every temporary file renamed
}

TEST(Stores, BadArgumentsThrow) {
  TempDir dir;
  const auto threw = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what()).find(part) != std::string::npos;
    }
    return false;
  };
  EXPECT_TRUE(threw([] { pagedkv::host_store(0); }, "host_store: argument 'max_bytes' expected >= 1, got 0"));
  EXPECT_TRUE(threw([&] { pagedkv::disk_store(dir.path, -1); }, "disk_store: argument 'max_bytes' expected >= 1"));
  EXPECT_TRUE(threw([] { pagedkv::disk_store("", 100); }, "argument 'dir' expected a directory path"));
  const std::string file = dir.path + "/plain";
  std::ofstream(file) << "x";
  EXPECT_TRUE(threw([&] { pagedkv::disk_store(file, 100); }, "argument 'dir' expected a directory"));
  EXPECT_TRUE(threw([&] { pagedkv::disk_store(file + "/sub", 100); }, "argument 'dir' expected a directory"));
}

// ---- a prefix cache over tiers ----

/// Evicts every page of a 3-page prompt into `tiers`, then acquires it in
/// `to`'s cache: every page comes back from a tier, bit for bit.
template <class From, class To>
void evicted_pages_come_back(const KVQuant& quant, bool on_disk) {
  SCOPED_TRACE(std::string(From::name) + " -> " + To::name + ", K " + pagedkv::format_name(quant.k) + ", V " +
               pagedkv::format_name(quant.v) + (on_disk ? ", disk" : ", host"));
  TempDir dir;
  const std::shared_ptr<PageStore> store = on_disk ? pagedkv::disk_store(dir.path, 1 << 20) : pagedkv::host_store(1 << 20);
  const std::vector<int64_t> prompt = prompt_of(3 * kPage + 2, 3);
  std::vector<std::vector<uint8_t>> written;
  {
    PagedCache<From> cache = make_cache<From>(8, quant, at::kHalf);
    SequenceTable<From> seqs(cache);
    PrefixCache<From> prefix(seqs, {store});
    const int64_t seq = run_request(seqs, prefix, prompt);
    for (int64_t j = 0; j < 3; ++j) written.push_back(page_bytes(cache, seqs.pages(seq)[static_cast<size_t>(j)]));
    seqs.release(seq);
    prefix.clear();
    EXPECT_EQ(prefix.n_cached(), 0);
    EXPECT_EQ(prefix.stats().tiers.at(0).stored_pages, 3);
    prefix.check();
  }
  PagedCache<To> cache = make_cache<To>(8, quant, at::kHalf);
  SequenceTable<To> seqs(cache);
  ASSERT_TRUE(seqs.reserve(seqs.create(), 2 * kPage));  // other pages than the first cache's
  PrefixCache<To> prefix(seqs, {store});
  const auto [seq, matched] = prefix.acquire(ids(prompt));
  EXPECT_EQ(matched, 3 * kPage);
  ASSERT_EQ(seqs.pages(seq).size(), 3u);
  for (int64_t j = 0; j < 3; ++j) {
    EXPECT_EQ(page_bytes(cache, seqs.pages(seq)[static_cast<size_t>(j)]), written[static_cast<size_t>(j)])
        << "page " << j;
  }
  const auto stats = prefix.stats();
  EXPECT_EQ(stats.hit_tokens, 3 * kPage);
  EXPECT_EQ(stats.tiers.at(0).hit_tokens, 3 * kPage);
  EXPECT_EQ(stats.tiers.at(0).loaded_pages, 3);
  EXPECT_EQ(stats.tiers.at(0).tier, on_disk ? "disk" : "host");
  EXPECT_EQ(prefix.n_cached(), 3);  // loaded pages are cached on the device again
  EXPECT_EQ(cache.ref_count(seqs.pages(seq)[0]), 2);
  EXPECT_EQ(prefix.peek(ids(prompt)), 3 * kPage);
  // The sequence goes on from the loaded pages as from computed ones.
  EXPECT_TRUE(seqs.prepare_append(seq, 2));
  seqs.commit_append(seq, 2);
  prefix.check();
}

TEST(PrefixTiers, EvictedPagesComeBackBitForBit) {
  at::manual_seed(4);
  for (const KVQuant& q : kFormats) {
    evicted_pages_come_back<NHD, NHD>(q, false);
    evicted_pages_come_back<HND, NHD>(q, true);
    evicted_pages_come_back<NHD, HND>(q, false);
  }
}

/// A CUDA cache (skipped without a GPU): entries in pinned host memory,
/// loaded back bit for bit, into a CUDA cache and into a CPU one.
TEST(PrefixTiers, ACudaCachesPagesComeBackBitForBit) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(14);
  for (const KVQuant& quant : kFormats) {
    auto host = pagedkv::host_store(1 << 20);
    const std::vector<int64_t> prompt = prompt_of(3 * kPage + 1, 8);
    std::vector<std::vector<uint8_t>> written;
    {
      PagedCache<HND> cache = make_cache<HND>(8, quant, at::kHalf, kLayers, at::kCUDA);
      SequenceTable<HND> seqs(cache);
      PrefixCache<HND> prefix(seqs, {host});
      const int64_t seq = run_request(seqs, prefix, prompt);
      for (int64_t j = 0; j < 3; ++j) written.push_back(page_bytes(cache, seqs.pages(seq)[static_cast<size_t>(j)]));
      seqs.release(seq);
      prefix.clear();
      const std::vector<StoredPage> entries = host->drain();
      ASSERT_EQ(entries.size(), 3u);
      EXPECT_TRUE(entries[0].entry.is_pinned()) << "host memory's entries of a CUDA cache are pinned";
      for (const StoredPage& e : entries) host->put(e.key, e.entry, nullptr);
    }
    for (const at::DeviceType device : {at::kCUDA, at::kCPU}) {
      PagedCache<NHD> cache = make_cache<NHD>(8, quant, at::kHalf, kLayers, device);
      SequenceTable<NHD> seqs(cache);
      PrefixCache<NHD> prefix(seqs, {host});
      const auto [seq, n] = prefix.acquire(ids(prompt));
      EXPECT_EQ(n, 3 * kPage);
      for (int64_t j = 0; j < 3 && j * kPage < n; ++j) {
        EXPECT_EQ(page_bytes(cache, seqs.pages(seq)[static_cast<size_t>(j)]), written[static_cast<size_t>(j)])
            << "page " << j << " on " << device;
      }
      seqs.release(seq);
    }
  }
}

TEST(PrefixTiers, AFullTierMovesItsOldestDownAndTheLastDrops) {
  at::manual_seed(5);
  TempDir dir;
  PagedCache<NHD> cache = make_cache<NHD>(16);
  const int64_t entry_bytes =
      static_cast<int64_t>(page_store::Geometry::of(cache).entry_bytes(kPage));  // a first page's entry
  // Room for 2 first pages in host memory, about 3 on disk.
  auto host = std::make_shared<pagedkv::HostStore>(2 * entry_bytes);
  auto disk = std::make_shared<pagedkv::DiskStore>(dir.path, 3 * entry_bytes + 8);
  SequenceTable<NHD> seqs(cache);
  PrefixCache<NHD> prefix(seqs, {host, disk});
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(prompt_of(kPage + 1, 1000 * (i + 1)));  // one full page each
    seqs.release(run_request(seqs, prefix, prompts.back()));
    prefix.evict(1);  // the oldest (just this one): host, then pushed down as more come
  }
  EXPECT_EQ(host->n_entries(), 2);
  EXPECT_EQ(disk->n_entries(), 3);
  const auto st = prefix.stats();
  EXPECT_EQ(st.tiers[0].stored_pages, 6);
  EXPECT_EQ(st.tiers[1].stored_pages, 4);  // pushed out of host memory: prompts 0..3; 0 dropped from disk
  const auto matched = [&](int i) {
    const auto [seq, n] = prefix.acquire(ids(prompts[static_cast<size_t>(i)]));
    seqs.release(seq);
    return n;
  };
  EXPECT_EQ(matched(0), 0);      // dropped by the last tier
  EXPECT_EQ(matched(1), kPage);  // from disk
  EXPECT_EQ(matched(5), kPage);  // from host memory
  EXPECT_EQ(prefix.stats().tiers[1].loaded_pages, 1);
  EXPECT_EQ(prefix.stats().tiers[0].loaded_pages, 1);
  prefix.check();
}

TEST(PrefixTiers, CorruptOrForeignDiskEntriesAreMissesWithAWarning) {
  at::manual_seed(6);
  TempDir dir;
  const std::vector<int64_t> prompt = prompt_of(2 * kPage + 1, 50);
  const std::vector<int64_t> other = prompt_of(2 * kPage + 1, 60);
  {
    PagedCache<NHD> cache = make_cache<NHD>(8);
    SequenceTable<NHD> seqs(cache);
    PrefixCache<NHD> prefix(seqs, {pagedkv::disk_store(dir.path, 1 << 20)});
    seqs.release(run_request(seqs, prefix, prompt));
    seqs.release(run_request(seqs, prefix, other));
    prefix.clear();
  }
  ASSERT_EQ(dir.entries().size(), 4u);
  std::vector<std::string> files;
  for (const auto& name : dir.entries()) files.push_back(dir.path + "/" + name);
  // Three kinds of damage, one per file; the fourth file stays intact.
  std::filesystem::resize_file(files[0], std::filesystem::file_size(files[0]) - 1);  // truncated
  {
    std::fstream f(files[1], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);  // inside the payload
    f.put('\x5a');
  }
  std::filesystem::copy_file(files[3], files[2], std::filesystem::copy_options::overwrite_existing);  // foreign
  PagedCache<NHD> cache = make_cache<NHD>(8);
  SequenceTable<NHD> seqs(cache);
  auto disk = std::make_shared<pagedkv::DiskStore>(dir.path, 1 << 20);
  PrefixCache<NHD> prefix(seqs, {disk});
  Warnings warnings;
  int64_t total = 0;
  for (const auto* p : {&prompt, &other}) {
    const auto [seq, n] = prefix.acquire(ids(*p));
    total += n;
    seqs.release(seq);
  }
  // At most the intact page, if it is a first page, can hit.
  EXPECT_LE(total, kPage);
  EXPECT_TRUE(warnings.any("is not used")) << "no warning";
  EXPECT_TRUE(warnings.any("corrupt")) << "no warning names the damage";
  EXPECT_GE(warnings.messages.size(), 2u);
  // The damaged entries the lookups met are gone; no damaged file is read twice.
  disk->flush();
  std::set<std::string> left;
  for (const auto& name : dir.entries()) left.insert(dir.path + "/" + name);
  EXPECT_FALSE(left.count(files[0]) && left.count(files[1]) && left.count(files[2]));
  const size_t warned = warnings.messages.size();
  for (const auto* p : {&prompt, &other}) seqs.release(prefix.acquire(ids(*p)).first);
  EXPECT_EQ(warnings.messages.size(), warned);
  prefix.check();
}

/// Changes a byte near the end of the payload of the disk entry of
/// prompt's second page (a cache of geometry g, salt 0), so that only its
/// checksum tells; returns the entry's path.
std::string damage_second_page_payload(const TempDir& dir, const page_store::Geometry& g,
                                       const std::vector<int64_t>& prompt) {
  const PageKey key0 = page_store::next_key(page_store::key_seed(g, 0), prompt.data(), kPage);
  const PageKey key1 = page_store::next_key(key0.hash, prompt.data() + kPage, kPage);
  const std::string path = dir.path + "/" + key1.name() + ".pkv";
  const auto size = static_cast<int64_t>(std::filesystem::file_size(path));
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(size - 8 - 5);  // the payload's last bytes, before the 8-byte checksum
  f.put('\x5a');
  return path;
}

/// A disk entry whose payload is damaged passes the checks of its header
/// and tokens, and fails its checksum during the copy into a newly allocated
/// page (page_store::CheckedLoad): the page goes back, and the pool, the
/// pages the device caches and the acquiring sequence are as if the entry
/// had never been there (a miss at that page, a warning, the entry removed).
TEST(PrefixTiers, ADamagedPayloadFoundDuringTheCopyChangesNothing) {
  at::manual_seed(16);
  TempDir dir;
  const std::vector<int64_t> prompt = prompt_of(3 * kPage + 1, 40);
  const std::vector<int64_t> kept = prompt_of(2 * kPage + 1, 400);
  std::vector<uint8_t> first_page;
  {
    PagedCache<NHD> cache = make_cache<NHD>(8);
    SequenceTable<NHD> seqs(cache);
    PrefixCache<NHD> prefix(seqs, {pagedkv::disk_store(dir.path, 1 << 20)});
    const int64_t seq = run_request(seqs, prefix, prompt);
    first_page = page_bytes(cache, seqs.pages(seq)[0]);
    seqs.release(seq);
    prefix.clear();
  }
  ASSERT_EQ(dir.entries().size(), 3u);
  PagedCache<NHD> cache = make_cache<NHD>(8);
  const uint64_t h0 = pagedkv::prefix_hash::page(pagedkv::prefix_hash::salt_seed(0), prompt.data(), kPage);
  const uint64_t h1 = pagedkv::prefix_hash::page(h0, prompt.data() + kPage, kPage);
  const std::string damaged = damage_second_page_payload(dir, page_store::Geometry::of(cache), prompt);
  SequenceTable<NHD> seqs(cache);
  auto disk = std::make_shared<pagedkv::DiskStore>(dir.path, 1 << 20);
  PrefixCache<NHD> prefix(seqs, {disk});
  const int64_t held = run_request(seqs, prefix, kept);  // pages the device caches, in use
  const std::vector<int64_t> held_pages = seqs.pages(held);
  std::vector<std::vector<uint8_t>> held_bytes;
  for (const int64_t page : held_pages) held_bytes.push_back(page_bytes(cache, page));
  const int64_t free_before = cache.n_free();
  const int64_t cached_before = prefix.n_cached();
  std::vector<std::pair<PrefixEvent::Type, uint64_t>> events;
  std::vector<std::string> event_tiers;
  prefix.set_event_listener([&](const PrefixEvent& e) {
    events.emplace_back(e.type, e.hash);
    event_tiers.push_back(e.tier);
  });
  Warnings warnings;
  const auto [seq, n] = prefix.acquire(ids(prompt));
  EXPECT_EQ(n, kPage);  // the first page; the second is damaged
  EXPECT_EQ(cache.n_free(), free_before - 1);
  EXPECT_EQ(prefix.n_cached(), cached_before + 1);
  EXPECT_EQ(page_bytes(cache, seqs.pages(seq)[0]), first_page);
  EXPECT_EQ(seqs.length(seq), kPage);
  EXPECT_EQ(seqs.pages(held), held_pages);
  for (size_t i = 0; i < held_pages.size(); ++i) EXPECT_EQ(page_bytes(cache, held_pages[i]), held_bytes[i]);
  EXPECT_TRUE(warnings.any("checksum")) << "no warning names the damage";
  EXPECT_EQ(warnings.messages.size(), 1u);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0], std::make_pair(PrefixEvent::Type::stored, h0));
  EXPECT_EQ(event_tiers[0], "device");
  EXPECT_EQ(events[1], std::make_pair(PrefixEvent::Type::removed, h1));
  EXPECT_EQ(event_tiers[1], "disk");
  EXPECT_EQ(prefix.stats().tiers[0].loaded_pages, 1);
  disk->flush();
  EXPECT_FALSE(std::filesystem::exists(damaged));
  EXPECT_EQ(dir.entries().size(), 2u);  // the first page's entry and the third's, not reached
  // The sequence goes on from its one page as from a computed one.
  EXPECT_TRUE(seqs.prepare_append(seq, 2 * kPage + 1));
  seqs.commit_append(seq, 2 * kPage + 1);
  seqs.release(seq);
  seqs.release(held);
  prefix.check();
}

/// With no free page, a load must evict a cached page to make room: the
/// checksum then comes before the allocation (a pass of its own), so that a
/// damaged entry costs no cached page.
TEST(PrefixTiers, ADamagedEntryEvictsNothingWhenThePoolIsFull) {
  at::manual_seed(17);
  TempDir dir;
  const std::vector<int64_t> prompt = prompt_of(2 * kPage + 1, 41);
  const std::vector<int64_t> cached = prompt_of(2 * kPage + 1, 410);
  {
    PagedCache<NHD> cache = make_cache<NHD>(8);
    SequenceTable<NHD> seqs(cache);
    PrefixCache<NHD> prefix(seqs, {pagedkv::disk_store(dir.path, 1 << 20)});
    seqs.release(run_request(seqs, prefix, prompt));
    prefix.clear();
  }
  ASSERT_EQ(dir.entries().size(), 2u);
  PagedCache<NHD> cache = make_cache<NHD>(4);
  damage_second_page_payload(dir, page_store::Geometry::of(cache), prompt);
  SequenceTable<NHD> seqs(cache);
  auto disk = std::make_shared<pagedkv::DiskStore>(dir.path, 1 << 20);
  PrefixCache<NHD> prefix(seqs, {disk});
  seqs.release(run_request(seqs, prefix, cached));  // 2 cached pages, evictable
  const int64_t other = seqs.create();
  ASSERT_TRUE(seqs.reserve(other, 2 * kPage));  // the other 2 pages: none free
  ASSERT_EQ(cache.n_free(), 0);
  ASSERT_EQ(prefix.n_cached(), 2);
  Warnings warnings;
  const auto [seq, n] = prefix.acquire(ids(prompt));
  EXPECT_EQ(n, kPage);  // the first page, for which one cached page was evicted
  EXPECT_EQ(prefix.n_cached(), 2);  // the loaded page and the cached page the damaged entry did not cost
  EXPECT_EQ(cache.n_free(), 0);
  EXPECT_TRUE(warnings.any("checksum")) << "no warning names the damage";
  seqs.release(seq);
  seqs.release(other);
  prefix.check();
}

TEST(PrefixTiers, ATinyDiskBudgetIsAMissWithAWarningAndKeepsTheDevice) {
  at::manual_seed(7);
  TempDir dir;
  PagedCache<NHD> cache = make_cache<NHD>(8);
  SequenceTable<NHD> seqs(cache);
  PrefixCache<NHD> prefix(seqs, {pagedkv::disk_store(dir.path, 64)});  // smaller than any entry
  Warnings warnings;
  const std::vector<int64_t> prompt = prompt_of(2 * kPage + 1, 9);
  const std::vector<int64_t> kept = prompt_of(2 * kPage + 1, 90);
  const int64_t held = run_request(seqs, prefix, kept);
  seqs.release(run_request(seqs, prefix, prompt));
  EXPECT_EQ(prefix.evict(100), 2);  // the released prompt's pages; the held ones stay
  EXPECT_TRUE(warnings.any("exceeds the budget"));
  EXPECT_TRUE(dir.entries().empty());
  EXPECT_EQ(prefix.stats().tiers[0].stored_pages, 0);
  const auto [seq, n] = prefix.acquire(ids(prompt));
  EXPECT_EQ(n, 0);
  seqs.release(seq);
  EXPECT_EQ(prefix.peek(ids(kept)), 2 * kPage);
  seqs.release(held);
  prefix.check();
}

TEST(PrefixTiers, TheMatchStopsWhereThePoolRunsOut) {
  at::manual_seed(8);
  auto host = pagedkv::host_store(1 << 20);
  const std::vector<int64_t> prompt = prompt_of(5 * kPage + 1, 4);
  std::vector<std::vector<uint8_t>> written;
  {
    PagedCache<NHD> cache = make_cache<NHD>(8);
    SequenceTable<NHD> seqs(cache);
    PrefixCache<NHD> prefix(seqs, {host});
    const int64_t seq = run_request(seqs, prefix, prompt);
    for (int64_t j = 0; j < 5; ++j) written.push_back(page_bytes(cache, seqs.pages(seq)[static_cast<size_t>(j)]));
    seqs.release(seq);
    prefix.clear();
  }
  PagedCache<NHD> cache = make_cache<NHD>(6);
  SequenceTable<NHD> seqs(cache);
  PrefixCache<NHD> prefix(seqs, {host});
  const int64_t other = seqs.create();
  ASSERT_TRUE(seqs.reserve(other, 3 * kPage));  // 3 of 6 pages held
  const auto [seq, n] = prefix.acquire(ids(prompt));
  EXPECT_EQ(n, 3 * kPage);  // the pool had room for 3 of the 5 stored pages
  EXPECT_EQ(cache.n_free(), 0);
  for (int64_t j = 0; j < 3; ++j) {
    EXPECT_EQ(page_bytes(cache, seqs.pages(seq)[static_cast<size_t>(j)]), written[static_cast<size_t>(j)]);
  }
  seqs.release(seq);
  seqs.release(other);
  prefix.check();
}

TEST(PrefixTiers, ARestartedEngineHitsWhatTheFirstStoredOnDisk) {
  at::manual_seed(9);
  TempDir dir;
  const std::vector<int64_t> prompt = prompt_of(4 * kPage + 3, 77);
  std::vector<std::vector<uint8_t>> written;
  {
    PagedCache<HND> cache = make_cache<HND>(8, KVQuant{KVFormat::fp8_e4m3, KVFormat::fp8_e4m3}, at::kBFloat16);
    SequenceTable<HND> seqs(cache);
    PrefixCache<HND> prefix(seqs, {pagedkv::host_store(1 << 20), pagedkv::disk_store(dir.path, 1 << 20)});
    const int64_t seq = run_request(seqs, prefix, prompt, /*salt=*/5);
    for (int64_t j = 0; j < 4; ++j) written.push_back(page_bytes(cache, seqs.pages(seq)[static_cast<size_t>(j)]));
    seqs.release(seq);
    prefix.clear();
    EXPECT_EQ(prefix.stats().tiers[0].stored_pages, 4);
    EXPECT_EQ(prefix.stats().tiers[1].stored_pages, 0);
    EXPECT_EQ(prefix.persist(), 4);  // before it exits: host memory's entries go down to the disk
    EXPECT_EQ(prefix.stats().tiers[1].stored_pages, 4);
  }
  PagedCache<NHD> cache = make_cache<NHD>(8, KVQuant{KVFormat::fp8_e4m3, KVFormat::fp8_e4m3}, at::kBFloat16);
  SequenceTable<NHD> seqs(cache);
  PrefixCache<NHD> prefix(seqs, {pagedkv::host_store(1 << 20), pagedkv::disk_store(dir.path, 1 << 20)});
  EXPECT_EQ(prefix.acquire(ids(prompt), /*salt=*/4).second, 0);  // another salt never shares
  const auto [seq, n] = prefix.acquire(ids(prompt), /*salt=*/5);
  EXPECT_EQ(n, 4 * kPage);
  EXPECT_EQ(prefix.stats().tiers[1].loaded_pages, 4);
  for (int64_t j = 0; j < 4; ++j) {
    EXPECT_EQ(page_bytes(cache, seqs.pages(seq)[static_cast<size_t>(j)]), written[static_cast<size_t>(j)]);
  }
  prefix.check();
}

/// Random traffic (requests with shared prefixes, releases, evictions,
/// clear, persist, and restarts: a new engine, host memory and disk store
/// over the same directory) against a model of what every tier holds, built
/// from the events alone: each acquire must match exactly the pages the
/// model says some tier holds, and the model's counts must equal the
/// device's and the stores'.
TEST(PrefixTiers, EventsFollowAModelOfEveryTierAcrossRestarts) {
  at::manual_seed(10);
  TempDir dir;
  const int64_t entry_bytes =
      static_cast<int64_t>(page_store::Geometry::of(make_cache<NHD>(1)).entry_bytes(3 * kPage));
  std::map<std::string, std::set<uint64_t>> model;  // tier -> chained hashes it holds
  std::map<uint64_t, uint64_t> parent_of;
  int64_t n_events = 0;
  std::string failure;
  const auto listener = [&](const PrefixEvent& e) {
    ++n_events;
    std::set<uint64_t>& held = model[e.tier];
    if (e.type == PrefixEvent::Type::cleared) {
      if (!held.empty()) failure += "cleared " + e.tier + " while the model holds pages; ";
      held.clear();
      return;
    }
    if (e.n_tokens <= 0 || e.n_tokens % kPage != 0) failure += "bad n_tokens; ";
    if (e.n_tokens == kPage && e.parent_hash != 0) failure += "a first page with a parent; ";
    if (parent_of.count(e.hash) && parent_of[e.hash] != e.parent_hash) failure += "a page changed parents; ";
    parent_of[e.hash] = e.parent_hash;
    if (e.type == PrefixEvent::Type::stored) {
      // The device announces a page once; a tier may take an entry again (a replacement).
      if (e.tier == "device" && held.count(e.hash)) failure += "device stored twice; ";
      held.insert(e.hash);
    } else if (held.erase(e.hash) != 1) {
      failure += "removed from " + e.tier + " what it did not hold; ";
    }
  };
  /// One engine: its cache, table, prefix cache and tiers.
  struct Engine {
    PagedCache<NHD> cache = make_cache<NHD>(64);
    SequenceTable<NHD> seqs{cache};
    std::shared_ptr<pagedkv::HostStore> host;
    std::shared_ptr<pagedkv::DiskStore> disk;
    PrefixCache<NHD> prefix;
    Engine(const std::string& dir, int64_t entry_bytes)
        : host(std::make_shared<pagedkv::HostStore>(3 * entry_bytes)),
          disk(std::make_shared<pagedkv::DiskStore>(dir, 6 * entry_bytes)),
          prefix(seqs, {host, disk}) {}
  };
  auto engine = std::make_unique<Engine>(dir.path, entry_bytes);
  engine->prefix.set_event_listener(listener);
  auto* seqs = &engine->seqs;
  auto* prefix = &engine->prefix;
  int64_t loaded_host = 0;
  int64_t loaded_disk = 0;
  int restarts = 0;
  // Prompts share prefixes: a few stems, each continued in a few ways.
  std::mt19937 rng(11);
  const auto prompt = [&]() {
    const int stem = static_cast<int>(rng() % 3);
    const int tail = static_cast<int>(rng() % 4);
    std::vector<int64_t> p = prompt_of(2 * kPage, 100 * stem);
    const std::vector<int64_t> rest = prompt_of(static_cast<int64_t>(1 + rng() % (2 * kPage)), 10000 + 37 * tail);
    p.insert(p.end(), rest.begin(), rest.end());
    return p;
  };
  // What a lookup must match: every page some tier holds, from the first on.
  const auto expected = [&](const std::vector<int64_t>& p) {
    uint64_t h = pagedkv::prefix_hash::salt_seed(0);
    int64_t n = 0;
    for (int64_t j = 0; (j + 1) * kPage <= static_cast<int64_t>(p.size()) - 1; ++j) {
      h = pagedkv::prefix_hash::page(h, p.data() + j * kPage, kPage);
      if (!model["device"].count(h) && !model["host"].count(h) && !model["disk"].count(h)) break;
      n += kPage;
    }
    return n;
  };
  std::vector<int64_t> live;
  for (int step = 0; step < 200; ++step) {
    const unsigned op = rng() % 10;
    if (op < 5) {
      if (live.size() >= 6) {  // keeps the pool from running short: the model assumes room
        seqs->release(live.front());
        live.erase(live.begin());
      }
      const std::vector<int64_t> p = prompt();
      EXPECT_EQ(prefix->peek(ids(p)) <= expected(p), true);
      const int64_t want = expected(p);
      const auto [seq, n] = prefix->acquire(ids(p));
      EXPECT_EQ(n, want) << "step " << step;
      seqs->release(seq);
      live.push_back(run_request(*seqs, *prefix, p));
    } else if (op < 8 && !live.empty()) {
      const size_t i = rng() % live.size();
      seqs->release(live[i]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op < 9) {
      prefix->evict(static_cast<int64_t>(1 + rng() % 4));
    } else if (step % 3 == 0) {
      prefix->persist();  // host memory's entries go down to the disk
      ASSERT_EQ(engine->host->n_entries(), 0);
    } else if (step % 3 == 1) {
      // A restart: what the disk holds survives; the device and host memory start empty.
      for (const int64_t seq : live) seqs->release(seq);
      live.clear();
      prefix->persist();
      ASSERT_TRUE(model["device"].empty() && model["host"].empty());
      loaded_host += prefix->stats().tiers[0].loaded_pages;
      loaded_disk += prefix->stats().tiers[1].loaded_pages;
      engine.reset();  // the disk store writes what it queued
      engine = std::make_unique<Engine>(dir.path, entry_bytes);
      engine->prefix.set_event_listener(listener);
      seqs = &engine->seqs;
      prefix = &engine->prefix;
      ++restarts;
    } else {
      prefix->clear();
    }
    ASSERT_EQ(failure, "") << "step " << step;
    ASSERT_EQ(static_cast<int64_t>(model["device"].size()), prefix->n_cached()) << "step " << step;
    ASSERT_EQ(static_cast<int64_t>(model["host"].size()), engine->host->n_entries()) << "step " << step;
    ASSERT_EQ(static_cast<int64_t>(model["disk"].size()), engine->disk->n_entries()) << "step " << step;
  }
  for (const int64_t seq : live) seqs->release(seq);
  prefix->clear();
  EXPECT_TRUE(model["device"].empty());
  EXPECT_EQ(failure, "");
  loaded_host += prefix->stats().tiers[0].loaded_pages;
  loaded_disk += prefix->stats().tiers[1].loaded_pages;
  EXPECT_GT(loaded_host, 0) << "the walk never hit host memory";
  EXPECT_GT(loaded_disk, 0) << "the walk never hit the disk";
  EXPECT_GT(restarts, 2);
  EXPECT_GT(n_events, 100);
  prefix->check();
}

TEST(PrefixTiers, BadInputThrowsWithNothingChanged) {
  at::manual_seed(12);
  PagedCache<NHD> cache = make_cache<NHD>(8);
  SequenceTable<NHD> seqs(cache);
  auto host = std::make_shared<pagedkv::HostStore>(1 << 20);
  EXPECT_THROW(PrefixCache<NHD>(seqs, {host, nullptr}), c10::Error);
  EXPECT_THROW(PrefixCache<NHD>(seqs, {host, host}), c10::Error);
  try {
    PrefixCache<NHD> p(seqs, {nullptr});
    ADD_FAILURE() << "no throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("PrefixCache<NHD>::PrefixCache: argument 'tiers' expected stores, got a null"),
              std::string::npos)
        << e.what();
  }
  PrefixCache<NHD> prefix(seqs, {host});  // the failed constructions left the table free to attach
  const std::vector<int64_t> p = prompt_of(2 * kPage + 1, 1);
  seqs.release(run_request(seqs, prefix, p));
  prefix.clear();
  ASSERT_EQ(host->n_entries(), 2);
  const auto before = prefix.stats();
  const int64_t free_before = cache.n_free();
  EXPECT_THROW(prefix.acquire(at::tensor({1.0, 2.0})), c10::Error);
  EXPECT_THROW(prefix.acquire(ids(p), 0, -2), c10::Error);
  EXPECT_THROW(prefix.acquire(ids(p).view({1, -1})), c10::Error);
  EXPECT_EQ(cache.n_free(), free_before);
  EXPECT_EQ(host->n_entries(), 2);
  EXPECT_EQ(prefix.stats().lookups, before.lookups);
  EXPECT_EQ(prefix.stats().tiers[0].loaded_pages, 0);
  EXPECT_EQ(seqs.size(), 0);
  prefix.check();
}

/// A store whose entries the cache reads as it reads files (open: an
/// EntryReader), recording where each entry is read to; it keeps them in a
/// host_store.
class ReadToRecordingStore final : public PageStore {
 public:
  std::string tier() const override { return "recording"; }
  bool put(const PageKey& key, const at::Tensor& entry, std::vector<StoredPage>* pushed_out) override {
    return kept_->put(key, entry, pushed_out);
  }
  at::Tensor get(const PageKey& key) override { return kept_->get(key); }
  void erase(const PageKey& key) override { kept_->erase(key); }
  std::unique_ptr<pagedkv::EntryReader> open(const PageKey& key) override {
    const at::Tensor entry = get(key);
    if (!entry.defined()) return nullptr;
    return std::make_unique<Reader>(entry, &read_to);
  }
  std::vector<uintptr_t> read_to;  // the destination of each entry's first read

 private:
  /// A FileLikeReader that records where it is first read to.
  class Reader final : public pagedkv::EntryReader {
   public:
    Reader(const at::Tensor& entry, std::vector<uintptr_t>* read_to) : file_(entry), read_to_(read_to) {}
    size_t size() const override { return file_.size(); }
    size_t read(uint8_t* dst, size_t n) override {
      if (!started_) read_to_->push_back(reinterpret_cast<uintptr_t>(dst));
      started_ = true;
      return file_.read(dst, n);
    }

   private:
    FileLikeReader file_;
    std::vector<uintptr_t>* read_to_;
    bool started_ = false;
  };
  std::shared_ptr<PageStore> kept_ = pagedkv::host_store(int64_t{1} << 30);
};

/// Where the cache reads a file's entry to: the payload on a 64-byte line
/// (the copy into the page ran at half speed 40 bytes past one), the entry
/// in the middle of a 4 KiB page (the kernel's copy of read() ran at half
/// speed or worse into an entry 8-24 bytes past a page, where an mmapped
/// buffer puts it: bench/NOTES.md, "Where in a page a disk entry is read to").
/// Entries of 300 KiB, over glibc's first mmap threshold, as the benchmark's.
TEST(PrefixTiers, AnEntryIsReadToTheMiddleOfAPageWithItsPayloadOnALine) {
  at::manual_seed(21);
  PagedCache<NHD> cache = make_cache<NHD>(8, {}, at::kFloat, /*n_layers=*/600);
  SequenceTable<NHD> seqs(cache);
  auto store = std::make_shared<ReadToRecordingStore>();
  PrefixCache<NHD> prefix(seqs, {store});
  const std::vector<int64_t> p = prompt_of(3 * kPage + 1, 5);
  const int64_t first = run_request(seqs, prefix, p);
  std::vector<std::vector<uint8_t>> written;
  for (int64_t j = 0; j < 3; ++j) written.push_back(page_bytes(cache, seqs.pages(first)[static_cast<size_t>(j)]));
  seqs.release(first);
  prefix.clear();
  const auto [seq, n] = prefix.acquire(ids(p));
  ASSERT_EQ(n, 3 * kPage);
  ASSERT_EQ(store->read_to.size(), 3u);
  for (size_t j = 0; j < 3; ++j) {
    const uintptr_t dst = store->read_to[j];
    const uintptr_t head = sizeof(page_store::Header) + (j + 1) * kPage * sizeof(int64_t);
    EXPECT_EQ((dst + head) % 64, 0u) << "page " << j;
    EXPECT_GE(dst % 4096, 2048u) << "page " << j;
    EXPECT_LT(dst % 4096, 2048u + 64) << "page " << j;
    EXPECT_EQ(page_bytes(cache, seqs.pages(seq)[j]), written[j]) << "page " << j;
  }
  seqs.release(seq);
  prefix.check();
}

/// A store that fails every call by throwing: an engine's broken store is a miss, never an exception.
class ThrowingStore final : public PageStore {
 public:
  std::string tier() const override { return "broken"; }
  bool put(const PageKey&, const at::Tensor&, std::vector<StoredPage>*) override { throw std::runtime_error("put"); }
  at::Tensor get(const PageKey&) override { throw std::runtime_error("get"); }
  void erase(const PageKey&) override { throw std::runtime_error("erase"); }
};

TEST(PrefixTiers, AStoreThatThrowsIsAMissWithAWarning) {
  at::manual_seed(13);
  PagedCache<NHD> cache = make_cache<NHD>(8);
  SequenceTable<NHD> seqs(cache);
  auto host = pagedkv::host_store(1 << 20);
  PrefixCache<NHD> prefix(seqs, {std::make_shared<ThrowingStore>(), host});
  Warnings warnings;
  const std::vector<int64_t> p = prompt_of(2 * kPage + 1, 1);
  seqs.release(run_request(seqs, prefix, p));
  prefix.clear();  // refused by the broken tier: the next one takes the pages
  EXPECT_TRUE(warnings.any("tier 'broken' threw on put"));
  const auto [seq, n] = prefix.acquire(ids(p));
  EXPECT_EQ(n, 2 * kPage);  // from host memory, past the broken tier
  EXPECT_TRUE(warnings.any("tier 'broken' threw on get"));
  EXPECT_EQ(prefix.stats().tiers[1].loaded_pages, 2);
  seqs.release(seq);
  prefix.check();
}

}  // namespace
