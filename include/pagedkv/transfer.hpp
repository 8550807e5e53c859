// Page transfer between processes over a torch c10d process group (Gloo on
// the CPU, NCCL on CUDA): disaggregated prefill/decode and tensor
// parallelism. pagedkv builds no transport: it only calls the group's
// send/recv, so this header is not part of the umbrella pagedkv.hpp (users
// who do not transfer never pull in c10d).
//
// Wire protocol (one transfer, sender S -> receiver R; tags in transfer_wire)
//   1. S -> R  header: kHeaderWords int64 (fixed size in every version, so the
//              receiver never posts a buffer of a size it guessed).
//   2. R -> S  reply: kReplyWords int64, accept or the reason for a reject.
//              R validates the header and allocates its pages before it
//              accepts; a rejected transfer leaves no message in flight, so
//              the group stays usable.
//   3. S -> R  payload, one message per layer (k then v of every page, the
//              head slice only, in the sender's page layout); R posts buffers
//              of exactly the sizes the header announced. A cache with a
//              quantized side sends bytes instead: per layer the k and v
//              sections (codes, or the native side's elements), then the
//              scales of each quantized side, every section starting at a
//              multiple of transfer_wire::kSectionAlign bytes.
// The payload lands in a staging buffer and is copied into the receiver's
// fresh pages only once every message has arrived: no page is ever half
// written, and on any failure the fresh pages are freed.
//
// Failure model: every call takes a timeout (one deadline for the whole
// call). A mismatch, a wrong transfer id or a short receiver pool is
// detected from the header: both sides throw c10::Error naming the cause
// and the group stays usable. After a timeout or a dead peer, messages may
// still be in flight: the engine must destroy the group and build a new
// one before it transfers again on it (Gloo's pairs are broken by then).
// Between one sender and one receiver, transfers are received in the order
// they are sent (a receiver expecting another id rejects the header).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "pagedkv/checks.hpp"
#include "pagedkv/kernels.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/page_copy.hpp"
#include "pagedkv/paged_cache.hpp"
#include "pagedkv/sequences.hpp"

namespace pagedkv {

/// A range [begin, end) of kv heads; end = -1 means every head.
struct HeadRange {
  int64_t begin = 0;
  int64_t end = -1;
};

/// The kv heads rank `tp_rank` of a tensor-parallel group of `tp_size`
/// ranks holds: n_kv_heads / tp_size consecutive heads when tp_size divides
/// n_kv_heads; when tp_size > n_kv_heads (a multiple of it), each head is
/// replicated on tp_size / n_kv_heads consecutive ranks and a rank holds one.
inline HeadRange tp_head_range(int64_t n_kv_heads, int64_t tp_size, int64_t tp_rank) {
  const checks::Caller caller{"tp_head_range", nullptr, nullptr};
  checks::positive(caller, "n_kv_heads", n_kv_heads);
  checks::positive(caller, "tp_size", tp_size);
  TORCH_CHECK_INDEX(tp_rank >= 0 && tp_rank < tp_size, caller, ": argument 'tp_rank' expected in [0, ", tp_size,
                    "), got ", tp_rank);
  if (tp_size <= n_kv_heads) {
    TORCH_CHECK(n_kv_heads % tp_size == 0, caller, ": argument 'tp_size' expected a divisor of n_kv_heads ",
                n_kv_heads, " (or a multiple of it), got ", tp_size);
    const int64_t width = n_kv_heads / tp_size;
    return {tp_rank * width, (tp_rank + 1) * width};
  }
  TORCH_CHECK(tp_size % n_kv_heads == 0, caller, ": argument 'tp_size' expected a multiple of n_kv_heads ",
              n_kv_heads, " (or a divisor of it), got ", tp_size);
  const int64_t head = tp_rank / (tp_size / n_kv_heads);
  return {head, head + 1};
}

/// One message of a resharding plan: sender rank `src_rank` of the source
/// TP group sends `heads` (indices into its own kv heads, ready for
/// send_pages) to rank `dst_rank` of the destination TP group.
struct HeadRoute {
  // cppcheck-suppress unusedStructMember ; read by engines, not by pagedkv
  int64_t src_rank;
  // cppcheck-suppress unusedStructMember ; read by engines, not by pagedkv
  int64_t dst_rank;
  // cppcheck-suppress unusedStructMember ; read by engines, not by pagedkv
  HeadRange heads;
};

/// The routes that give every destination rank its heads
/// (tp_head_range(n_kv_heads, dst_tp, dst_rank)) from the source ranks of a
/// group of src_tp ranks, one route per destination rank: a destination's
/// heads must all sit on one source rank (src_tp <= dst_tp, or replicated
/// heads); for src_tp > dst_tp each receiver would need several senders'
/// slices, which recv_pages (one transfer = all of the receiver's heads)
/// does not assemble, so that throws. Among the source ranks that hold the
/// heads, the lowest one sends.
inline std::vector<HeadRoute> tp_routes(int64_t n_kv_heads, int64_t src_tp, int64_t dst_tp) {
  const checks::Caller caller{"tp_routes", nullptr, nullptr};
  std::vector<HeadRoute> routes;
  for (int64_t dst = 0; dst < dst_tp; ++dst) {
    const HeadRange want = tp_head_range(n_kv_heads, dst_tp, dst);
    bool found = false;
    for (int64_t src = 0; src < src_tp && !found; ++src) {
      const HeadRange has = tp_head_range(n_kv_heads, src_tp, src);
      if (has.begin <= want.begin && want.end <= has.end) {
        routes.push_back({src, dst, {want.begin - has.begin, want.end - has.begin}});
        found = true;
      }
    }
    TORCH_CHECK(found, caller, ": expected destination rank ", dst, "'s kv heads [", want.begin, ", ", want.end,
                ") on one source rank, got src_tp ", src_tp, " and dst_tp ", dst_tp, " over ", n_kv_heads,
                " kv heads (each receiver needs one sender)");
  }
  return routes;
}

/// The wire format: fixed, versioned, documented for other implementations.
namespace transfer_wire {

constexpr int64_t kMagic = 0x564B444547415050;       // "PPAGEDKV" little-endian
constexpr int64_t kReplyMagic = 0x594C504556444B50;  // reply
constexpr int64_t kVersion = 1;
constexpr int64_t kHeaderWords = 32;  // never changes: a receiver of any version posts exactly this
constexpr int64_t kReplyWords = 4;
// c10d tags (engines that use send/recv on the same group for their own
// messages must avoid these three).
constexpr int kHeaderTag = 0x5044;
constexpr int kReplyTag = 0x5045;
constexpr int kPayloadTag = 0x5046;

/// Header word indices. Quantization travels in k_format / v_format (the
/// KVFormat values: 0 native, 1 fp8_e4m3, 2 int8) and the bytes of each
/// layer's scale sections in scale_bytes (0 for native pages, whose payload
/// is as it was before quantized pages travelled).
enum Field : int64_t {
  magic,
  version,
  transfer_id,
  n_layers,
  page_size,
  head_dim,
  sender_heads,  // the sender cache's n_kv_heads
  head_begin,    // the slice sent: [head_begin, head_end) of the sender's heads
  head_end,
  dtype,         // c10::ScalarType value of the logical dtype (what write takes)
  elem_size,     // of that dtype
  k_format,      // KVFormat value, 0 = native
  v_format,
  layout,        // of the payload's pages: 0 = NHD, 1 = HND
  n_tokens,
  n_pages,
  payload_bytes,  // all messages together
  scale_bytes,    // per layer: the scale sections of quantized pages, 0 for native ones
  first_reserved,  // this word up to the checksum: 0 in version 1
  checksum = kHeaderWords - 1,
};

/// Reply word indices and verdicts.
enum ReplyField : int64_t { reply_magic, verdict, reply_transfer_id, detail };
enum Verdict : int64_t { accept = 0, bad_header = 1, wrong_transfer_id = 2, mismatch = 3, short_pool = 4 };

inline int64_t checksum_of(const int64_t* words) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a over the words
  for (int64_t i = 0; i < checksum; ++i) {
    h ^= static_cast<uint64_t>(words[i]);
    h *= 0x100000001b3ULL;
  }
  return static_cast<int64_t>(h >> 1);
}

template <class Layout>
constexpr int64_t layout_code() {
  return std::is_same<Layout, HND>::value ? 1 : 0;
}

/// Byte strides of one payload page: `width` heads in the layout `code`.
inline kernels::BlockStrides page_strides(int64_t code, int64_t page_size, int64_t width, int64_t head_dim,
                                          int64_t es) {
  if (code == 1) return {head_dim * es, page_size * head_dim * es, es};
  return {width * head_dim * es, head_dim * es, es};
}

/// Sections of a quantized payload message (k, v, k scales, v scales) start
/// at multiples of this many bytes, so that each can be viewed as its
/// element type wherever it lies.
constexpr int64_t kSectionAlign = 16;

/// `bytes` rounded up to a multiple of kSectionAlign.
constexpr int64_t padded(int64_t bytes) { return (bytes + kSectionAlign - 1) / kSectionAlign * kSectionAlign; }

}  // namespace transfer_wire

