// The CUDA kernels of write, gather, page copies and the quantized pages'
// codecs, run under the CPU emulator (tests/cuda_emulator/) through the
// same host planners (cuda/write_gather.hpp, cuda/page_copy.hpp) the GPU
// path launches them with, and compared bit for bit with the CPU kernels:
// both layouts, float32 / float16 / bfloat16 (and float64, uint8: native
// pages copy bytes), page sizes 1 / 3 / 16, int32 and int64 page tables,
// strided k / v (a fused QKV slice, elements apart), scalar, per-sequence
// and tail start positions, fp8 / int8 sides with NaN, infinities and
// subnormals. This runs the kernels' text on the CPU: it says nothing about
// a GPU (scripts/gpu-check does).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_emulator/kernels.hpp"
#include "pagedkv/cuda/page_copy.hpp"
#include "pagedkv/cuda/params.hpp"
#include "pagedkv/cuda/write_gather.hpp"
#include "test_support.hpp"

namespace pkv {
PAGEDKV_CUDA_USING_KERNEL_PARAMS
}
#include "cuda_sources/common.inc"  // the codecs, tested here one by one

namespace {

using namespace pagedkv_test;
namespace pc = pagedkv::cuda;
using pagedkv::KVFormat;
using pagedkv::KVQuant;

/// The emulator with the kernels compiled in cuda_emulator/kernels.cpp.
pkv_emu::EmulatedExecutor& emulator() {
  static pkv_emu::EmulatedExecutor ex = pkv_emu::kernels();
  return ex;
}

// ---- the conversions and codecs, against c10 and quant/scalar.hpp ----

float float_of(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

TEST(CudaKernelCodecs, HalfToFloatIsC10sForEveryHalf) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float theirs = static_cast<float>(c10::Half(static_cast<uint16_t>(h), c10::Half::from_bits()));
    ASSERT_EQ(bits_of(pkv::half_to_float(static_cast<pkv_u16>(h))), bits_of(theirs)) << std::hex << h;
  }
}

/// Floats around every rounding boundary of fp16 and bf16, plus random ones
/// and the special values.
std::vector<uint32_t> conversion_inputs() {
  std::vector<uint32_t> out;
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const uint32_t f = bits_of(static_cast<float>(c10::Half(static_cast<uint16_t>(h), c10::Half::from_bits())));
    const uint32_t next = bits_of(static_cast<float>(c10::Half(static_cast<uint16_t>(h + 1), c10::Half::from_bits())));
    for (int d = -2; d <= 2; ++d) out.push_back(f + static_cast<uint32_t>(d));
    const uint32_t mid = f + (next - f) / 2;  // the midpoint to the next half (same sign)
    for (int d = -1; d <= 1; ++d) out.push_back(mid + static_cast<uint32_t>(d));
    const uint32_t bf = h << 16;  // every bf16 and its neighbours, midpoints
    for (int d = -1; d <= 1; ++d) {
      out.push_back(bf + static_cast<uint32_t>(d));
      out.push_back(bf + 0x8000u + static_cast<uint32_t>(d));
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 1000000; ++i) out.push_back(static_cast<uint32_t>(rng()));
  for (uint32_t s : {0u, 0x80000000u}) {
    for (uint32_t m : {0u, 1u, 0x7FFFFFu, 0x400000u, 0x3FFFFFu, 0x1000u}) out.push_back(s | 0x7F800000u | m);
    for (uint32_t e : {0u, 1u, 0x33000000u, 0x33000001u, 0x337FFFFFu, 0x38800000u, 0x387FFFFFu, 0x477FEFFFu,
                       0x477FF000u, 0x477FF001u}) {
      out.push_back(s | e);
    }
  }
  return out;
}

TEST(CudaKernelCodecs, FloatToHalfAndBf16RoundAsC10) {
  for (const uint32_t u : conversion_inputs()) {
    const float f = float_of(u);
    ASSERT_EQ(pkv::float_to_half(f), c10::Half(f).x) << std::hex << u;
    ASSERT_EQ(pkv::float_to_bf16(f), c10::BFloat16(f).x) << std::hex << u;
  }
}

