// Page transfer between processes over a torch c10d process group (Gloo on
// the CPU, NCCL on CUDA): disaggregated prefill/decode and tensor
// parallelism. pagedkv builds no transport: it only calls the group's
// send/recv, so this header is not part of the umbrella pagedkv.hpp (users
// who do not transfer never pull in c10d).
//
// Wire protocol (one transfer, sender S -> receiver R; tags in transfer::wire)
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
//              multiple of transfer::wire::kSectionAlign bytes.
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
//
// This header holds the public functions (checks, the sender's steps). The
// pieces, in transfer/:
//   heads.hpp    which kv heads a tensor-parallel rank holds; routes
//   wire.hpp     the wire format: header words, tags, message sections
//   group.hpp    sends and receives on the c10d group against one deadline
//   staging.hpp  the staging buffers (reused per thread on the CPU)
//   packing.hpp  pack a layer's pages into a message; unpack the payload
//   receive.hpp  the receiver's side: header check, reply, payload, unpack
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "pagedkv/checks.hpp"
#include "pagedkv/generic/write_gather.hpp"
#include "pagedkv/ops/page_copy.hpp"
#include "pagedkv/paged_cache.hpp"
#include "pagedkv/sequences.hpp"
#include "pagedkv/transfer/group.hpp"
#include "pagedkv/transfer/heads.hpp"
#include "pagedkv/transfer/packing.hpp"
#include "pagedkv/transfer/receive.hpp"
#include "pagedkv/transfer/staging.hpp"
#include "pagedkv/transfer/wire.hpp"

namespace pagedkv {

/// Frees the calling thread's staging buffers (CPU transfers keep the
/// largest payload sent and the largest received per thread, for reuse).
inline void release_transfer_buffers() {
  transfer::drop_staging(transfer::StagingRole::send);
  transfer::drop_staging(transfer::StagingRole::recv);
}

namespace transfer {

/// send_pages of the pages of columns [first_page, ceil(n_tokens /
/// page_size)): send_sequence passes the columns a windowed table released
/// as first_page (the receiver needs no page before them).
template <class Group, class Layout>
void send_from(Group& group, int dst_rank, const PagedCache<Layout>& cache, const at::Tensor& pages,
               int64_t n_tokens, int64_t first_page, int64_t transfer_id, std::chrono::milliseconds timeout,
               HeadRange heads) {
  namespace w = transfer::wire;
  const checks::Caller caller{"send_pages", Layout::name, nullptr};
  peer_rank(caller, "dst_rank", group, dst_rank);
  positive_timeout(caller, timeout);
  checks::non_negative(caller, "n_tokens", n_tokens);
  const std::vector<int64_t> ids = checks::page_list(caller, "pages", pages, cache.device(), cache.device());
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t need = n_tokens / cache.page_size() + (n_tokens % cache.page_size() != 0 ? 1 : 0) - first_page;
  TORCH_CHECK(n == need, caller, ": argument 'pages' expected ", need, " pages (the pages that hold n_tokens = ",
              n_tokens, " at page_size ", cache.page_size(), "), got ", n);
  checks::allocated_pages(caller, "pages", ids, cache.pool());
  if (heads.end == -1) heads.end = cache.n_kv_heads();
  TORCH_CHECK_INDEX(heads.begin >= 0 && heads.begin < heads.end && heads.end <= cache.n_kv_heads(), caller,
                    ": argument 'heads' expected 0 <= begin < end <= n_kv_heads = ", cache.n_kv_heads(),
                    " (end -1 = all), got [", heads.begin, ", ", heads.end, ")");

  const int64_t width = heads.end - heads.begin;
  const std::vector<int64_t> h = header_words(cache, n, n_tokens, transfer_id, heads, first_page);

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
    case w::window:
      TORCH_CHECK(false, caller, ": ", what, " rejected: window: the receiver would need pages before column ",
                  first_page, ", which this windowed sequence released (its error names its window)");
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

}  // namespace transfer

namespace detail {

/// What recv_sequence needs of a table beyond its public calls.
struct SequenceAccess {
  template <class Layout>
  static void install(SequenceTable<Layout>& seqs, int64_t seq, int64_t first, const std::vector<int64_t>& pages,
                      int64_t length) {
    seqs.install(seq, first, pages, length);
  }
};

}  // namespace detail

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
  transfer::send_from(group, dst_rank, cache, pages, n_tokens, 0, transfer_id, timeout, heads);
}

/// Receives one transfer from `src_rank` into fresh pages of `cache`
/// (lowest-first, ref count 1) and returns them in token order. On any
/// failure throws c10::Error naming the cause and the pool is as before.
template <class Group, class Layout>
std::vector<int64_t> recv_pages(Group& group, int src_rank, PagedCache<Layout>& cache, int64_t transfer_id,
                                std::chrono::milliseconds timeout) {
  PagePool& pool = cache.pool();
  const auto refuse = [](int64_t first_page, int64_t /*n_tokens*/) -> std::string {
    if (first_page == 0) return "";
    return "the sender's windowed table released the first " + std::to_string(first_page) +
           " pages of the sequence: receive it with recv_sequence into a table with a window";
  };
  return transfer::receive(
             checks::Caller{"recv_pages", Layout::name, nullptr}, group, src_rank, cache, transfer_id, timeout,
             refuse, [&](int64_t n_pages, int64_t /*n_tokens*/) { return pool.alloc_n(n_pages); },
             [&](const std::vector<int64_t>& pages) { pool.free_all(pages); })
      .first;
}

/// Sends sequence `seq` (resident; its length in tokens) as send_pages
/// does: of a windowed table's sequence, only the pages it still holds.
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
  int64_t first = 0;  // the columns the table's window released
  while (first < n && all[static_cast<size_t>(first)] == kUnmappedPage) ++first;
  const at::Tensor pages = generic::host_index(std::vector<int64_t>(all.begin() + first, all.begin() + n), at::kCPU);
  transfer::send_from(group, dst_rank, seqs.cache(), pages, length, first, transfer_id, timeout, heads);
}