namespace transfer_detail {

using Clock = std::chrono::steady_clock;

/// What went wrong on the wire, for the error message.
inline std::string describe_failure(const std::exception& e) {
  const std::string what = e.what();
  const bool timed_out = what.find("imed out") != std::string::npos || what.find("imeout") != std::string::npos;
  return (timed_out ? std::string("timeout (the peer did not answer in time): ")
                    : std::string("peer gone or connection failed: ")) +
         what.substr(0, what.find('\n')) + " (rebuild the process group before the next transfer)";
}

/// Waits for c10d works against one deadline; throws c10::Error (naming
/// `what`) on a timeout, a dead peer or an aborted work.
template <class Works>
void wait_all(const checks::Caller& caller, Works& works, Clock::time_point deadline, const std::string& what) {
  for (auto& work : works) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    bool ok = false;
    std::string cause;
    try {
      ok = left.count() > 0 && work->wait(left);
      if (!ok) cause = left.count() > 0 ? "aborted" : "timeout (the call's deadline passed)";
    } catch (const std::exception& e) {
      cause = describe_failure(e);
    }
    if (!ok) {
      for (auto& w : works) {
        try {
          w->abort();  // stop gloo waiting on buffers we are about to drop
        } catch (...) {  // NOLINT(bugprone-empty-catch): best effort, the failure below is what matters
        }
      }
      TORCH_CHECK(false, caller, ": ", what, ": ", cause);
    }
  }
}

template <class Group>
auto send_one(Group& group, at::Tensor t, int rank, int tag) {
  std::vector<at::Tensor> tensors{std::move(t)};
  return group.send(tensors, rank, tag);
}

template <class Group>
auto recv_one(Group& group, at::Tensor t, int rank, int tag) {
  std::vector<at::Tensor> tensors{std::move(t)};
  return group.recv(tensors, rank, tag);
}

template <class Group>
void peer_rank(const checks::Caller& caller, const char* arg, Group& group, int rank) {
  const int size = group.getSize();
  const int self = group.getRank();
  TORCH_CHECK_INDEX(rank >= 0 && rank < size && rank != self, caller, ": argument '", arg,
                    "' expected a rank of the group other than this one ([0, ", size, ") without ", self, "), got ",
                    rank);
}

inline void positive_timeout(const checks::Caller& caller, std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, caller, ": argument 'timeout' expected > 0 ms, got ", timeout.count(), " ms");
}

/// Bytes of one page's head slice.
inline int64_t slice_bytes(int64_t page_size, int64_t width, int64_t head_dim, int64_t es) {
  return page_size * width * head_dim * es;
}

/// Where the sections of one layer's message lie when the cache has a
/// quantized side (byte offsets into the message; transfer_wire).
struct LayerSections {
  int64_t elements[2];    ///< k, v: codes, or a native side's elements
  int64_t scales[2];      ///< k, v scales; -1 for a native side
  int64_t element_bytes[2];
  int64_t scale_bytes[2];  ///< 0 for a native side
  int64_t all_scale_bytes;  ///< both scale sections, padded: the header's scale_bytes
  int64_t bytes;            ///< the whole message
};