TEST(CudaKernelCodecs, Fp8AndInt8CodesAreTheCpus) {
  for (uint32_t c = 0; c < 256; ++c) {
    const float ours = pkv::decode_e4m3(static_cast<pkv_u8>(c));
    const float theirs = pagedkv::cpu::quant::decode_e4m3(static_cast<uint8_t>(c));
    ASSERT_EQ(bits_of(ours), bits_of(theirs)) << c;
  }
  for (const uint32_t u : conversion_inputs()) {
    const float y = float_of(u);
    ASSERT_EQ(pkv::encode_e4m3(y), pagedkv::cpu::quant::encode_e4m3(y)) << std::hex << u;
    ASSERT_EQ(pkv::encode_int8(y), pagedkv::cpu::quant::encode_int8(y)) << std::hex << u;
    ASSERT_EQ(static_cast<uint8_t>(pkv::encode_int8(y * 100.0f)), static_cast<uint8_t>(pagedkv::cpu::quant::encode_int8(y * 100.0f)))
        << std::hex << u;
  }
}

/// x86_product / x86_quotient derive the CPU's NaN from the operands alone:
/// what they return when the device's own result is a canonical NaN.
TEST(CudaKernelCodecs, X86NanRulesMatchThisCpu) {
  const float specials[] = {0.0f, -0.0f, 1.5f, -2.0f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), float_of(0x7FC00000u), float_of(0xFFC00000u),
                            float_of(0x7F800001u), float_of(0xFFA00005u), float_of(0x7FC12345u)};
  for (const float a : specials) {
    for (const float b : specials) {
      volatile float va = a, vb = b;
      const float product = va * vb, quotient = va / vb;
      if (std::isnan(product)) {
        EXPECT_EQ(bits_of(pkv::x86_nan(a, b)), bits_of(product)) << bits_of(a) << " * " << bits_of(b);
      }
      if (std::isnan(quotient)) {
        EXPECT_EQ(bits_of(pkv::x86_nan(a, b)), bits_of(quotient)) << bits_of(a) << " / " << bits_of(b);
      }
      EXPECT_EQ(bits_of(pkv::x86_product(a, b)), bits_of(product));
      EXPECT_EQ(bits_of(pkv::x86_quotient(a, b)), bits_of(quotient));
    }
  }
}

// ---- the emulator itself ----

namespace broken {
/// A kernel whose thread 0 returns before the block's barrier.
inline void early_return(const pkv::CopyParams& /*p*/) {
  if (pkv_tid() == 0) return;
  pkv_sync();
}
/// A kernel whose lanes 0-15 skip a shuffle.
inline void divergent_shuffle(const pkv::CopyParams& /*p*/) {
  if (pkv_tid() % 32 < 16) return;
  (void)pkv_shfl_xor(1.0f, 1);
}
/// A kernel reading 16 bytes at an odd address.
inline void misaligned(const pkv::CopyParams& p) { (void)pkv_load_v16(static_cast<const char*>(p.src) + 1); }
/// Thread t writes its id to shared memory; after the barrier each reads its neighbour's, and lane 0 of each warp
/// sums the warp's ids with shuffles.
inline void shared_and_shuffles(const pkv::CopyParams& p) {
  PKV_SHARED(pkv_u32, ids, 64);
  ids[pkv_tid()] = pkv_tid();
  pkv_sync();
  auto* out = static_cast<pkv_u32*>(p.dst);
  out[pkv_tid()] = ids[(pkv_tid() + 1) % 64];
  const float sum = pkv::group_sum(static_cast<float>(pkv_tid()), 32);
  if (pkv_tid() % 32 == 0) out[64 + pkv_tid() / 32] = static_cast<pkv_u32>(sum);
}
}  // namespace broken

TEST(CudaEmulator, RunsBarriersSharedMemoryAndShuffles) {
  pkv_emu::EmulatedExecutor ex;
  ex.add({"shared_and_shuffles", [](const void* p) { broken::shared_and_shuffles(*static_cast<const pkv::CopyParams*>(p)); }});
  std::vector<uint32_t> out(66, 0);
  pkv::CopyParams p{};
  p.dst = out.data();
  ex.launch(pc::make_launch(pc::kernel("shared_and_shuffles", "CopyParams", 64), pc::Dim3{}, p));
  for (uint32_t t = 0; t < 64; ++t) EXPECT_EQ(out[t], (t + 1) % 64);
  EXPECT_EQ(out[64], 31u * 32 / 2);
  EXPECT_EQ(out[65], 32u * 32 + 31u * 32 / 2);
}

