// The receiver's side of one transfer: the header, checked before anything
// is allocated; the reply (accept, or why not); the payload into a staging
// buffer; the fresh pages written only once all of it has arrived.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "pagedkv/checks.hpp"
#include "pagedkv/kv_format.hpp"
#include "pagedkv/layouts.hpp"
#include "pagedkv/paged_cache.hpp"
#include "pagedkv/transfer/group.hpp"
#include "pagedkv/transfer/packing.hpp"
#include "pagedkv/transfer/staging.hpp"
#include "pagedkv/transfer/wire.hpp"

namespace pagedkv {

namespace transfer {

/// receive, step 1: waits for the header of transfer `transfer_id` from
/// `src_rank` and returns its words (not yet checked).
template <class Group>
std::vector<int64_t> receive_header(const checks::Caller& caller, Group& group, int src_rank, int64_t transfer_id,
                                    const at::Device& device, Clock::time_point deadline) {
  namespace w = transfer::wire;
  const at::Tensor header_buf = at::zeros({w::kHeaderWords}, at::TensorOptions().dtype(at::kLong).device(device));
  std::vector<decltype(recv_one(group, header_buf, src_rank, w::kHeaderTag))> header_work{
      recv_one(group, header_buf, src_rank, w::kHeaderTag)};
  wait_all(caller, header_work, deadline,
           "no header of transfer " + std::to_string(transfer_id) + " from rank " + std::to_string(src_rank));
  return words_of(header_buf);
}

/// What the receiver answers a header: transfer::wire::accept, or the
/// verdict, its detail word and the reason for the error message.
struct HeaderVerdict {
  int64_t verdict;     ///< a transfer::wire::Verdict
  int64_t detail;      ///< the reply's detail word (the expected id, or the free pages)
  std::string reason;  ///< why a header is rejected; empty when accepted
};

/// receive, step 2: checks header `h` against `cache` and `transfer_id`
/// before anything is allocated (the first failing check decides).
template <class Layout>
HeaderVerdict check_header(const PagedCache<Layout>& cache, const std::vector<int64_t>& h, int64_t transfer_id) {
  namespace w = transfer::wire;
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
    const int64_t all = h[w::n_tokens] / ps + (h[w::n_tokens] % ps != 0 ? 1 : 0);
    const int64_t first = h[w::first_page];
    const bool counts = h[w::layout] >= 0 && h[w::layout] <= 1 && h[w::n_tokens] >= 0 && first >= 0 &&
                        first <= all && n == all - first;
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
  return {verdict, detail, reason};
}

/// receive, step 4 (after allocating and replying): posts one buffer per
/// layer of exactly the sizes the accepted header `h` announced, waits for
/// all of them, and returns the staging tensor they filled (undefined when
/// no page was sent).
template <class Group, class Layout>
at::Tensor receive_payload(const checks::Caller& caller, Group& group, int src_rank, const PagedCache<Layout>& cache,
                           const std::vector<int64_t>& h, const LayerSections& sections, int64_t transfer_id,
                           Clock::time_point deadline) {
  namespace w = transfer::wire;
  const at::Device device = cache.device();
  const int64_t n = h[w::n_pages];
  const bool quantized = is_quantized(cache.quant());
  at::Tensor staging;
  if (n > 0) {
    const auto page = h[w::layout] == 1
                          ? HND::page_shape(cache.page_size(), cache.n_kv_heads(), cache.head_dim())
                          : NHD::page_shape(cache.page_size(), cache.n_kv_heads(), cache.head_dim());
    staging = quantized ? transfer::staging(StagingRole::recv, {cache.n_layers(), sections.bytes},
                                                   at::TensorOptions().dtype(at::kByte).device(device))
                        : transfer::staging(StagingRole::recv,
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
  return staging;
}

/// Receiver side of one transfer, in steps: the header (receive_header),
/// its check (check_header), the pages (allocate), the reply, the payload
/// (receive_payload), the unpack into the pages. `refuse(first_page,
/// n_tokens)` says why the receiver cannot take a sequence whose first
/// first_page pages its sender's window released ("" when it can).
/// `allocate(n_pages, n_tokens)` returns n_pages fresh pages (or none when
/// the pool is short, having allocated nothing); `undo(pages)` frees them.
/// Returns the pages, filled, and the tokens they hold.
template <class Group, class Layout>
std::pair<std::vector<int64_t>, int64_t> receive(const checks::Caller& caller, Group& group, int src_rank,
                                                 PagedCache<Layout>& cache, int64_t transfer_id,
                                                 std::chrono::milliseconds timeout,
                                                 const std::function<std::string(int64_t, int64_t)>& refuse,
                                                 const std::function<std::vector<int64_t>(int64_t, int64_t)>& allocate,
                                                 const std::function<void(const std::vector<int64_t>&)>& undo) {
  namespace w = transfer::wire;
  peer_rank(caller, "src_rank", group, src_rank);
  positive_timeout(caller, timeout);
  const auto deadline = Clock::now() + timeout;
  const at::Device device = cache.device();
  const std::vector<int64_t> h = receive_header(caller, group, src_rank, transfer_id, device, deadline);

  // Validate everything before allocating; a rejection is sent back so that
  // the sender fails too (and sends no payload).
  HeaderVerdict check = check_header(cache, h, transfer_id);
  if (check.verdict == w::accept) {
    std::string why = refuse(h[w::first_page], h[w::n_tokens]);
    if (!why.empty()) {
      check.verdict = w::window;
      check.reason = "window: " + why;
    }
  }
  std::vector<int64_t> pages;
  if (check.verdict == w::accept) {
    pages = allocate(h[w::n_pages], h[w::n_tokens]);
    if (static_cast<int64_t>(pages.size()) != h[w::n_pages]) {
      check.verdict = w::short_pool;
      check.detail = cache.n_free();
      check.reason = "short pool: the transfer needs " + std::to_string(h[w::n_pages]) + " pages, the pool has " +
                     std::to_string(cache.n_free()) + " free";
      pages.clear();
    }
  }
  // From here on every failure frees the fresh pages.
  try {
    std::vector<decltype(send_one(group, at::Tensor(), src_rank, w::kReplyTag))> reply_work{
        send_one(group, words_on({w::kReplyMagic, check.verdict, h[w::transfer_id], check.detail}, device), src_rank,
                 w::kReplyTag)};
    if (check.verdict != w::accept) {
      // Best effort: the sender learns why; our own error is the one thrown.
      try {
        wait_all(caller, reply_work, deadline, "reply");
      } catch (const c10::Error&) {  // NOLINT(bugprone-empty-catch)
      }
      TORCH_CHECK(false, caller, ": transfer ", transfer_id, " from rank ", src_rank, " rejected: ", check.reason);
    }
    const int64_t n = h[w::n_pages];
    const bool quantized = is_quantized(cache.quant());
    const LayerSections sections = layer_sections(cache, n, cache.n_kv_heads());
    const at::Tensor staging = receive_payload(caller, group, src_rank, cache, h, sections, transfer_id, deadline);
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

}  // namespace transfer

}  // namespace pagedkv