/// The sections of a message carrying n pages' slices of `width` heads.
template <class Layout>
LayerSections layer_sections(const PagedCache<Layout>& cache, int64_t n, int64_t width) {
  namespace w = transfer_wire;
  const at::Tensor* pages[2] = {&cache.k_cache(), &cache.v_cache()};
  const bool quantized[2] = {is_quantized(cache.quant().k), is_quantized(cache.quant().v)};
  LayerSections s{};
  int64_t at = 0;
  for (int kv = 0; kv < 2; ++kv) {
    s.elements[kv] = at;
    s.element_bytes[kv] = n * slice_bytes(cache.page_size(), width, cache.head_dim(),
                                          static_cast<int64_t>(pages[kv]->element_size()));
    at += w::padded(s.element_bytes[kv]);
  }
  const int64_t scales_begin = at;
  for (int kv = 0; kv < 2; ++kv) {
    s.scales[kv] = quantized[kv] ? at : -1;
    s.scale_bytes[kv] = quantized[kv] ? n * slice_bytes(cache.page_size(), width, 1, sizeof(float)) : 0;
    at += w::padded(s.scale_bytes[kv]);
  }
  s.all_scale_bytes = at - scales_begin;
  s.bytes = at;
  return s;
}

/// Bytes of every message of a transfer of n pages' slices of `width` heads.
template <class Layout>
int64_t payload_bytes(const PagedCache<Layout>& cache, int64_t n, int64_t width) {
  if (is_quantized(cache.quant())) return cache.n_layers() * layer_sections(cache, n, width).bytes;
  const int64_t es = static_cast<int64_t>(c10::elementSize(cache.dtype()));
  return cache.n_layers() * 2 * n * slice_bytes(cache.page_size(), width, cache.head_dim(), es);
}

/// Byte strides of one page of scales of `g` (a float32 per token and head,
/// in the order of the layout's head vectors).
inline kernels::BlockStrides scale_page_strides(const PageGeometry& g) {
  constexpr int64_t f = sizeof(float);
  return {g.token_stride / g.head_dim * f, g.head_stride / g.head_dim * f, f};
}

/// One side of a cache as the transfer copies it: a view of each page as
/// [page_size, heads, vector] blocks, `vector` elements of `elem_size` bytes
/// (head vectors of the pages, or a single scale).
struct SidePart {
  const at::Tensor* storage;  // [n_layers, n_pages, ...]: the pages, or the scales
  kernels::BlockStrides page; ///< byte strides of one page's block
  int64_t page_bytes;         ///< bytes between pages
  int64_t vector;             ///< elements per (token, head): head_dim, or 1 for scales
  int64_t elem_size;
  bool scales;                ///< the side's scales, not its pages
};

/// The parts of side kv (0: k, 1: v) of `cache`: its pages, then its scales
/// when it is quantized.
template <class Layout>
std::vector<SidePart> side_parts(const PagedCache<Layout>& cache, int kv) {
  const PageGeometry& g = cache.geometry();
  const at::Tensor& pages = kv == 0 ? cache.k_cache() : cache.v_cache();
  const at::Tensor& scales = kv == 0 ? cache.k_scales() : cache.v_scales();
  const auto es = static_cast<int64_t>(pages.element_size());
  const kernels::BlockStrides page = kernels::page_strides(g, es);
  std::vector<SidePart> parts{{&pages, page, g.page_elems * es, g.head_dim, es, false}};
  if (scales.defined()) {
    const kernels::BlockStrides scale = scale_page_strides(g);
    parts.push_back({&scales, scale, g.page_size * g.n_heads * static_cast<int64_t>(sizeof(float)), 1,
                     sizeof(float), true});
  }
  return parts;
}

/// Calls f(part, offset, bytes) for every part of `cache` (k pages, k
/// scales, v pages, v scales; scales of quantized sides only) with where it
/// lies in a message laid out as `sections`.
template <class Layout, class F>
void for_each_section(const PagedCache<Layout>& cache, const LayerSections& sections, F&& f) {
  for (int kv = 0; kv < 2; ++kv) {
    for (const SidePart& part : side_parts(cache, kv)) {
      if (part.scales) {
        f(part, sections.scales[kv], sections.scale_bytes[kv]);
      } else {
        f(part, sections.elements[kv], sections.element_bytes[kv]);
      }
    }
  }
}

/// The int64 words of a small host tensor on the wire device.
inline at::Tensor words_on(const std::vector<int64_t>& words, const at::Device& device) {
  at::Tensor t = at::empty({static_cast<int64_t>(words.size())}, at::kLong);
  std::copy(words.begin(), words.end(), t.data_ptr<int64_t>());
  return device.is_cpu() ? t : t.to(device);
}

inline std::vector<int64_t> words_of(const at::Tensor& t) {
  const at::Tensor host = t.cpu().contiguous();
  const int64_t* p = host.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + host.numel());
}

/// Which staging buffer: the sender's (packed payload) or the receiver's.
enum class StagingRole { send = 0, recv = 1 };

inline at::Tensor& staging_slot(StagingRole role) {
  // cppcheck-suppress constVariable ; handed out by reference, assigned by the caller
  thread_local at::Tensor slots[2];
  return slots[static_cast<int>(role)];
}

/// A staging tensor of `shape`. On the CPU it is one buffer per thread and
/// role, reused from transfer to transfer: a fresh 64 MiB buffer costs more
/// in page faults than the copy into it (bench/NOTES.md, transfer). Other
/// devices have caching allocators of their own.
inline at::Tensor staging(StagingRole role, at::IntArrayRef shape, const at::TensorOptions& options) {
  if (!options.device().is_cpu()) return at::empty(shape, options);
  at::Tensor& slot = staging_slot(role);
  const int64_t numel = c10::multiply_integers(shape);
  if (!slot.defined() || slot.dtype() != options.dtype() || slot.numel() < numel) {
    slot = at::Tensor();  // the old buffer goes before the new one comes
    slot = at::empty({numel}, options);
  }
  return slot.narrow(0, 0, numel).view(shape);
}

/// After a failure the group may still hold a pending message on the
/// buffer (it keeps the memory alive through its work): never reuse it.
inline void drop_staging(StagingRole role) { staging_slot(role) = at::Tensor(); }

