// Property test: thousands of random alloc/alloc_n/free/retain/write/gather
// operations (gathers also through bind with per-sequence lengths, whose rows
// may start with the -1 columns of a windowed table), good and bad, against
// a simple per-token reference model, for
// both layouts, page sizes 1/3/16 and float32/float16/bfloat16, on every
// target. Every call must either agree with the model or throw c10::Error
// leaving the model's view of the cache unchanged.
//
// PrefixTiersProperty: random request / release / evict / clear / persist /
// restart / corrupt sequences on a PrefixCache with host and disk tiers and
// a small pool (fuzz/tier_script.hpp, the engine of fuzz_tiers), fixed
// seeds, each layout, K/V format pair and tier arrangement: what the KV
// events say some tier holds must be matched, with the K/V bytes it was
// computed with.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <ostream>
#include <random>
#include <tuple>
#include <vector>

#include "../fuzz/tier_script.hpp"
#include "test_support.hpp"

namespace {

using pagedkv::HND;
using pagedkv::NHD;
using pagedkv::PagedCache;
using pagedkv_test::Target;

/// The cache as the model sees it: refcounts, and per (layer, page, offset)
/// the H*D values of k and v (absent = zeros, as a new cache holds).
struct Model {
  using Slot = std::tuple<int64_t, int64_t, int64_t>;
  std::vector<int64_t> refs;
  std::map<Slot, std::vector<float>> k, v;

  int64_t lowest_free() const {
    for (size_t p = 0; p < refs.size(); ++p)
      if (refs[p] == 0) return static_cast<int64_t>(p);
    return -1;
  }
  int64_t n_free() const { return std::count(refs.begin(), refs.end(), 0); }
  bool allocated(int64_t page) const {
    return page >= 0 && page < static_cast<int64_t>(refs.size()) && refs[static_cast<size_t>(page)] > 0;
  }
};

struct Config {
  int64_t page_size;
  at::ScalarType dtype;
  pagedkv::KVQuant quant = {};
};

/// How gtest (and so ctest's test names) print a Config: "P16_Half" (and
/// "_Kfp8_e4m3_Vint8" for quantized pages), not its bytes.
void PrintTo(const Config& c, std::ostream* os) {
  *os << 'P' << c.page_size << '_' << c10::toString(c.dtype);
  if (pagedkv::is_quantized(c.quant))
    *os << "_K" << pagedkv::format_name(c.quant.k) << "_V" << pagedkv::format_name(c.quant.v);
}

/// What a gather returns for a written row [heads * dim] of one side: the
/// row itself (native), or each head vector quantized and dequantized with
/// the scalar codecs, then rounded to the cache's dtype.
std::vector<float> stored(const std::vector<float>& row, pagedkv::KVFormat format, at::ScalarType dtype,
                          int64_t dim) {
  if (!pagedkv::is_quantized(format)) return row;
  namespace quant = pagedkv::cpu::quant;
  std::vector<float> out(row.size());
  for (size_t h = 0; h < row.size(); h += static_cast<size_t>(dim)) {
    float amax = 0.0f;
    for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(row[h + static_cast<size_t>(d)]));
    const float scale = quant::scale_for(amax, format);
    for (int64_t d = 0; d < dim; ++d) {
      const float x = row[h + static_cast<size_t>(d)];
      float value = 0.0f;
      if (scale > 0.0f) {
        value = format == pagedkv::KVFormat::int8 ? quant::decode_int8(quant::encode_int8(x / scale)) * scale
                                                  : quant::decode_e4m3(quant::encode_e4m3(x / scale)) * scale;
      }
      out[h + static_cast<size_t>(d)] = dtype == at::kHalf       ? static_cast<float>(c10::Half(value))
                                        : dtype == at::kBFloat16 ? static_cast<float>(c10::BFloat16(value))
                                                                 : value;
    }
  }
  return out;
}

class PropertyTest : public ::testing::TestWithParam<std::tuple<Target, Config>> {
 protected:
  void SetUp() override { PAGEDKV_SKIP_IF_UNAVAILABLE(std::get<0>(GetParam())); }
  pagedkv::ScopedBackend backend_{std::get<0>(GetParam()).backend};

  template <class L>
  void run(uint64_t seed, int steps);
};