/// Receives one transfer as a new sequence of `seqs` (length = the tokens
/// sent) and returns its id. A windowed sender's sequence arrives with the
/// pages it held; the table takes it when its own window keeps no page
/// before those (its window is at most the sender's), and releases what its
/// window does not keep. On any failure throws c10::Error naming the cause;
/// the table and its pool are as before.
template <class Group, class Layout>
int64_t recv_sequence(Group& group, int src_rank, SequenceTable<Layout>& seqs, int64_t transfer_id,
                      std::chrono::milliseconds timeout) {
  const int64_t page_size = seqs.cache().page_size();
  int64_t seq = -1;
  int64_t first = 0;  // the columns the sender released
  bool windowed = false;
  std::vector<int64_t> fresh;  // a windowed sequence's pages, the table's once installed
  const auto refuse = [&](int64_t first_page, int64_t n_tokens) -> std::string {
    const int64_t w = seqs.window();
    const int64_t keeps_from = w == 0 || n_tokens < w ? 0 : (n_tokens - w + 1) / page_size;
    if (first_page <= keeps_from) return "";
    return "the sender's windowed table released the first " + std::to_string(first_page) + " pages of the " +
           std::to_string(n_tokens) + "-token sequence; this table (window " + std::to_string(w) +
           (w == 0 ? ": every token" : "") + ") keeps it from page " + std::to_string(keeps_from) + " on";
  };
  const auto allocate = [&](int64_t n_pages, int64_t n_tokens) {
    first = n_tokens / page_size + (n_tokens % page_size != 0 ? 1 : 0) - n_pages;
    windowed = first > 0;
    seq = seqs.create();
    if (windowed) {
      // No table call gives a sequence leading released columns: the pages
      // are the pool's until install() hands them to the sequence.
      fresh = seqs.cache().pool().alloc_n(n_pages);
      if (static_cast<int64_t>(fresh.size()) != n_pages) {
        seqs.release(seq);
        seq = -1;
      }
      return fresh;
    }
    if (!seqs.reserve(seq, n_tokens)) {  // n_pages pages, all or nothing
      seqs.release(seq);
      seq = -1;
      return std::vector<int64_t>{};
    }
    return seqs.pages(seq);
  };
  const auto undo = [&](const std::vector<int64_t>&) {
    if (windowed) seqs.cache().pool().free_all(fresh);
    if (seq >= 0) seqs.release(seq);
  };
  const int64_t n_tokens =
      transfer::receive(checks::Caller{"recv_sequence", Layout::name, nullptr}, group, src_rank, seqs.cache(),
                               transfer_id, timeout, refuse, allocate, undo)
          .second;
  if (!windowed) {
    seqs.commit_append(seq, n_tokens);  // fits: reserved above
    return seq;
  }
  try {
    detail::SequenceAccess::install(seqs, seq, first, fresh, n_tokens);
  } catch (...) {  // std::bad_alloc, before any change
    undo(fresh);
    throw;
  }
  return seq;
}

}  // namespace pagedkv