/// The header of a transfer of n pages (tokens [0, n_tokens)) of `cache`,
/// heads [heads.begin, heads.end) (resolved: end != -1).
template <class Layout>
std::vector<int64_t> header_words(const PagedCache<Layout>& cache, int64_t n, int64_t n_tokens, int64_t transfer_id,
                                  HeadRange heads) {
  namespace w = transfer_wire;
  const int64_t width = heads.end - heads.begin;
  std::vector<int64_t> h(static_cast<size_t>(w::kHeaderWords), 0);
  h[w::magic] = w::kMagic;
  h[w::version] = w::kVersion;
  h[w::transfer_id] = transfer_id;
  h[w::n_layers] = cache.n_layers();
  h[w::page_size] = cache.page_size();
  h[w::head_dim] = cache.head_dim();
  h[w::sender_heads] = cache.n_kv_heads();
  h[w::head_begin] = heads.begin;
  h[w::head_end] = heads.end;
  h[w::dtype] = static_cast<int64_t>(cache.dtype());
  h[w::elem_size] = static_cast<int64_t>(c10::elementSize(cache.dtype()));
  h[w::k_format] = static_cast<int64_t>(cache.quant().k);
  h[w::v_format] = static_cast<int64_t>(cache.quant().v);
  h[w::layout] = w::layout_code<Layout>();
  h[w::n_tokens] = n_tokens;
  h[w::n_pages] = n;
  h[w::payload_bytes] = payload_bytes(cache, n, width);
  h[w::scale_bytes] = is_quantized(cache.quant()) ? layer_sections(cache, n, width).all_scale_bytes : 0;
  h[w::checksum] = w::checksum_of(h.data());
  return h;
}

/// Packs layer `layer`'s head slice of `pages` (k then v) into `chunk`
/// ([2, n, <sender page with width heads>], the cache's dtype and device).
template <class Layout>
void pack_layer(const PagedCache<Layout>& cache, int64_t layer, const std::vector<int64_t>& pages, HeadRange heads,
                const at::Tensor& chunk) {
  const int64_t n = static_cast<int64_t>(pages.size());
  const int64_t width = heads.end - heads.begin;
  const PageGeometry& g = cache.geometry();
  const at::Tensor caches[2] = {cache.k_cache(), cache.v_cache()};
  if (kernels::use_cpu_kernels(cache.device())) {
    const int64_t es = static_cast<int64_t>(cache.k_cache().element_size());
    const int64_t page_bytes = g.page_elems * es;
    const int64_t layer_bytes = cache.n_pages() * page_bytes;
    const int64_t out_bytes = slice_bytes(g.page_size, width, g.head_dim, es);
    const kernels::BlockStrides from = kernels::page_strides(g, es);
    const kernels::BlockStrides to =
        transfer_wire::page_strides(transfer_wire::layout_code<Layout>(), g.page_size, width, g.head_dim, es);
    const kernels::BlockShape shape{g.page_size, width, g.head_dim, es};
    char* out = static_cast<char*>(chunk.data_ptr());
    // On the calling thread: the group's thread sends the previous layer
    // meanwhile, and a parallel region per layer stalls whenever a worker
    // is descheduled (bench/NOTES.md, transfer).
    for (int64_t item = 0; item < 2 * n; ++item) {
      const int64_t kv = item / n;
      const int64_t i = item % n;
      const char* src = static_cast<const char*>(caches[kv].data_ptr()) + layer * layer_bytes +
                        pages[static_cast<size_t>(i)] * page_bytes + heads.begin * g.head_stride * es;
      kernels::copy_block(out + item * out_bytes, to, src, from, shape);
    }
    return;
  }
  const at::Tensor index = kernels::host_index(pages, cache.device());
  const int64_t head_axis = std::is_same<Layout, HND>::value ? 1 : 2;  // of [n, a, b, D]
  for (int kv = 0; kv < 2; ++kv) {
    chunk.select(0, kv).copy_(caches[kv].select(0, layer).index_select(0, index).narrow(head_axis, heads.begin, width));
  }
}

/// The bytes [offset, offset + bytes) of `message` (1-D kByte) as `dtype`
/// in `shape`; offset is a multiple of kSectionAlign.
inline at::Tensor section_of(const at::Tensor& message, int64_t offset, int64_t bytes, at::ScalarType dtype,
                             at::IntArrayRef shape) {
  return message.narrow(-1, offset, bytes).view(dtype).view(shape);
}

/// Packs layer `layer`'s head slice of `pages` of a cache with a quantized
/// side into `message` ([sections.bytes] kByte, on the cache's device): each
/// side's codes (or a native side's elements), then each quantized side's
/// scales, in the sender's layout, padding zeroed (transfer_wire).
template <class Layout>
void pack_layer_sections(const PagedCache<Layout>& cache, int64_t layer, const std::vector<int64_t>& pages,
                         HeadRange heads, const LayerSections& sections, const at::Tensor& message) {
  const auto n = static_cast<int64_t>(pages.size());
  const int64_t width = heads.end - heads.begin;
  const PageGeometry& g = cache.geometry();
  const int64_t code = transfer_wire::layout_code<Layout>();
  const bool cpu = kernels::use_cpu_kernels(cache.device());
  const at::Tensor index = cpu ? at::Tensor() : kernels::host_index(pages, cache.device());
  for_each_section(cache, sections, [&](const SidePart& part, int64_t offset, int64_t bytes) {
    message.narrow(0, offset + bytes, transfer_wire::padded(bytes) - bytes).zero_();
    if (cpu) {
      const kernels::BlockShape shape{g.page_size, width, part.vector, part.elem_size};
      const kernels::BlockStrides to =
          transfer_wire::page_strides(code, g.page_size, width, part.vector, part.elem_size);
      const int64_t out_bytes = slice_bytes(g.page_size, width, part.vector, part.elem_size);
      const char* layer_base =
          static_cast<const char*>(part.storage->data_ptr()) + layer * cache.n_pages() * part.page_bytes;
      char* out = static_cast<char*>(message.data_ptr()) + offset;
      for (int64_t i = 0; i < n; ++i) {  // on the calling thread, as pack_layer
        kernels::copy_block(out + i * out_bytes, to,
                            layer_base + pages[static_cast<size_t>(i)] * part.page_bytes +
                                heads.begin * part.page.head,
                            part.page, shape);
      }
      return;
    }
    const auto mine = Layout::page_shape(g.page_size, g.n_heads, part.vector);
    const auto sent = Layout::page_shape(g.page_size, width, part.vector);
    const int64_t head_axis = std::is_same<Layout, HND>::value ? 1 : 2;  // of [n, a, b, vector]
    section_of(message, offset, bytes, part.storage->scalar_type(), {n, sent[0], sent[1], sent[2]})
        .copy_(part.storage->select(0, layer)
                   .view({cache.n_pages(), mine[0], mine[1], mine[2]})
                   .index_select(0, index)
                   .narrow(head_axis, heads.begin, width));
  });
}