std::vector<float> host_floats(const at::Tensor& t) {
  const at::Tensor f = t.to(at::kCPU, at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

template <class L>
void PropertyTest::run(uint64_t seed, int steps) {
  const Target target = std::get<0>(GetParam());
  const Config config = std::get<1>(GetParam());
  const int64_t n_layers = 2, n_pages = 24, heads = 2, dim = 3, P = config.page_size;
  const int64_t row = heads * dim;
  const auto opts = at::TensorOptions().dtype(config.dtype).device(target.device);
  PagedCache<L> cache(n_layers, n_pages, P, heads, dim, opts, config.quant);
  Model model;
  model.refs.assign(static_cast<size_t>(n_pages), 0);
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) {  // [lo, hi]
    return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
  };
  // A page-table entry: usually an allocated page, sometimes -1, a free page or garbage.
  auto entry = [&]() -> int64_t {
    const int64_t roll = uniform(0, 99);
    if (roll < 8) return -1;
    if (roll < 11) return uniform(-3, n_pages + 3);
    std::vector<int64_t> live;
    for (int64_t p = 0; p < n_pages; ++p)
      if (model.allocated(p)) live.push_back(p);
    if (live.empty() || roll < 14) return uniform(0, n_pages - 1);
    return live[static_cast<size_t>(uniform(0, static_cast<int64_t>(live.size()) - 1))];
  };
  auto random_table = [&](int64_t batch, int64_t cols) {
    std::vector<std::vector<int64_t>> rows(static_cast<size_t>(batch));
    for (auto& r : rows)
      for (int64_t c = 0; c < cols; ++c) r.push_back(entry());
    return rows;
  };
  auto expect_model = [&](int64_t layer, const std::vector<std::vector<int64_t>>& rows,
                          const std::vector<int64_t>& lengths, int64_t T, const at::Tensor& k_got,
                          const at::Tensor& v_got) {
    const int64_t batch = static_cast<int64_t>(rows.size());
    ASSERT_EQ(k_got.sizes(), (std::vector<int64_t>{batch, T, heads, dim}));
    const auto k_host = host_floats(k_got), v_host = host_floats(v_got);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        std::vector<float> k_want(static_cast<size_t>(row), 0.0f), v_want = k_want;
        const int64_t page = t < lengths[static_cast<size_t>(b)] ? rows[static_cast<size_t>(b)][static_cast<size_t>(t / P)] : -1;
        if (page >= 0) {
          const auto slot = std::make_tuple(layer, page, t % P);
          if (model.k.count(slot)) k_want = model.k[slot];
          if (model.v.count(slot)) v_want = model.v[slot];
        }
        for (int64_t i = 0; i < row; ++i) {
          const size_t at_i = static_cast<size_t>((b * T + t) * row + i);
          ASSERT_EQ(k_host[at_i], k_want[static_cast<size_t>(i)]) << "k b=" << b << " t=" << t;
          ASSERT_EQ(v_host[at_i], v_want[static_cast<size_t>(i)]) << "v b=" << b << " t=" << t;
        }
      }
    }
  };
  auto expect_pool_matches = [&] {
    ASSERT_NO_THROW(cache.check());  // every invariant, after every step
    ASSERT_EQ(cache.n_free(), model.n_free());
    for (int64_t p = 0; p < n_pages; ++p) ASSERT_EQ(cache.ref_count(p), model.refs[static_cast<size_t>(p)]);
  };
  auto expect_throws = [&](const std::function<void()>& call) {
    const at::Tensor k_before = cache.k_cache().clone(), v_before = cache.v_cache().clone();
    EXPECT_THROW(call(), c10::Error);
    ASSERT_TRUE(pagedkv_test::bitwise_equal(cache.k_cache(), k_before));
    ASSERT_TRUE(pagedkv_test::bitwise_equal(cache.v_cache(), v_before));
    ASSERT_NO_THROW(cache.check());
  };

  int writes_done = 0, gathers_done = 0, rejected = 0, binds_done = 0;
  for (int step = 0; step < steps; ++step) {
    const int64_t op = uniform(0, 9);
    if (op == 0) {
      const int64_t want = model.lowest_free();
      ASSERT_EQ(cache.alloc(), want);
      if (want >= 0) model.refs[static_cast<size_t>(want)] = 1;
    } else if (op == 1) {
      const int64_t n = uniform(0, 5);
      const auto got = cache.alloc_n(n);
      if (n > model.n_free()) {
        ASSERT_TRUE(got.empty());
      } else {
        ASSERT_EQ(static_cast<int64_t>(got.size()), n);
        for (int64_t p : got) {
          ASSERT_EQ(p, model.lowest_free());
          model.refs[static_cast<size_t>(p)] = 1;
        }
      }
    } else if (op == 2 || op == 3) {
      const int64_t page = uniform(-1, n_pages);
      if (model.allocated(page)) {
        op == 2 ? cache.free(page) : cache.retain(page);
        model.refs[static_cast<size_t>(page)] += op == 2 ? -1 : 1;
      } else {
        expect_throws([&] { op == 2 ? cache.free(page) : cache.retain(page); });
      }
    } else if (op <= 6) {  // write
      const int64_t batch = uniform(1, 3), cols = uniform(1, 4), layer = uniform(0, n_layers - 1);
      const auto rows = random_table(batch, cols);
      const int64_t S = uniform(0, 2 * P + 1);
      std::vector<int64_t> starts(static_cast<size_t>(batch));
      const bool per_sequence = op == 6;
      const int64_t scalar_start = uniform(0, cols * P);
      for (auto& s : starts) s = per_sequence ? uniform(0, cols * P) : scalar_start;
      bool valid = true;
      for (int64_t b = 0; b < batch && S > 0; ++b) {
        const int64_t start = starts[static_cast<size_t>(b)];
        if (start + S > cols * P) {
          valid = false;
          break;
        }
        for (int64_t pos = start; pos < start + S; ++pos)
          valid = valid && model.allocated(rows[static_cast<size_t>(b)][static_cast<size_t>(pos / P)]);
      }
      const at::Tensor pt = pagedkv_test::table(rows, uniform(0, 1) ? at::kInt : at::kLong);
      const at::Tensor k = pagedkv_test::pattern({batch, S, heads, dim}, uniform(0, 1000), opts);
      const at::Tensor v = pagedkv_test::pattern({batch, S, heads, dim}, uniform(0, 1000), opts);
      auto call = [&] {
        if (per_sequence) {
          cache.write(layer, pt, pagedkv_test::ints(starts), k, v);
        } else {
          cache.write(layer, pt, scalar_start, k, v);
        }
      };
      if (!valid) {
        expect_throws(call);
        ++rejected;
        continue;
      }
      call();
      ++writes_done;
      // Rows may share a page (the table is random); the model applies rows
      // in order, so a shared slot is checked by the next gather only if
      // both rows wrote the same values. Skip that ambiguity: last-writer
      // order across rows is unspecified, so rewrite shared slots once more.
      const auto k_host = host_floats(k), v_host = host_floats(v);
      std::map<Model::Slot, int> writers;
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t s = 0; s < S; ++s) {
          const int64_t pos = starts[static_cast<size_t>(b)] + s;
          ++writers[std::make_tuple(layer, rows[static_cast<size_t>(b)][static_cast<size_t>(pos / P)], pos % P)];
        }
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t s = 0; s < S; ++s) {
          const int64_t pos = starts[static_cast<size_t>(b)] + s;
          const auto slot = std::make_tuple(layer, rows[static_cast<size_t>(b)][static_cast<size_t>(pos / P)], pos % P);
          const auto first = k_host.begin() + (b * S + s) * row;
          const auto first_v = v_host.begin() + (b * S + s) * row;
          model.k[slot] = stored(std::vector<float>(first, first + row), config.quant.k, config.dtype, dim);
          model.v[slot] = stored(std::vector<float>(first_v, first_v + row), config.quant.v, config.dtype, dim);
        }
      }
      // Make slots written by several rows unambiguous: write them again from one row.
      for (const auto& w : writers) {
        if (w.second < 2) continue;
        const at::Tensor fix_k = pagedkv_test::pattern({1, 1, heads, dim}, step, opts);
        const int64_t page = std::get<1>(w.first), off = std::get<2>(w.first);
        cache.write(layer, pagedkv_test::table({{page}}), off, fix_k, fix_k);
        model.k[w.first] = stored(host_floats(fix_k), config.quant.k, config.dtype, dim);
        model.v[w.first] = stored(host_floats(fix_k), config.quant.v, config.dtype, dim);
      }
    } else {  // gather
      const int64_t batch = uniform(0, 3), cols = uniform(1, 4), layer = uniform(0, n_layers - 1);
      const auto rows = random_table(batch, cols);
      const at::Tensor pt = pagedkv_test::table(rows, uniform(0, 1) ? at::kInt : at::kLong);
      if (op == 7 || op == 8) {  // total_len semantics, through the cache or a view
        int64_t mapped_cols = 0;
        while (mapped_cols < cols) {
          bool any = false;
          for (const auto& r : rows) any = any || r[static_cast<size_t>(mapped_cols)] >= 0;
          if (!any) break;
          ++mapped_cols;
        }
        const int64_t total_len = op == 8 ? uniform(0, cols * P) : 0;
        const int64_t T = total_len > 0 ? total_len : mapped_cols * P;
        bool valid = total_len <= mapped_cols * P;
        for (const auto& r : rows)
          for (int64_t c = 0; c * P < T && valid; ++c)
            valid = r[static_cast<size_t>(c)] == -1 || model.allocated(r[static_cast<size_t>(c)]);
        auto call = [&] { return op == 7 ? cache.gather(layer, pt) : cache.bind(pt, total_len).gather(layer); };
        if (!valid) {
          expect_throws([&] { call(); });
          ++rejected;
          continue;
        }
        const auto kv = call();
        ++gathers_done;
        expect_model(layer, rows, std::vector<int64_t>(static_cast<size_t>(batch), T), T, kv.first, kv.second);
      } else {  // per-sequence lengths
        std::vector<int64_t> lengths(static_cast<size_t>(batch));
        bool valid = true;
        for (int64_t b = 0; b < batch; ++b) {
          lengths[static_cast<size_t>(b)] = uniform(0, cols * P);
          for (int64_t c = 0; c * P < lengths[static_cast<size_t>(b)]; ++c)
            valid = valid && model.allocated(rows[static_cast<size_t>(b)][static_cast<size_t>(c)]);
        }
        const int64_t T = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
        if (uniform(0, 1) == 1) {  // through bind, which takes a windowed table's rows (leading -1 columns)
          auto windowed = rows;
          for (auto& r : windowed) {
            const int64_t released = uniform(0, 3) == 0 ? uniform(1, cols) : 0;
            std::fill(r.begin(), r.begin() + released, int64_t{-1});
          }
          bool bindable = true, readable = true;
          for (int64_t b = 0; b < batch; ++b) {
            const auto& r = windowed[static_cast<size_t>(b)];
            const int64_t length = lengths[static_cast<size_t>(b)];
            if (length == 0) continue;
            const int64_t last = (length - 1) / P;
            int64_t first = 0;
            while (r[0] == -1 && first < last && r[static_cast<size_t>(first)] == -1) ++first;
            for (int64_t c = first; c <= last; ++c) bindable = bindable && model.allocated(r[static_cast<size_t>(c)]);
            for (int64_t c = 0; c <= last; ++c) readable = readable && model.allocated(r[static_cast<size_t>(c)]);
          }
          const at::Tensor wpt = pagedkv_test::table(windowed, uniform(0, 1) ? at::kInt : at::kLong);
          const at::Tensor lens = pagedkv_test::ints(lengths);
          if (!bindable) {
            expect_throws([&] { cache.bind(wpt, lens); });
            ++rejected;
            continue;
          }
          const auto view = cache.bind(wpt, lens);
          ++binds_done;
          if (!readable) {  // a gather without a window refuses the released columns bind let through
            expect_throws([&] { view.gather(layer); });
            ++rejected;
            continue;
          }
          const auto kv = view.gather(layer);
          ++gathers_done;
          expect_model(layer, windowed, lengths, T, kv.first, kv.second);
          expect_pool_matches();
          if (HasFatalFailure()) return;
          continue;
        }
        auto call = [&] { return cache.gather(layer, pt, pagedkv_test::ints(lengths)); };
        if (!valid) {
          expect_throws([&] { call(); });
          ++rejected;
          continue;
        }
        const auto kv = call();
        ++gathers_done;
        expect_model(layer, rows, lengths, T, kv.first, kv.second);
      }
    }
    expect_pool_matches();
    if (HasFatalFailure()) return;
  }
  // The script must exercise both outcomes, not mostly bounce off validation.
  EXPECT_GT(writes_done, steps / 20);
  EXPECT_GT(gathers_done, steps / 20);
  EXPECT_GT(rejected, steps / 50);
  EXPECT_GT(binds_done, steps / 100);
  RecordProperty("writes", writes_done);
  RecordProperty("gathers", gathers_done);
  RecordProperty("rejected", rejected);
  RecordProperty("binds", binds_done);
}