TEST(CudaEmulator, ReportsBarriersThatCannotOpenAndMisalignedAccesses) {
  pkv_emu::EmulatedExecutor ex;
  ex.add({"early_return", [](const void* p) { broken::early_return(*static_cast<const pkv::CopyParams*>(p)); }});
  ex.add({"divergent_shuffle", [](const void* p) { broken::divergent_shuffle(*static_cast<const pkv::CopyParams*>(p)); }});
  ex.add({"misaligned", [](const void* p) { broken::misaligned(*static_cast<const pkv::CopyParams*>(p)); }});
  alignas(16) char buffer[64] = {};
  pkv::CopyParams p{};
  p.src = buffer;
  const auto run = [&](const char* name) {
    try {
      ex.launch(pc::make_launch(pc::kernel(name, "CopyParams", 64), pc::Dim3{}, p));
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(run("early_return").find("deadlock"), std::string::npos) << run("early_return");
  EXPECT_NE(run("divergent_shuffle").find("already returned"), std::string::npos) << run("divergent_shuffle");
  EXPECT_NE(run("misaligned").find("misaligned 16-byte access"), std::string::npos) << run("misaligned");
  EXPECT_NE(run("not_registered").find("not registered"), std::string::npos);
}

// ---- write, gather and copies against the CPU kernels ----

template <class L>
void sides_of(const PagedCache<L>& cache, int64_t layer, pc::Side (&sides)[2]) {
  sides[0] = {pc::pages_ref(cache.k_cache(), cache.k_scales(), layer, cache.geometry()), cache.quant().k};
  sides[1] = {pc::pages_ref(cache.v_cache(), cache.v_scales(), layer, cache.geometry()), cache.quant().v};
}

template <class A, class B>
void expect_same_storage(const PagedCache<A>& a, const PagedCache<B>& b, const std::string& what) {
  EXPECT_TRUE(bitwise_equal(a.k_cache(), b.k_cache())) << what << ": k_cache";
  EXPECT_TRUE(bitwise_equal(a.v_cache(), b.v_cache())) << what << ": v_cache";
  if (a.k_scales().defined()) {
    EXPECT_TRUE(bitwise_equal(a.k_scales(), b.k_scales())) << what << ": k_scales";
  }
  if (a.v_scales().defined()) {
    EXPECT_TRUE(bitwise_equal(a.v_scales(), b.v_scales())) << what << ": v_scales";
  }
}

enum class Source { contiguous, fused_qkv, strided_elements, misaligned };
enum class StartKind { scalar, per_row, tail };

struct Case {
  at::ScalarType dtype;
  int64_t page_size;
  at::ScalarType index;
  KVQuant quant;
  Source source;
  StartKind start;
  int64_t head_dim;

  std::string name() const {
    return std::string(c10::toString(dtype)) + " P=" + std::to_string(page_size) + " " + c10::toString(index) +
           " K=" + pagedkv::format_name(quant.k) + " V=" + pagedkv::format_name(quant.v) + " src=" +
           std::to_string(static_cast<int>(source)) + " start=" + std::to_string(static_cast<int>(start)) +
           " D=" + std::to_string(head_dim);
  }
};

constexpr int64_t kBatch = 3, kTokens = 5, kHeads = 2, kLayers = 2;

/// [B, S, H, D] k or v of the case's kind, random values of dtype (with
/// NaN, infinities, zeros and tiny values where the pages are quantized).
at::Tensor source_tensor(const Case& c, int64_t seed) {
  at::manual_seed(seed);
  const int64_t D = c.head_dim;
  const at::ScalarType gen = c.dtype == at::kByte ? at::kFloat : c.dtype;
  auto random = [&](at::IntArrayRef shape) {
    at::Tensor t = at::randn(shape, at::kFloat) * 3;
    if (c.dtype == at::kByte) return (t * 20).clamp(-100, 100).add(128).to(at::kByte);
    return t.to(gen);
  };
  at::Tensor x;
  switch (c.source) {
    case Source::contiguous: x = random({kBatch, kTokens, kHeads, D}); break;
    case Source::fused_qkv: x = random({kBatch, kTokens, 3 * kHeads, D}).narrow(2, kHeads, kHeads); break;
    case Source::strided_elements: x = random({kBatch, kTokens, D, kHeads}).transpose(2, 3); break;
    case Source::misaligned: x = random({kBatch * kTokens * kHeads * D + 1}).narrow(0, 1, kBatch * kTokens * kHeads * D).view({kBatch, kTokens, kHeads, D}); break;
  }
  if (pagedkv::is_quantized(c.quant) && x.is_floating_point()) {
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(), -0.0f, 1e-7f, -3e-6f, 60000.0f};
    int i = 0;
    for (const float s : specials) {
      const int64_t b = i % kBatch, t = (i * 2) % kTokens, h = i % kHeads, d = (i * 3) % D;
      x[b][t][h][d] = s;
      ++i;
    }
    x[1][2][1].zero_();  // an all-zero head vector: scale 0
  }
  return x;
}

/// A contiguous tensor like `t` full of 0x55 bytes: a gather must write every element.
at::Tensor garbage_like(const at::Tensor& t) {
  at::Tensor out = at::empty_like(t, at::MemoryFormat::Contiguous);
  std::memset(out.data_ptr(), 0x55, out.nbytes());
  return out;
}

template <class L>
void check_write_and_gather(const Case& c) {
  SCOPED_TRACE(std::string(L::name) + " " + c.name());
  const int64_t P = c.page_size;
  const std::vector<int64_t> starts{0, P > 1 ? P - 1 : 1, 2 * P + 1};
  const int64_t cols = (*std::max_element(starts.begin(), starts.end()) + kTokens + P - 1) / P + 1;
  const int64_t n_pages = kBatch * cols + 2;
  const at::TensorOptions options = at::TensorOptions().dtype(c.dtype);
  PagedCache<L> ref(kLayers, n_pages, P, kHeads, c.head_dim, options, c.quant);
  PagedCache<L> emu(kLayers, n_pages, P, kHeads, c.head_dim, options, c.quant);
  std::vector<int64_t> pages = ref.alloc_n(kBatch * cols);
  ASSERT_EQ(emu.alloc_n(kBatch * cols), pages);
  std::mt19937 rng(static_cast<uint32_t>(P * 31 + c.head_dim));
  std::shuffle(pages.begin(), pages.end(), rng);
  std::vector<std::vector<int64_t>> rows(kBatch);
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t j = 0; j < cols; ++j) rows[static_cast<size_t>(b)].push_back(pages[static_cast<size_t>(b * cols + j)]);
  const at::Tensor page_table = table(rows, c.index);
  const at::Tensor k = source_tensor(c, 1), v = source_tensor(c, 2);
  const int64_t layer = 1;

  // write
  pc::Side sides[2];
  sides_of(emu, layer, sides);
  const at::Tensor starts_t = ints(starts);
  const at::Tensor tails_t = starts_t + kTokens;
  pc::Starts where;
  switch (c.start) {
    case StartKind::scalar:
      ref.write(layer, page_table, P + 1, k, v);
      where.scalar = P + 1;
      break;
    case StartKind::per_row:
      ref.write(layer, page_table, starts_t, k, v);
      where.per_row = starts_t.data_ptr<int64_t>();
      break;
    case StartKind::tail:
      ref.write(layer, page_table, starts_t, k, v);
      where.tail_lengths = tails_t.data_ptr<int64_t>();
      break;
  }
  pc::write(emulator(), pc::table_ref(page_table), where, k, v, sides, emu.geometry(), c.dtype, n_pages);
  expect_same_storage(ref, emu, "write");

  // gather with lengths (one sequence empty), and the total-length gather
  // over a table with an unmapped page
  const at::Tensor lengths = ints({cols * P - 1, 0, P + 2});
  const auto expected = ref.gather(layer, page_table, lengths);
  at::Tensor k_out = garbage_like(expected.first), v_out = garbage_like(expected.second);
  pc::gather(emulator(), pc::table_ref(page_table), lengths.data_ptr<int64_t>(), 0, sides, k_out, v_out, ref.geometry(),
             c.dtype, n_pages);
  EXPECT_TRUE(bitwise_equal(k_out, expected.first)) << "gather k";
  EXPECT_TRUE(bitwise_equal(v_out, expected.second)) << "gather v";

  at::Tensor holes = page_table.clone();
  holes[1][1] = -1;
  holes[2][cols - 1] = -1;
  const auto all = ref.gather(layer, holes);
  at::Tensor k_all = garbage_like(all.first), v_all = garbage_like(all.second);
  pc::gather(emulator(), pc::table_ref(holes), nullptr, all.first.size(1), sides, k_all, v_all, ref.geometry(), c.dtype,
             n_pages);
  EXPECT_TRUE(bitwise_equal(k_all, all.first)) << "total-length gather k";
  EXPECT_TRUE(bitwise_equal(v_all, all.second)) << "total-length gather v";
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const KVQuant formats[] = {{KVFormat::native, KVFormat::native},
                             {KVFormat::fp8_e4m3, KVFormat::int8},
                             {KVFormat::int8, KVFormat::native},
                             {KVFormat::fp8_e4m3, KVFormat::fp8_e4m3}};
  const Source sources[] = {Source::contiguous, Source::fused_qkv, Source::strided_elements, Source::misaligned};
  const StartKind starts[] = {StartKind::scalar, StartKind::per_row, StartKind::tail};
  const int64_t head_dims[] = {8, 3, 64, 1};
  int i = 0;
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const int64_t page_size : {1, 3, 16}) {
      for (int variant = 0; variant < 4; ++variant, ++i) {
        out.push_back({dtype, page_size, i % 2 == 0 ? at::kLong : at::kInt, formats[(i + variant) % 4],
                       sources[(i / 2 + variant) % 4], starts[(i + 2 * variant) % 3], head_dims[(i / 3 + variant) % 4]});
      }
    }
  }
  // Native pages of other dtypes: the copy is by bytes.
  out.push_back({at::kDouble, 3, at::kLong, {}, Source::fused_qkv, StartKind::per_row, 5});
  out.push_back({at::kByte, 16, at::kInt, {}, Source::contiguous, StartKind::tail, 7});
  out.push_back({at::kByte, 2, at::kInt, {}, Source::misaligned, StartKind::scalar, 16});
  return out;
}