/// Copies the staged payload ([n_layers, 2, n, <page in layout `code`>])
/// into `pages` of `cache` (every layer, k and v; all of the cache's heads).
template <class Layout>
void unpack(PagedCache<Layout>& cache, const at::Tensor& staging, int64_t code, const std::vector<int64_t>& pages) {
  const int64_t n = static_cast<int64_t>(pages.size());
  if (n == 0) return;
  const PageGeometry& g = cache.geometry();
  const at::Tensor caches[2] = {cache.k_cache(), cache.v_cache()};
  const bool same_layout = code == transfer_wire::layout_code<Layout>();
  if (kernels::use_cpu_kernels(cache.device()) && staging.device().is_cpu()) {
    const int64_t es = static_cast<int64_t>(cache.k_cache().element_size());
    const int64_t page_bytes = g.page_elems * es;
    const int64_t layer_bytes = cache.n_pages() * page_bytes;
    const kernels::BlockStrides from = transfer_wire::page_strides(code, g.page_size, g.n_heads, g.head_dim, es);
    const kernels::BlockStrides to = kernels::page_strides(g, es);
    const kernels::BlockShape shape{g.page_size, g.n_heads, g.head_dim, es};
    const char* in = static_cast<const char*>(staging.data_ptr());
    const int64_t items = cache.n_layers() * 2 * n;
    // The fresh pages are not read before the call returns: streaming
    // stores skip the read for ownership, as the cache writes do.
    const bool stream = kernels::use_streaming_stores(items * page_bytes, to, g, es);
    const auto run = [&](auto streaming, int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t layer = item / (2 * n);
        const int64_t kv = (item / n) % 2;
        const int64_t i = item % n;
        char* dst = static_cast<char*>(caches[kv].data_ptr()) + layer * layer_bytes +
                    pages[static_cast<size_t>(i)] * page_bytes;
        kernels::copy_block<decltype(streaming)::value>(dst, to, in + item * page_bytes, from, shape);
      }
    };
    kernels::parallel_copy(items, kernels::grain_for(page_bytes), stream, run);
    return;
  }
  const at::Tensor index = kernels::host_index(pages, cache.device());
  for (int kv = 0; kv < 2; ++kv) {
    at::Tensor src = staging.select(1, kv);  // [L, n, a, b, D]
    if (!same_layout) src = src.transpose(2, 3);
    caches[kv].index_copy_(1, index, src.to(cache.device()));
  }
}

/// Copies the staged messages ([n_layers, sections.bytes] kByte, sent in
/// the layout `code`) of a cache with a quantized side into `pages` of
/// `cache` (every layer, k and v, codes and scales; all of its heads).
template <class Layout>
void unpack_sections(PagedCache<Layout>& cache, const at::Tensor& staging, int64_t code,
                     const LayerSections& sections, const std::vector<int64_t>& pages) {
  const auto n = static_cast<int64_t>(pages.size());
  if (n == 0) return;
  const PageGeometry& g = cache.geometry();
  const int64_t n_layers = cache.n_layers();
  const bool cpu = kernels::use_cpu_kernels(cache.device()) && staging.device().is_cpu();
  const at::Tensor index = cpu ? at::Tensor() : kernels::host_index(pages, cache.device());
  for_each_section(cache, sections, [&](const SidePart& part, int64_t offset, int64_t bytes) {
    if (cpu) {
      const kernels::BlockShape shape{g.page_size, g.n_heads, part.vector, part.elem_size};
      const kernels::BlockStrides from =
          transfer_wire::page_strides(code, g.page_size, g.n_heads, part.vector, part.elem_size);
      const int64_t in_bytes = slice_bytes(g.page_size, g.n_heads, part.vector, part.elem_size);
      const char* in = static_cast<const char*>(staging.data_ptr()) + offset;
      char* base = static_cast<char*>(part.storage->data_ptr());
      const auto run = [&](auto streaming, int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t layer = item / n;
          const int64_t i = item % n;
          char* dst = base + (layer * cache.n_pages() + pages[static_cast<size_t>(i)]) * part.page_bytes;
          kernels::copy_block<decltype(streaming)::value>(dst, part.page, in + layer * sections.bytes + i * in_bytes,
                                                          from, shape);
        }
      };
      // The fresh pages are not read before the call returns: their codes
      // stream where the native scatter's would (unpack).
      const bool stream =
          !part.scales && kernels::use_streaming_stores(n_layers * n * in_bytes, part.page, g, part.elem_size);
      kernels::parallel_copy(n_layers * n, kernels::grain_for(in_bytes), stream, run);
      return;
    }
    const auto sent = code == 1 ? HND::page_shape(g.page_size, g.n_heads, part.vector)
                                : NHD::page_shape(g.page_size, g.n_heads, part.vector);
    const auto mine = Layout::page_shape(g.page_size, g.n_heads, part.vector);
    at::Tensor src =
        section_of(staging, offset, bytes, part.storage->scalar_type(), {n_layers, n, sent[0], sent[1], sent[2]});
    if (code != transfer_wire::layout_code<Layout>()) src = src.transpose(2, 3);
    part.storage->view({n_layers, cache.n_pages(), mine[0], mine[1], mine[2]})
        .index_copy_(1, index, src.to(cache.device()));
  });
}

