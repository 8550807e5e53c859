// Kernel source shared by every kernel: element kinds, the logical dtypes'
// conversions and the quantized pages' codecs, bit for bit those of the CPU
// (quant/scalar.hpp, c10::Half, c10::BFloat16), page-table lookups and the
// row copies. In the kernel dialect (sources/prelude.hpp).
//
// Bit-exactness with the CPU, including NaN: an x86 CPU returns the first
// NaN operand (quieted) from an arithmetic operation, or the "default NaN"
// 0xFFC00000 when it creates one (0 * inf, inf / inf); a GPU returns
// 0x7FFFFFFF either way. The codecs use x86_product / x86_quotient, which
// give the x86 result, so that codes and dequantized values match the
// CPU's for NaN and infinite inputs too.
#pragma once

#include "pagedkv/cuda/source_text.hpp"

namespace pagedkv {
namespace cuda {
namespace sources {

// clang-format off
inline constexpr SourceText kCommon{"pagedkv/cuda/sources/common.hpp", __LINE__, R"PAGEDKV(
namespace pkv {

/// The logical dtype (a kernel template argument): the host's DtypeId.
enum : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
/// How a side is stored (a kernel template argument): pagedkv::KVFormat's values.
enum : int { kNative = 0, kFp8 = 1, kInt8 = 2 };

constexpr pkv_u32 kPositiveInfinityBits = 0x7F800000u;
constexpr pkv_u32 kX86DefaultNanBits = 0xFFC00000u;

PKV_DEVICE bool is_nan(float x) { return (pkv_float_bits(x) & 0x7FFFFFFFu) > kPositiveInfinityBits; }
PKV_DEVICE float negative_infinity() { return pkv_bits_float(0xFF800000u); }

/// The NaN an x86 CPU gives for an operation whose exact result is NaN.
PKV_DEVICE float x86_nan(float a, float b) {
  if (is_nan(a)) return pkv_bits_float(pkv_float_bits(a) | 0x00400000u);
  if (is_nan(b)) return pkv_bits_float(pkv_float_bits(b) | 0x00400000u);
  return pkv_bits_float(kX86DefaultNanBits);
}
/// a * b, exactly rounded, with an x86 CPU's NaN.
PKV_DEVICE float x86_product(float a, float b) {
  const float r = pkv_mul_rn(a, b);
  return is_nan(r) ? x86_nan(a, b) : r;
}
/// a / b, exactly rounded, with an x86 CPU's NaN.
PKV_DEVICE float x86_quotient(float a, float b) {
  const float r = pkv_div_rn(a, b);
  return is_nan(r) ? x86_nan(a, b) : r;
}

// ---- the logical dtypes ----

/// IEEE half (bits) -> float, exact, NaN payloads kept and quieted (as
/// c10::Half and F16C convert).
PKV_DEVICE float half_to_float(pkv_u16 h) {
  const pkv_u32 sign = static_cast<pkv_u32>(h & 0x8000u) << 16;
  const pkv_u32 exponent = (h >> 10) & 0x1Fu;
  const pkv_u32 mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) {
    return pkv_bits_float(sign | kPositiveInfinityBits | (mantissa << 13) | (mantissa != 0 ? 0x00400000u : 0u));
  }
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact in float32
    const float magnitude = pkv_mul_rn(static_cast<float>(static_cast<pkv_i32>(mantissa)), pkv_bits_float(0x33800000u));
    return pkv_bits_float(sign | pkv_float_bits(magnitude));
  }
  return pkv_bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/// float -> IEEE half (bits), round to nearest even, overflow to infinity,
/// NaN to sign | 0x7E00: c10::Half(float).
PKV_DEVICE pkv_u16 float_to_half(float f) {
  const pkv_u32 u = pkv_float_bits(f);
  const pkv_u32 sign = (u >> 16) & 0x8000u;
  const pkv_u32 a = u & 0x7FFFFFFFu;
  if (a > kPositiveInfinityBits) return static_cast<pkv_u16>(sign | 0x7E00u);
  if (a >= 0x477FF000u) return static_cast<pkv_u16>(sign | 0x7C00u);  // >= 65520 rounds to infinity
  if (a >= 0x38800000u) {  // a normal half (>= 2^-14): drop 13 mantissa bits, ties to even
    const pkv_u32 rounded = (a + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
    return static_cast<pkv_u16>(sign | (rounded - (112u << 10)));
  }
  const pkv_u32 exponent = a >> 23;
  if (exponent < 102u) return static_cast<pkv_u16>(sign);  // below 2^-25: rounds to zero
  // A subnormal half: the value in units of 2^-24, rounded to nearest even.
  const pkv_u32 mantissa = (a & 0x007FFFFFu) | 0x00800000u;
  const pkv_u32 shift = 126u - exponent;  // 14 .. 24
  const pkv_u32 kept = mantissa >> shift;
  const pkv_u32 rest = mantissa & ((1u << shift) - 1u);
  const pkv_u32 half_way = 1u << (shift - 1u);
  const pkv_u32 up = (rest > half_way || (rest == half_way && (kept & 1u) != 0)) ? 1u : 0u;
  return static_cast<pkv_u16>(sign | (kept + up));
}

PKV_DEVICE float bf16_to_float(pkv_u16 b) { return pkv_bits_float(static_cast<pkv_u32>(b) << 16); }

/// float -> bfloat16 (bits), round to nearest even, NaN to 0x7FC0: c10::BFloat16(float).
PKV_DEVICE pkv_u16 float_to_bf16(float f) {
  const pkv_u32 u = pkv_float_bits(f);
  if ((u & 0x7FFFFFFFu) > kPositiveInfinityBits) return 0x7FC0u;
  return static_cast<pkv_u16>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/// The logical dtype kT: its size, and its values to and from float32.
template <int kT>
struct Dtype;
template <>
struct Dtype<kFloat32> {
  static constexpr int kBytes = 4;
  static PKV_DEVICE float load(const void* p) { return pkv_bits_float(pkv_load_u32(p)); }
  static PKV_DEVICE void store(void* p, float x) { pkv_store_u32(p, pkv_float_bits(x)); }
};
template <>
struct Dtype<kFloat16> {
  static constexpr int kBytes = 2;
  static PKV_DEVICE float load(const void* p) { return half_to_float(pkv_load_u16(p)); }
  static PKV_DEVICE void store(void* p, float x) { pkv_store_u16(p, float_to_half(x)); }
};
template <>
struct Dtype<kBFloat16> {
  static constexpr int kBytes = 2;
  static PKV_DEVICE float load(const void* p) { return bf16_to_float(pkv_load_u16(p)); }
  static PKV_DEVICE void store(void* p, float x) { pkv_store_u16(p, float_to_bf16(x)); }
};

// ---- the codecs of quantized pages (quant/scalar.hpp) ----

constexpr float kFp8Max = 448.0f;
constexpr float kInt8Max = 127.0f;

template <int kF>
PKV_DEVICE float format_max() { return kF == kInt8 ? kInt8Max : kFp8Max; }

/// fp8 e4m3 code of y: round to nearest even, saturating, NaN to +-0.
PKV_DEVICE pkv_u8 encode_e4m3(float y) {
  const pkv_u32 bits = pkv_float_bits(y);
  const pkv_u32 sign = (bits >> 24) & 0x80u;
  const pkv_u32 abs_bits = bits & 0x7FFFFFFFu;
  const float a = pkv_bits_float(abs_bits);
  const pkv_u32 rounded = (abs_bits + 0x7FFFFu + ((abs_bits >> 20) & 1u)) >> 20;
  const pkv_u32 normal = rounded - (120u << 3);
  const float small = a < 0.015625f ? a : 0.015625f;  // 2^-6
  const pkv_u32 subnormal = static_cast<pkv_u32>(static_cast<pkv_i32>(pkv_rint(pkv_mul_rn(small, 512.0f))));
  pkv_u32 magnitude = a < 0.015625f ? subnormal : normal;
  magnitude = a >= kFp8Max ? 0x7Eu : magnitude;
  magnitude = abs_bits > kPositiveInfinityBits ? 0u : magnitude;
  return static_cast<pkv_u8>(sign | magnitude);
}

/// The value of an fp8 e4m3 code (NaN for 0x7F and 0xFF), exact.
PKV_DEVICE float decode_e4m3(pkv_u8 code) {
  const pkv_u32 c = code;
  const pkv_u32 sign = (c & 0x80u) << 24;
  const pkv_u32 normal = sign | (((c & 0x7Fu) << 20) + (120u << 23));
  const pkv_u32 subnormal =
      sign | pkv_float_bits(pkv_mul_rn(static_cast<float>(static_cast<pkv_i32>(c & 7u)), 0.001953125f));  // 2^-9
  pkv_u32 bits = (c & 0x78u) == 0u ? subnormal : normal;
  bits = (c & 0x7Fu) == 0x7Fu ? 0x7FC00000u : bits;
  return pkv_bits_float(bits);
}

/// int8 code of y: round to nearest even, clamped to [-127, 127], NaN to 0.
PKV_DEVICE pkv_i8 encode_int8(float y) {
  float r = y > kInt8Max ? kInt8Max : y;
  r = r < -kInt8Max ? -kInt8Max : r;
  r = pkv_rint(r);
  r = is_nan(r) ? 0.0f : r;
  return static_cast<pkv_i8>(static_cast<pkv_i32>(r));
}

/// The code of x / scale (scale > 0) in format kF, as a byte.
template <int kF>
PKV_DEVICE pkv_u8 encode(float x, float scale) {
  if (kF == kInt8) return static_cast<pkv_u8>(encode_int8(pkv_div_rn(x, scale)));
  return encode_e4m3(x86_quotient(x, scale));
}

/// decode(code) * scale, as the CPU's gather computes it.
template <int kF>
PKV_DEVICE float dequantize(pkv_u8 code, float scale) {
  const float value = kF == kInt8 ? static_cast<float>(static_cast<pkv_i32>(static_cast<pkv_i8>(code)))
                                  : decode_e4m3(code);
  return x86_product(value, scale);
}

// ---- page tables and positions ----

/// Entry (row, col) of a page table.
PKV_DEVICE pkv_i64 table_at(const TableRef& t, pkv_i64 row, pkv_i64 col) {
  const pkv_i64 i = row * t.row_stride + col * t.col_stride;
  const char* base = static_cast<const char*>(t.data);
  return t.is_int32 != 0 ? static_cast<pkv_i64>(pkv_load_i32(base + i * 4)) : pkv_load_i64(base + i * 8);
}

/// position / page_size and position % page_size (position >= 0): a shift
/// for a power-of-two page size, a 32-bit division while both fit.
struct PagePosition {
  pkv_i64 column;
  pkv_i64 slot;
};
PKV_DEVICE PagePosition page_position(pkv_i64 position, pkv_i64 page_size, pkv_i64 page_shift) {
  PagePosition r;
  if (page_shift >= 0) {
    r.column = position >> page_shift;
  } else if ((position >> 31) == 0 && (page_size >> 31) == 0) {
    r.column = static_cast<pkv_i64>(static_cast<pkv_u32>(position) / static_cast<pkv_u32>(page_size));
  } else {
    r.column = position / page_size;
  }
  r.slot = position - r.column * page_size;
  return r;
}

/// The page holding `position` of row `row`, or -1 when the position is out
/// of the table or the entry is not a page of the pool. Validated calls
/// never see -1 where they read or write; a replayed CUDA graph whose new
/// bind broke its assumptions skips such positions instead of corrupting
/// memory.
PKV_DEVICE pkv_i64 page_of(const TableRef& t, pkv_i64 row, pkv_i64 position, pkv_i64 page_size, pkv_i64 page_shift,
                            pkv_i64 n_pages, pkv_i64* slot) {
  if (position < 0) return -1;
  const PagePosition p = page_position(position, page_size, page_shift);
  *slot = p.slot;
  if (p.column >= t.cols) return -1;
  const pkv_i64 page = table_at(t, row, p.column);
  return page >= 0 && page < n_pages ? page : -1;
}

// ---- row copies ----

/// Lane `lane` of `lanes` copies its share of a row of `bytes`, `vec`
/// bytes at a time (16, 8, 4, 2 or 1; `bytes` and both addresses multiples
/// of it).
PKV_DEVICE void copy_row(unsigned char* dst, const unsigned char* src, pkv_i64 bytes, pkv_i64 vec, pkv_i64 lane,
                         pkv_i64 lanes) {
  const pkv_i64 step = lanes * vec;
  pkv_i64 i = lane * vec;
  switch (vec) {
    case 16: for (; i < bytes; i += step) pkv_store_v16(dst + i, pkv_load_v16(src + i)); break;
    case 8: for (; i < bytes; i += step) pkv_store_v8(dst + i, pkv_load_v8(src + i)); break;
    case 4: for (; i < bytes; i += step) pkv_store_u32(dst + i, pkv_load_u32(src + i)); break;
    case 2: for (; i < bytes; i += step) pkv_store_u16(dst + i, pkv_load_u16(src + i)); break;
    default: for (; i < bytes; i += step) pkv_store_u8(dst + i, pkv_load_u8(src + i)); break;
  }
}

/// Lane `lane` of `lanes` copies its share of `n` elements of `elem_size`
/// bytes, `src_stride` bytes apart in the source (a row that is not
/// contiguous), to consecutive elements of `dst`.
PKV_DEVICE void copy_strided_row(unsigned char* dst, const unsigned char* src, pkv_i64 n, pkv_i64 elem_size,
                                 pkv_i64 src_stride, pkv_i64 lane, pkv_i64 lanes) {
  for (pkv_i64 e = lane; e < n; e += lanes) {
    const unsigned char* from = src + e * src_stride;
    unsigned char* to = dst + e * elem_size;
    switch (elem_size) {
      case 8: pkv_store_u64(to, pkv_load_u64(from)); break;
      case 4: pkv_store_u32(to, pkv_load_u32(from)); break;
      case 2: pkv_store_u16(to, pkv_load_u16(from)); break;
      default:
        for (pkv_i64 b = 0; b < elem_size; ++b) pkv_store_u8(to + b, pkv_load_u8(from + b));
        break;
    }
  }
}

/// Lane `lane` of `lanes` zeroes its share of a row of `bytes` (`vec` as in copy_row).
PKV_DEVICE void zero_row(unsigned char* dst, pkv_i64 bytes, pkv_i64 vec, pkv_i64 lane, pkv_i64 lanes) {
  const pkv_i64 step = lanes * vec;
  pkv_i64 i = lane * vec;
  switch (vec) {
    case 16: {
      pkv_v16 z;
      z.x = z.y = z.z = z.w = 0u;
      for (; i < bytes; i += step) pkv_store_v16(dst + i, z);
      break;
    }
    case 8: {
      pkv_v8 z;
      z.x = z.y = 0u;
      for (; i < bytes; i += step) pkv_store_v8(dst + i, z);
      break;
    }
    case 4: for (; i < bytes; i += step) pkv_store_u32(dst + i, 0u); break;
    case 2: for (; i < bytes; i += step) pkv_store_u16(dst + i, 0u); break;
    default: for (; i < bytes; i += step) pkv_store_u8(dst + i, 0u); break;
  }
}

/// max over the `lanes` lanes of an aligned group of a warp (lanes a power
/// of two <= 32; every lane of the warp calls it). Exact in any order.
PKV_DEVICE float group_max(float v, int lanes) {
  for (int offset = lanes / 2; offset >= 1; offset /= 2) {
    const float other = pkv_shfl_xor(v, offset);
    v = other > v ? other : v;
  }
  return v;
}
/// Sum over the `lanes` lanes of an aligned group of a warp.
PKV_DEVICE float group_sum(float v, int lanes) {
  for (int offset = lanes / 2; offset >= 1; offset /= 2) v += pkv_shfl_xor(v, offset);
  return v;
}

/// The items a block's thread groups take: groups of `lanes` threads (a
/// power of two <= 32, so a group never spans two warps), item
/// `first + group` then every `stride` items.
struct ItemGroups {
  pkv_i64 lanes;
  pkv_i64 lane;
  pkv_i64 group;
  pkv_i64 first;
  pkv_i64 stride;
};
PKV_DEVICE ItemGroups item_groups(pkv_i64 lanes) {
  ItemGroups g;
  const pkv_i64 per_block = static_cast<pkv_i64>(pkv_ntid()) / lanes;
  g.lanes = lanes;
  g.lane = static_cast<pkv_i64>(pkv_tid()) % lanes;
  g.group = static_cast<pkv_i64>(pkv_tid()) / lanes;
  g.first = static_cast<pkv_i64>(pkv_bid_x()) * per_block;
  g.stride = static_cast<pkv_i64>(pkv_nbid_x()) * per_block;
  return g;
}

/// Lane `lane` of `lanes` copies its share of `heads` rows of `row_bytes`
/// (`vec` as in copy_row): one run when both sides hold the rows back to
/// back (a token of NHD pages and of a contiguous tensor), else the lanes
/// split over the rows, as many on each as it has moves (up to `lanes`).
PKV_DEVICE void copy_heads(unsigned char* dst, pkv_i64 dst_head, const unsigned char* src, pkv_i64 src_head,
                           pkv_i64 heads, pkv_i64 row_bytes, pkv_i64 vec, pkv_i64 lane, pkv_i64 lanes) {
  if (dst_head == row_bytes && src_head == row_bytes) {
    copy_row(dst, src, heads * row_bytes, vec, lane, lanes);
    return;
  }
  const pkv_i64 moves = row_bytes / vec;
  pkv_i64 per_head = lanes;
  while (per_head > 1 && per_head > moves) per_head /= 2;
  for (pkv_i64 h = lane / per_head; h < heads; h += lanes / per_head) {
    copy_row(dst + h * dst_head, src + h * src_head, row_bytes, vec, lane % per_head, per_head);
  }
}

}  // namespace pkv
)PAGEDKV"};
// clang-format on

}  // namespace sources
}  // namespace cuda
}  // namespace pagedkv