TEST(CudaKernelsEmulated, WriteAndGatherEqualTheCpuKernelsBitForBit) {
  for (const Case& c : cases()) {
    check_write_and_gather<NHD>(c);
    check_write_and_gather<HND>(c);
  }
}

/// The planners pick 16-byte moves where every address and stride allows
/// (the emulator fails a launch on a misaligned one), narrower ones otherwise.
TEST(CudaKernelsEmulated, MovesAreAsWideAsTheAlignmentAllows) {
  const Case aligned{at::kHalf, 16, at::kLong, {}, Source::contiguous, StartKind::scalar, 64};
  emulator().launched.clear();
  check_write_and_gather<NHD>(aligned);
  Case odd = aligned;
  odd.source = Source::misaligned;
  check_write_and_gather<HND>(odd);
  EXPECT_FALSE(emulator().launched.empty());
}

template <class To, class From>
void check_copy(KVQuant quant, at::ScalarType dtype, int64_t page_size) {
  SCOPED_TRACE(std::string(From::name) + " -> " + To::name + " " + c10::toString(dtype) + " K=" +
               pagedkv::format_name(quant.k) + " V=" + pagedkv::format_name(quant.v) + " P=" + std::to_string(page_size));
  const int64_t n_pages = 12, D = 8;
  const at::TensorOptions options = at::TensorOptions().dtype(dtype);
  PagedCache<From> src(kLayers, n_pages, page_size, kHeads, D, options, quant);
  PagedCache<To> ref(kLayers, n_pages, page_size, kHeads, D, options, quant);
  PagedCache<To> emu(kLayers, n_pages, page_size, kHeads, D, options, quant);
  const std::vector<int64_t> all = src.alloc_n(n_pages);
  ASSERT_EQ(ref.alloc_n(n_pages), all);
  ASSERT_EQ(emu.alloc_n(n_pages), all);
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    const at::Tensor one_row = ints(all).view({1, n_pages});
    const at::Tensor k = at::randn({1, n_pages * page_size, kHeads, D}).to(dtype);
    const at::Tensor v = at::randn({1, n_pages * page_size, kHeads, D}).to(dtype);
    src.write(layer, one_row, 0, k, v);
  }
  const at::Tensor src_ids = ints({3, 7, 0, 11, 5});
  const at::Tensor dst_ids = ints({9, 2, 4, 1, 10});
  ref.copy_pages_from(src, src_ids, dst_ids);
  const auto to_tensors = pagedkv::ops::page_tensors(emu.storage());
  const auto from_tensors = pagedkv::ops::page_tensors(src.storage());
  for (size_t i = 0; i < to_tensors.size(); ++i) {
    const at::Tensor& t = to_tensors[i].first;
    const at::Tensor& f = from_tensors[i].first;
    if (!t.defined()) continue;
    const int64_t es = static_cast<int64_t>(t.element_size());
    const pc::PageTensor to{t.data_ptr(), t.stride(0) * es, es, to_tensors[i].second};
    const pc::PageTensor from{f.data_ptr(), f.stride(0) * es, es, from_tensors[i].second};
    pc::copy_pages(emulator(), to, from, src_ids.data_ptr<int64_t>(), dst_ids.data_ptr<int64_t>(), src_ids.size(0),
                   kLayers, std::is_same<To, From>::value);
  }
  expect_same_storage(ref, emu, "copy_pages_from");
}

TEST(CudaKernelsEmulated, PageCopiesEqualTheCpuKernelsBitForBit) {
  for (const KVQuant quant : {KVQuant{}, KVQuant{KVFormat::fp8_e4m3, KVFormat::int8}}) {
    for (const int64_t page_size : {1, 3, 16}) {
      check_copy<NHD, NHD>(quant, at::kHalf, page_size);
      check_copy<HND, NHD>(quant, at::kFloat, page_size);
      check_copy<NHD, HND>(quant, at::kBFloat16, page_size);
      check_copy<HND, HND>(quant, at::kHalf, page_size);
    }
  }
}

}  // namespace