TEST_P(PropertyTest, NHDAgreesWithTheModel) { run<NHD>(1234 + std::get<1>(GetParam()).page_size, 1500); }
TEST_P(PropertyTest, HNDAgreesWithTheModel) { run<HND>(4321 + std::get<1>(GetParam()).page_size, 1500); }

std::vector<Config> configs() {
  std::vector<Config> out;
  for (int64_t p : {1, 3, 16})
    for (at::ScalarType d : {at::kFloat, at::kHalf, at::kBFloat16}) out.push_back({p, d});
  // Quantized pages: the model holds each row quantized and dequantized.
  using pagedkv::KVFormat;
  for (int64_t p : {1, 3, 16}) {
    out.push_back({p, at::kHalf, {KVFormat::fp8_e4m3, KVFormat::int8}});
    out.push_back({p, at::kBFloat16, {KVFormat::int8, KVFormat::native}});
    out.push_back({p, at::kFloat, {KVFormat::native, KVFormat::fp8_e4m3}});
  }
  return out;
}

std::string name(const ::testing::TestParamInfo<std::tuple<Target, Config>>& info) {
  const Config c = std::get<1>(info.param);
  std::string formats;
  if (pagedkv::is_quantized(c.quant)) {
    formats = std::string("_K") + pagedkv::format_name(c.quant.k) + "_V" + pagedkv::format_name(c.quant.v);
  }
  return std::string(std::get<0>(info.param).name) + "_P" + std::to_string(c.page_size) + "_" +
         std::string(c10::toString(c.dtype)) + formats;
}