/// Receiver side of one transfer. `allocate(n_pages, n_tokens)` returns
/// n_pages fresh pages (or none when the pool is short, having allocated
/// nothing); `undo(pages)` frees them. Returns the pages, filled, and the
/// tokens they hold.
template <class Group, class Layout>
std::pair<std::vector<int64_t>, int64_t> receive(const checks::Caller& caller, Group& group, int src_rank, PagedCache<Layout>& cache,
                             int64_t transfer_id, std::chrono::milliseconds timeout,
                             const std::function<std::vector<int64_t>(int64_t, int64_t)>& allocate,
                             const std::function<void(const std::vector<int64_t>&)>& undo) {
  namespace w = transfer_wire;
  peer_rank(caller, "src_rank", group, src_rank);
  positive_timeout(caller, timeout);
  const auto deadline = Clock::now() + timeout;
  const at::Device device = cache.device();
  const at::Tensor header_buf = at::zeros({w::kHeaderWords}, at::TensorOptions().dtype(at::kLong).device(device));
  std::vector<decltype(recv_one(group, header_buf, src_rank, w::kHeaderTag))> header_work{
      recv_one(group, header_buf, src_rank, w::kHeaderTag)};
  wait_all(caller, header_work, deadline,
           "no header of transfer " + std::to_string(transfer_id) + " from rank " + std::to_string(src_rank));
  const std::vector<int64_t> h = words_of(header_buf);

  // Validate everything before allocating; a rejection is sent back so that
  // the sender fails too (and sends no payload).
  int64_t verdict = w::accept;
  int64_t detail = 0;
  std::string reason;
  const auto es = static_cast<int64_t>(c10::elementSize(cache.dtype()));
  const auto mismatch = [&](const char* what, int64_t mine, int64_t theirs, const std::string& mine_s = "",
                            const std::string& theirs_s = "") {
    if (verdict != w::accept || mine == theirs) return;
    verdict = w::mismatch;
    reason = std::string(what) + " mismatch: expected " + (mine_s.empty() ? std::to_string(mine) : mine_s) +
             " (this cache's), got " + (theirs_s.empty() ? std::to_string(theirs) : theirs_s) + " (the sender's)";
  };
  if (h[w::magic] != w::kMagic || h[w::checksum] != w::checksum_of(h.data())) {
    verdict = w::bad_header;
    reason = "bad header: not a pagedkv transfer header (wrong magic or checksum)";
  } else if (h[w::version] != w::kVersion) {
    verdict = w::bad_header;
    reason = "bad header: protocol version " + std::to_string(h[w::version]) + ", expected " +
             std::to_string(w::kVersion);
  } else if (std::any_of(h.begin() + w::first_reserved, h.begin() + w::checksum, [](int64_t x) { return x != 0; })) {
    verdict = w::bad_header;
    reason = "bad header: reserved words are not 0 (a newer protocol with the same version?)";
  } else if (!(h[w::head_begin] >= 0 && h[w::head_begin] < h[w::head_end] && h[w::head_end] <= h[w::sender_heads])) {
    verdict = w::bad_header;  // checked before the width end - begin is formed
    reason = "bad header: head range [" + std::to_string(h[w::head_begin]) + ", " + std::to_string(h[w::head_end]) +
             ") is not inside the sender's " + std::to_string(h[w::sender_heads]) + " heads";
  } else if (h[w::transfer_id] != transfer_id) {
    verdict = w::wrong_transfer_id;
    detail = transfer_id;
    reason = "wrong transfer id: expected " + std::to_string(transfer_id) + ", got " +
             std::to_string(h[w::transfer_id]);
  }
  mismatch("n_layers", cache.n_layers(), h[w::n_layers]);
  mismatch("page_size", cache.page_size(), h[w::page_size]);
  mismatch("head_dim", cache.head_dim(), h[w::head_dim]);
  // The head range was checked unless an earlier check failed first.
  const bool heads_checked = verdict == w::accept || verdict == w::wrong_transfer_id;
  mismatch("n_kv_heads (the width of the sent head range)", cache.n_kv_heads(),
           heads_checked ? h[w::head_end] - h[w::head_begin] : cache.n_kv_heads());
  const auto dtype = static_cast<int64_t>(cache.dtype());
  const bool known_dtype = h[w::dtype] >= 0 && h[w::dtype] < static_cast<int64_t>(c10::ScalarType::NumOptions);
  mismatch("dtype", dtype, h[w::dtype], c10::toString(cache.dtype()),
           known_dtype ? c10::toString(static_cast<c10::ScalarType>(h[w::dtype])) : std::to_string(h[w::dtype]));
  mismatch("element size", es, h[w::elem_size]);
  const auto format_text = [](int64_t f) {
    const bool known = f >= 0 && f <= static_cast<int64_t>(KVFormat::int8);
    return known ? std::string(format_name(static_cast<KVFormat>(f))) : std::to_string(f);
  };
  const auto k_format = static_cast<int64_t>(cache.quant().k);
  const auto v_format = static_cast<int64_t>(cache.quant().v);
  mismatch("k quantization (KVFormat)", k_format, h[w::k_format], format_text(k_format), format_text(h[w::k_format]));
  mismatch("v quantization (KVFormat)", v_format, h[w::v_format], format_text(v_format), format_text(h[w::v_format]));
  if (verdict == w::accept) {
    // Any int64 may arrive: no sum or product is formed before the page
    // count is known to fit the pool (whose byte size fits int64).
    const int64_t n = h[w::n_pages];
    const int64_t ps = cache.page_size();
    const bool counts = h[w::layout] >= 0 && h[w::layout] <= 1 && h[w::n_tokens] >= 0 &&
                        n == h[w::n_tokens] / ps + (h[w::n_tokens] % ps != 0 ? 1 : 0);
    if (!counts) {
      verdict = w::bad_header;
      reason = "bad header: inconsistent layout, token or page counts";
    } else if (n > cache.n_pages()) {
      verdict = w::short_pool;
      detail = cache.n_free();
      reason = "short pool: the transfer needs " + std::to_string(n) + " pages, more than the pool's " +
               std::to_string(cache.n_pages());
    } else if (h[w::payload_bytes] != payload_bytes(cache, n, cache.n_kv_heads())) {
      verdict = w::bad_header;
      reason = "bad header: the payload size does not match the geometry";
    } else if (h[w::scale_bytes] !=
               (is_quantized(cache.quant()) ? layer_sections(cache, n, cache.n_kv_heads()).all_scale_bytes : 0)) {
      verdict = w::bad_header;
      reason = "bad header: the scale bytes do not match the geometry and quantization";
    }
  }
  std::vector<int64_t> pages;
  if (verdict == w::accept) {
    pages = allocate(h[w::n_pages], h[w::n_tokens]);
    if (static_cast<int64_t>(pages.size()) != h[w::n_pages]) {
      verdict = w::short_pool;
      detail = cache.n_free();
      reason = "short pool: the transfer needs " + std::to_string(h[w::n_pages]) + " pages, the pool has " +
               std::to_string(cache.n_free()) + " free";
      pages.clear();
    }
  }
  // From here on every failure frees the fresh pages.
  try {
    std::vector<decltype(send_one(group, header_buf, src_rank, w::kReplyTag))> reply_work{send_one(
        group, words_on({w::kReplyMagic, verdict, h[w::transfer_id], detail}, device), src_rank, w::kReplyTag)};
    if (verdict != w::accept) {
      // Best effort: the sender learns why; our own error is the one thrown.
      try {
        wait_all(caller, reply_work, deadline, "reply");
      } catch (const c10::Error&) {  // NOLINT(bugprone-empty-catch)
      }
      TORCH_CHECK(false, caller, ": transfer ", transfer_id, " from rank ", src_rank, " rejected: ", reason);
    }
    const int64_t n = h[w::n_pages];
    const bool quantized = is_quantized(cache.quant());
    const LayerSections sections = layer_sections(cache, n, cache.n_kv_heads());
    at::Tensor staging;
    if (n > 0) {
      const auto page = h[w::layout] == 1
                            ? HND::page_shape(cache.page_size(), cache.n_kv_heads(), cache.head_dim())
                            : NHD::page_shape(cache.page_size(), cache.n_kv_heads(), cache.head_dim());
      staging = quantized ? transfer_detail::staging(StagingRole::recv, {cache.n_layers(), sections.bytes},
                                                     at::TensorOptions().dtype(at::kByte).device(device))
                          : transfer_detail::staging(StagingRole::recv,
                                                     {cache.n_layers(), 2, n, page[0], page[1], page[2]},
                                                     cache.k_cache().options());
      std::vector<decltype(recv_one(group, staging[0], src_rank, w::kPayloadTag))> payload;
      payload.reserve(static_cast<size_t>(cache.n_layers()));
      for (int64_t layer = 0; layer < cache.n_layers(); ++layer) {
        payload.push_back(recv_one(group, staging[layer], src_rank, w::kPayloadTag));
      }
      wait_all(caller, payload, deadline,
               "payload of transfer " + std::to_string(transfer_id) + " from rank " + std::to_string(src_rank));
    }
    wait_all(caller, reply_work, deadline, "reply to transfer " + std::to_string(transfer_id));
    if (quantized) {
      unpack_sections(cache, staging, h[w::layout], sections, pages);
    } else {
      unpack(cache, staging, h[w::layout], pages);
    }
  } catch (...) {
    drop_staging(StagingRole::recv);
    undo(pages);
    throw;
  }
  return {pages, h[w::n_tokens]};
}

}  // namespace transfer_detail

