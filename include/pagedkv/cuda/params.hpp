// The kernels' arguments: one struct per kernel family, passed by value as
// the kernel's only argument. Each struct is declared once, as an X-macro
// list of fields, and rendered twice: as the host's struct (here) and as
// text that opens every NVRTC program (params_source()), so the two can
// never disagree on names or order. Every field is 8 bytes (pointers,
// int64, double) or a struct made only of such fields: there is no padding
// on either side, so equal field sizes in equal order mean equal offsets.
// params_source() ends with static_asserts of every struct's and field's
// size as the host sees them, which NVRTC checks when it compiles (the CI
// compile test compiles every kernel).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pagedkv {
namespace cuda {
namespace params {

// The dialect's 64-bit integer (sources/prelude.hpp: long long), as the
// host spells it: int64_t, so that host pointers convert without casts.
using pkv_i64 = std::int64_t;
static_assert(sizeof(pkv_i64) == sizeof(long long), "pkv_i64 is 64-bit on both sides");

// clang-format off
/// A page table [rows, cols], int32 or int64, strided (elements).
#define PAGEDKV_CUDA_TABLE_REF(F) \
  F(const void*, data)            \
  F(pkv_i64, rows)                \
  F(pkv_i64, cols)                \
  F(pkv_i64, row_stride)          \
  F(pkv_i64, col_stride)          \
  F(pkv_i64, is_int32)

/// A token-major [B, S or T, H, D] tensor: its data and byte strides.
#define PAGEDKV_CUDA_TOKENS_REF(F) \
  F(void*, data)                   \
  F(pkv_i64, batch)                \
  F(pkv_i64, token)                \
  F(pkv_i64, head)                 \
  F(pkv_i64, elem)

/// One layer of one side's pages: [n_pages, <page>] elements or codes
/// (byte strides) and, quantized, the scales [n_pages, P * H] (float strides).
#define PAGEDKV_CUDA_PAGES_REF(F) \
  F(void*, data)                  \
  F(pkv_i64, page_bytes)          \
  F(pkv_i64, token_bytes)         \
  F(pkv_i64, head_bytes)          \
  F(float*, scales)               \
  F(pkv_i64, scale_page)          \
  F(pkv_i64, scale_token)         \
  F(pkv_i64, scale_head)

/// write: token s of sequence b goes to position start(b) + s, where
/// start(b) = starts[b], else tail_lengths[b] - n_tokens, else `start`.
#define PAGEDKV_CUDA_WRITE_PARAMS(F) \
  F(TableRef, table)                 \
  F(TokensRef, k_src)                \
  F(TokensRef, v_src)                \
  F(PagesRef, k_pages)               \
  F(PagesRef, v_pages)               \
  F(const pkv_i64*, starts)          \
  F(const pkv_i64*, tail_lengths)    \
  F(pkv_i64, start)                  \
  F(pkv_i64, batch)                  \
  F(pkv_i64, n_tokens)               \
  F(pkv_i64, n_heads)                \
  F(pkv_i64, head_dim)               \
  F(pkv_i64, elem_size)              \
  F(pkv_i64, page_size)              \
  F(pkv_i64, page_shift)             \
  F(pkv_i64, n_pages)                \
  F(pkv_i64, row_vec)                \
  F(pkv_i64, lanes)                  \
  F(pkv_i64, first_side)

/// gather: positions [0, length(b)) of sequence b into [B, T, H, D];
/// length(b) = lengths[b], else `length`. The rest, and unmapped pages, are zeros.
#define PAGEDKV_CUDA_GATHER_PARAMS(F) \
  F(TableRef, table)                  \
  F(PagesRef, k_pages)                \
  F(PagesRef, v_pages)                \
  F(TokensRef, k_out)                 \
  F(TokensRef, v_out)                 \
  F(const pkv_i64*, lengths)          \
  F(pkv_i64, length)                  \
  F(pkv_i64, n_tokens)                \
  F(pkv_i64, batch)                   \
  F(pkv_i64, n_heads)                 \
  F(pkv_i64, head_dim)                \
  F(pkv_i64, elem_size)               \
  F(pkv_i64, page_size)               \
  F(pkv_i64, page_shift)              \
  F(pkv_i64, n_pages)                 \
  F(pkv_i64, row_vec)                 \
  F(pkv_i64, lanes)                   \
  F(pkv_i64, first_side)

/// copy_pages: for every layer, page dst_ids[i] of dst <- page src_ids[i]
/// of src (ids null: page i), each page `tokens` x `heads` rows of
/// `row_bytes`, relaid out through the strides.
#define PAGEDKV_CUDA_COPY_PARAMS(F) \
  F(const void*, src)               \
  F(void*, dst)                     \
  F(const pkv_i64*, src_ids)        \
  F(const pkv_i64*, dst_ids)        \
  F(pkv_i64, n)                     \
  F(pkv_i64, n_layers)              \
  F(pkv_i64, src_layer_bytes)       \
  F(pkv_i64, dst_layer_bytes)       \
  F(pkv_i64, src_page_bytes)        \
  F(pkv_i64, dst_page_bytes)        \
  F(pkv_i64, tokens)                \
  F(pkv_i64, heads)                 \
  F(pkv_i64, row_bytes)             \
  F(pkv_i64, src_token)             \
  F(pkv_i64, src_head)              \
  F(pkv_i64, dst_token)             \
  F(pkv_i64, dst_head)              \
  F(pkv_i64, row_vec)               \
  F(pkv_i64, lanes)

/// paged attention (split kernels and their merge). The options as
/// AttentionOptions says: window (0: none), softcap (0: none), sinks
/// [n_heads] floats (element stride sinks_stride; null: none), tree_mask
/// [batch, n_queries, n_queries] bools (byte strides mask_batch, mask_query,
/// mask_key; null: causal among the new tokens).
#define PAGEDKV_CUDA_ATTENTION_PARAMS(F) \
  F(TableRef, table)                     \
  F(const pkv_i64*, lengths)             \
  F(TokensRef, q)                        \
  F(void*, out)                          \
  F(float*, partials)                    \
  F(PagesRef, k)                         \
  F(PagesRef, v)                         \
  F(double, scale)                       \
  F(pkv_i64, window)                     \
  F(double, softcap)                     \
  F(const float*, sinks)                 \
  F(pkv_i64, sinks_stride)               \
  F(const void*, tree_mask)              \
  F(pkv_i64, mask_batch)                 \
  F(pkv_i64, mask_query)                 \
  F(pkv_i64, mask_key)                   \
  F(pkv_i64, dtype)                      \
  F(pkv_i64, k_format)                   \
  F(pkv_i64, v_format)                   \
  F(pkv_i64, batch)                      \
  F(pkv_i64, n_queries)                  \
  F(pkv_i64, n_heads)                    \
  F(pkv_i64, n_kv_heads)                 \
  F(pkv_i64, group)                      \
  F(pkv_i64, head_dim)                   \
  F(pkv_i64, page_size)                  \
  F(pkv_i64, page_shift)                 \
  F(pkv_i64, n_pages)                    \
  F(pkv_i64, split_tokens)               \
  F(pkv_i64, n_splits)                   \
  F(pkv_i64, query_tile)                 \
  F(pkv_i64, n_query_tiles)              \
  F(pkv_i64, head_tile)                  \
  F(pkv_i64, n_head_tiles)               \
  F(pkv_i64, key_tile)
// clang-format on

#define PAGEDKV_CUDA_FIELD(type, name) type name;

/// See PAGEDKV_CUDA_TABLE_REF.
struct TableRef {
  PAGEDKV_CUDA_TABLE_REF(PAGEDKV_CUDA_FIELD)
};
/// See PAGEDKV_CUDA_TOKENS_REF.
struct TokensRef {
  PAGEDKV_CUDA_TOKENS_REF(PAGEDKV_CUDA_FIELD)
};
/// See PAGEDKV_CUDA_PAGES_REF.
struct PagesRef {
  PAGEDKV_CUDA_PAGES_REF(PAGEDKV_CUDA_FIELD)
};
/// See PAGEDKV_CUDA_WRITE_PARAMS.
struct WriteParams {
  PAGEDKV_CUDA_WRITE_PARAMS(PAGEDKV_CUDA_FIELD)
};
/// See PAGEDKV_CUDA_GATHER_PARAMS.
struct GatherParams {
  PAGEDKV_CUDA_GATHER_PARAMS(PAGEDKV_CUDA_FIELD)
};
/// See PAGEDKV_CUDA_COPY_PARAMS.
struct CopyParams {
  PAGEDKV_CUDA_COPY_PARAMS(PAGEDKV_CUDA_FIELD)
};
/// See PAGEDKV_CUDA_ATTENTION_PARAMS.
struct AttentionParams {
  PAGEDKV_CUDA_ATTENTION_PARAMS(PAGEDKV_CUDA_FIELD)
};

// Every field a multiple of 8 bytes, 8-aligned: no padding anywhere.
#define PAGEDKV_CUDA_FIELD_IS_WORDS(type, name) \
  static_assert(sizeof(type) % 8 == 0 && alignof(type) == 8, "kernel parameter fields are 8-byte words");
PAGEDKV_CUDA_TABLE_REF(PAGEDKV_CUDA_FIELD_IS_WORDS)
PAGEDKV_CUDA_TOKENS_REF(PAGEDKV_CUDA_FIELD_IS_WORDS)
PAGEDKV_CUDA_PAGES_REF(PAGEDKV_CUDA_FIELD_IS_WORDS)
PAGEDKV_CUDA_WRITE_PARAMS(PAGEDKV_CUDA_FIELD_IS_WORDS)
PAGEDKV_CUDA_GATHER_PARAMS(PAGEDKV_CUDA_FIELD_IS_WORDS)
PAGEDKV_CUDA_COPY_PARAMS(PAGEDKV_CUDA_FIELD_IS_WORDS)
PAGEDKV_CUDA_ATTENTION_PARAMS(PAGEDKV_CUDA_FIELD_IS_WORDS)
#undef PAGEDKV_CUDA_FIELD_IS_WORDS

namespace detail {

#define PAGEDKV_CUDA_FIELD_TEXT(type, name) "  " #type " " #name ";\n"

/// `struct name { fields };` followed by the host's sizes as static_asserts.
template <class Struct>
std::string struct_source(const char* name, const char* fields, const std::string& field_asserts) {
  return std::string("struct ") + name + " {\n" + fields + "};\nstatic_assert(sizeof(" + name +
         ") == " + std::to_string(sizeof(Struct)) + ", \"pagedkv: " + name +
         " differs between the host and the device\");\n" + field_asserts;
}

}  // namespace detail

/// The parameter structs as kernel source, in namespace pkv, with the
/// host's struct and field sizes asserted.
inline std::string params_source() {
  std::string out = "namespace pkv {\n";
#define PAGEDKV_CUDA_FIELD_ASSERT(type, name)                                                            \
  asserts += std::string("static_assert(sizeof(") + current + "::" #name ") == " +                      \
             std::to_string(sizeof(static_cast<Current*>(nullptr)->name)) + ", \"pagedkv: " + current + \
             "::" #name " differs between the host and the device\");\n";
#define PAGEDKV_CUDA_STRUCT_SOURCE(Struct, LIST)                                                         \
  {                                                                                                      \
    using Current = Struct;                                                                              \
    const char* current = #Struct;                                                                       \
    std::string asserts;                                                                                 \
    LIST(PAGEDKV_CUDA_FIELD_ASSERT)                                                                      \
    out += detail::struct_source<Struct>(#Struct, LIST(PAGEDKV_CUDA_FIELD_TEXT), asserts);               \
  }
  PAGEDKV_CUDA_STRUCT_SOURCE(TableRef, PAGEDKV_CUDA_TABLE_REF)
  PAGEDKV_CUDA_STRUCT_SOURCE(TokensRef, PAGEDKV_CUDA_TOKENS_REF)
  PAGEDKV_CUDA_STRUCT_SOURCE(PagesRef, PAGEDKV_CUDA_PAGES_REF)
  PAGEDKV_CUDA_STRUCT_SOURCE(WriteParams, PAGEDKV_CUDA_WRITE_PARAMS)
  PAGEDKV_CUDA_STRUCT_SOURCE(GatherParams, PAGEDKV_CUDA_GATHER_PARAMS)
  PAGEDKV_CUDA_STRUCT_SOURCE(CopyParams, PAGEDKV_CUDA_COPY_PARAMS)
  PAGEDKV_CUDA_STRUCT_SOURCE(AttentionParams, PAGEDKV_CUDA_ATTENTION_PARAMS)
#undef PAGEDKV_CUDA_STRUCT_SOURCE
#undef PAGEDKV_CUDA_FIELD_ASSERT
  return out + "}  // namespace pkv\n";
}

#undef PAGEDKV_CUDA_FIELD_TEXT

/// Declares the parameter structs in the current namespace (the emulator
/// compiles the kernel sources in namespace pkv, as NVRTC does).
#define PAGEDKV_CUDA_USING_KERNEL_PARAMS                   \
  using ::pagedkv::cuda::params::TableRef;        \
  using ::pagedkv::cuda::params::TokensRef;       \
  using ::pagedkv::cuda::params::PagesRef;        \
  using ::pagedkv::cuda::params::WriteParams;     \
  using ::pagedkv::cuda::params::GatherParams;    \
  using ::pagedkv::cuda::params::CopyParams;      \
  using ::pagedkv::cuda::params::AttentionParams;

}  // namespace params
}  // namespace cuda
}  // namespace pagedkv