/// Random scripts of one tier arrangement, fixed seeds; returns what they did.
pagedkv_fuzz::TierSummary tier_scripts(pagedkv_fuzz::TierOptions options, uint64_t seed, int n_scripts) {
  pagedkv_fuzz::TierSummary total;
  std::mt19937_64 rng(seed);
  for (int i = 0; i < n_scripts; ++i) {
    std::vector<uint8_t> bytes(1500);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    try {
      const auto s = pagedkv_fuzz::run_tier_script(bytes.data(), bytes.size(), options);
      total.loaded_pages += s.loaded_pages;
      total.restarts += s.restarts;
      total.corruptions += s.corruptions;
      total.drops += s.drops;
    } catch (const pagedkv_fuzz::Failure& failure) {
      ADD_FAILURE() << "script " << i << " (seed " << seed << "): " << failure.what();
    }
  }
  return total;
}

TEST(PrefixTiersProperty, EveryPageSomeTierHoldsIsMatchedBitForBit) {
  struct Case {
    int layout, formats, tiers, ample_disk;
  };
  // layout 0 NHD / 1 HND; formats: native, fp8, int8, fp8 K + int8 V; tiers: host + disk, host, disk.
  const Case cases[] = {{0, 0, 0, 0}, {1, 1, 0, 1}, {0, 2, 2, 1}, {1, 3, 1, 0}, {1, 0, 2, 0}, {0, 3, 0, 1}};
  pagedkv_fuzz::TierSummary total;
  for (const Case& c : cases) {
    pagedkv_fuzz::TierOptions options;
    options.layout = c.layout;
    options.formats = c.formats;
    options.tiers = c.tiers;
    options.ample_disk = c.ample_disk;
    SCOPED_TRACE(::testing::Message() << "layout " << c.layout << ", formats " << c.formats << ", tiers " << c.tiers
                                      << ", ample disk " << c.ample_disk);
    const auto s = tier_scripts(options, 5300 + 17 * static_cast<uint64_t>(&c - cases), 8);
    EXPECT_GT(s.loaded_pages, 0) << "no page came back from a tier";
    EXPECT_GT(s.restarts, 0);
    total.loaded_pages += s.loaded_pages;
    total.restarts += s.restarts;
    total.corruptions += s.corruptions;
    total.drops += s.drops;
  }
  RecordProperty("loaded_pages", static_cast<int>(total.loaded_pages));
  RecordProperty("restarts", static_cast<int>(total.restarts));
  RecordProperty("corruptions", static_cast<int>(total.corruptions));
  RecordProperty("drops", static_cast<int>(total.drops));
  EXPECT_GT(total.corruptions, 0);
  EXPECT_GT(total.drops, 0);
}

INSTANTIATE_TEST_SUITE_P(Targets, PropertyTest,
                         ::testing::Combine(::testing::ValuesIn(pagedkv_test::all_targets()),
                                            ::testing::ValuesIn(configs())),
                         name);

}  // namespace