/// Frees the calling thread's staging buffers (CPU transfers keep the
/// largest payload sent and the largest received per thread, for reuse).
inline void release_transfer_buffers() {
  transfer_detail::drop_staging(transfer_detail::StagingRole::send);
  transfer_detail::drop_staging(transfer_detail::StagingRole::recv);
}

/// Sends tokens [0, n_tokens) held by `pages` ([n] int32/int64, in token
/// order, allocated in `cache`; n = ceil(n_tokens / page_size)) to
/// `dst_rank`, every layer, k and v, heads [heads.begin, heads.end) only.
/// Returns once the payload is sent; never changes the cache. Throws
/// c10::Error on bad arguments (before anything is sent), a rejection by
/// the receiver (mismatch, wrong id, short pool: the group stays usable),
/// a timeout or a dead peer (rebuild the group).
template <class Group, class Layout>
void send_pages(Group& group, int dst_rank, const PagedCache<Layout>& cache,
                const at::Tensor& pages,  // [n] int32/int64
                int64_t n_tokens, int64_t transfer_id, std::chrono::milliseconds timeout, HeadRange heads = {}) {
  namespace w = transfer_wire;
  using namespace transfer_detail;
  const checks::Caller caller{"send_pages", Layout::name, nullptr};
  peer_rank(caller, "dst_rank", group, dst_rank);
  positive_timeout(caller, timeout);
  checks::non_negative(caller, "n_tokens", n_tokens);
  const std::vector<int64_t> ids = page_copy::page_list(caller, "pages", pages, cache.device(), cache.device());
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t need = n_tokens / cache.page_size() + (n_tokens % cache.page_size() != 0 ? 1 : 0);
  TORCH_CHECK(n == need, caller, ": argument 'pages' expected ", need, " pages (the pages that hold n_tokens = ",
              n_tokens, " at page_size ", cache.page_size(), "), got ", n);
  page_copy::allocated_pages(caller, "pages", ids, cache.pool());
  if (heads.end == -1) heads.end = cache.n_kv_heads();
  TORCH_CHECK_INDEX(heads.begin >= 0 && heads.begin < heads.end && heads.end <= cache.n_kv_heads(), caller,
                    ": argument 'heads' expected 0 <= begin < end <= n_kv_heads = ", cache.n_kv_heads(),
                    " (end -1 = all), got [", heads.begin, ", ", heads.end, ")");

  const int64_t width = heads.end - heads.begin;
  const std::vector<int64_t> h = header_words(cache, n, n_tokens, transfer_id, heads);

  const auto deadline = Clock::now() + timeout;
  const at::Device device = cache.device();
  const at::Tensor reply = at::zeros({w::kReplyWords}, at::TensorOptions().dtype(at::kLong).device(device));
  const std::string what = "transfer " + std::to_string(transfer_id) + " to rank " + std::to_string(dst_rank);
  {
    std::vector<decltype(send_one(group, reply, dst_rank, w::kHeaderTag))> works;
    works.push_back(send_one(group, words_on(h, device), dst_rank, w::kHeaderTag));
    works.push_back(recv_one(group, reply, dst_rank, w::kReplyTag));
    wait_all(caller, works, deadline, what + ": header or reply");
  }
  const std::vector<int64_t> r = words_of(reply);
  TORCH_CHECK(r[w::reply_magic] == w::kReplyMagic && r[w::reply_transfer_id] == transfer_id, caller, ": ", what,
              ": bad reply from the receiver (not a pagedkv reply to this transfer)");
  switch (r[w::verdict]) {
    case w::accept:
      break;
    case w::wrong_transfer_id:
      TORCH_CHECK(false, caller, ": ", what, " rejected: wrong transfer id: the receiver expected transfer ",
                  r[w::detail]);
    case w::short_pool:
      TORCH_CHECK(false, caller, ": ", what, " rejected: short pool: the receiver needs ", n, " pages and has ",
                  r[w::detail], " free");
    case w::mismatch:
      TORCH_CHECK(false, caller, ": ", what,
                  " rejected: mismatch: the receiver's geometry, dtype or quantization differs (its error names "
                  "the field)");
    default:
      TORCH_CHECK(false, caller, ": ", what, " rejected: the receiver could not read the header (verdict ",
                  r[w::verdict], ")");
  }
  if (n == 0) return;
  // Pack a layer, hand it to the group (which sends in the background),
  // pack the next: the copy overlaps the wire.
  // A cache with a quantized side sends each layer as bytes in sections
  // (codes and scales); a native one as [2, n, <page>] of its dtype.
  const bool quantized = is_quantized(cache.quant());
  const LayerSections sections = layer_sections(cache, n, width);
  const auto page = Layout::page_shape(cache.page_size(), width, cache.head_dim());
  const at::Tensor packed =
      quantized ? staging(StagingRole::send, {cache.n_layers(), sections.bytes},
                          at::TensorOptions().dtype(at::kByte).device(device))
                : staging(StagingRole::send, {cache.n_layers(), 2, n, page[0], page[1], page[2]},
                          cache.k_cache().options());
  std::vector<decltype(send_one(group, reply, dst_rank, w::kPayloadTag))> works;
  works.reserve(static_cast<size_t>(cache.n_layers()));
  try {
    for (int64_t layer = 0; layer < cache.n_layers(); ++layer) {
      if (quantized) {
        pack_layer_sections(cache, layer, ids, heads, sections, packed[layer]);
      } else {
        pack_layer(cache, layer, ids, heads, packed[layer]);
      }
      works.push_back(send_one(group, packed[layer], dst_rank, w::kPayloadTag));
    }
    wait_all(caller, works, deadline, what + ": payload");
  } catch (...) {
    drop_staging(StagingRole::send);
    throw;
  }
}

/// Receives one transfer from `src_rank` into fresh pages of `cache`
/// (lowest-first, ref count 1) and returns them in token order. On any
/// failure throws c10::Error naming the cause and the pool is as before.
template <class Group, class Layout>
std::vector<int64_t> recv_pages(Group& group, int src_rank, PagedCache<Layout>& cache, int64_t transfer_id,
                                std::chrono::milliseconds timeout) {
  PagePool& pool = cache.pool();
  return transfer_detail::receive(
             checks::Caller{"recv_pages", Layout::name, nullptr}, group, src_rank, cache, transfer_id, timeout,
             [&](int64_t n_pages, int64_t /*n_tokens*/) { return pool.alloc_n(n_pages); },
             [&](const std::vector<int64_t>& pages) { pool.free_all(pages); })
      .first;
}

/// Sends sequence `seq` (resident; its length in tokens) as send_pages does.
template <class Group, class Layout>
void send_sequence(Group& group, int dst_rank, const SequenceTable<Layout>& seqs, int64_t seq, int64_t transfer_id,
                   std::chrono::milliseconds timeout, HeadRange heads = {}) {
  const checks::Caller caller{"send_sequence", Layout::name, nullptr};
  TORCH_CHECK_INDEX(seqs.contains(seq), caller, ": argument 'seq' expected a live sequence id of the table, got ",
                    seq);
  TORCH_CHECK(!seqs.swapped(seq), caller, ": argument 'seq' expected a resident sequence, got sequence ", seq,
              " which is swapped out (call swap_in first)");
  const int64_t length = seqs.length(seq);
  const int64_t page_size = seqs.cache().page_size();
  const int64_t n = length / page_size + (length % page_size != 0 ? 1 : 0);
  const std::vector<int64_t>& all = seqs.pages(seq);
  const at::Tensor pages = kernels::host_index(std::vector<int64_t>(all.begin(), all.begin() + n), at::kCPU);
  send_pages(group, dst_rank, seqs.cache(), pages, length, transfer_id, timeout, heads);
}

/// Receives one transfer as a new sequence of `seqs` (length = the tokens
/// sent) and returns its id. On any failure throws c10::Error naming the
/// cause; the table and its pool are as before.
template <class Group, class Layout>
int64_t recv_sequence(Group& group, int src_rank, SequenceTable<Layout>& seqs, int64_t transfer_id,
                      std::chrono::milliseconds timeout) {
  int64_t seq = -1;
  const auto allocate = [&](int64_t /*n_pages*/, int64_t n_tokens) {
    seq = seqs.create();
    if (!seqs.reserve(seq, n_tokens)) {  // n_pages pages, all or nothing
      seqs.release(seq);
      seq = -1;
      return std::vector<int64_t>{};
    }
    return seqs.pages(seq);
  };
  const auto undo = [&](const std::vector<int64_t>&) {
    if (seq >= 0) seqs.release(seq);
  };
  const int64_t n_tokens = transfer_detail::receive(checks::Caller{"recv_sequence", Layout::name, nullptr}, group,
                                                    src_rank, seqs.cache(), transfer_id, timeout, allocate, undo)
                               .second;
  seqs.commit_append(seq, n_tokens);  // fits: reserved above
  return seq;
}

}  // namespace pagedkv
