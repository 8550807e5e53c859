// Page transfer between processes (pagedkv/transfer.hpp) over Gloo on
// 127.0.0.1. Each test runs rank 0 in this process and every other rank in
// a child: this binary re-executed (no fork after libtorch's threads have
// started) with PAGEDKV_TRANSFER_ROLE naming the child's role. A TCPStore on
// a free port joins them. Every wait is bounded: transfers take timeouts of
// seconds, a child that outlives its limit is killed.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pagedkv/transfer.hpp"
#include "test_support.hpp"

extern char** environ;

namespace {

using namespace pagedkv_test;
using pagedkv::HeadRange;
using pagedkv::SequenceTable;
using Group = c10d::ProcessGroupGloo;
using std::chrono::milliseconds;

// A transfer that should succeed: generous, since six sanitized processes
// on two cores connect and transfer slowly (10 s was once too short there).
constexpr milliseconds kTimeout{20000};
constexpr milliseconds kChildLimit{30000};  // a child still running after this is killed

/// What both sides of a transfer agree on, as key=value pairs (the child
/// gets it in PAGEDKV_TRANSFER_SPEC). Keys prefixed r_ override the
/// receiver's cache; everything else describes the sender's.
class Spec {
 public:
  Spec() = default;
  explicit Spec(const std::string& text) {
    std::stringstream in(text);
    std::string item;
    while (std::getline(in, item, ',')) {
      const size_t eq = item.find('=');
      if (eq != std::string::npos) kv_[item.substr(0, eq)] = item.substr(eq + 1);
    }
  }
  Spec& set(const std::string& key, const std::string& value) {
    kv_[key] = value;
    return *this;
  }
  Spec& set(const std::string& key, int64_t value) { return set(key, std::to_string(value)); }
  std::string str(const std::string& key, const std::string& fallback = "") const {
    const auto it = kv_.find(key);
    return it == kv_.end() ? fallback : it->second;
  }
  int64_t num(const std::string& key, int64_t fallback) const {
    const auto it = kv_.find(key);
    return it == kv_.end() ? fallback : std::stoll(it->second);
  }
  /// The receiver's value: r_<key>, else the sender's.
  std::string r_str(const std::string& key, const std::string& fallback) const {
    return str("r_" + key, str(key, fallback));
  }
  int64_t r_num(const std::string& key, int64_t fallback) const { return num("r_" + key, num(key, fallback)); }
  std::string text() const {
    std::string out;
    for (const auto& kv : kv_) out += kv.first + "=" + kv.second + ",";
    return out;
  }

 private:
  std::map<std::string, std::string> kv_;
};

at::ScalarType dtype_of(const std::string& name) {
  if (name == "f16") return at::kHalf;
  if (name == "bf16") return at::kBFloat16;
  return at::kFloat;
}

pagedkv::KVFormat format_of(const std::string& name) {
  if (name == "fp8") return pagedkv::KVFormat::fp8_e4m3;
  if (name == "int8") return pagedkv::KVFormat::int8;
  return pagedkv::KVFormat::native;
}

/// The sender's formats (k_format, v_format: native, fp8, int8).
pagedkv::KVQuant quant_of(const Spec& s) {
  return {format_of(s.str("k_format", "native")), format_of(s.str("v_format", "native"))};
}

/// The receiver's formats (r_k_format, r_v_format; else the sender's).
pagedkv::KVQuant r_quant_of(const Spec& s) {
  return {format_of(s.r_str("k_format", "native")), format_of(s.r_str("v_format", "native"))};
}

/// Distinct values for a side's storage: elements, int8 codes, or fp8 codes
/// (never the NaN codes 0x7F / 0xFF, so that gathers compare bit for bit).
at::Tensor side_pattern(const at::Tensor& storage, int64_t seed) {
  if (storage.scalar_type() != at::kByte && storage.scalar_type() != at::kChar) {
    return pattern(storage.sizes(), seed, storage.options());
  }
  at::Tensor v = (at::arange(storage.numel(), at::kLong) * 7 + seed * 131) % 251;  // 0..250
  v = storage.scalar_type() == at::kChar ? v - 125 : v - v.eq(127).to(at::kLong);
  return v.to(storage.scalar_type()).view(storage.sizes());
}

/// Calls body(NHD{}) or body(HND{}).
template <class Body>
void with_layout(const std::string& name, Body&& body) {
  if (name == "HND") {
    body(HND{});
  } else {
    body(NHD{});
  }
}

// ---- the caches both sides build from a Spec ----

int64_t pages_for(int64_t tokens, int64_t page_size) { return (tokens + page_size - 1) / page_size; }

/// The sender's cache: every page allocated, filled with distinct values.
template <class L>
PagedCache<L> sender_cache(const Spec& s) {
  PagedCache<L> cache(s.num("layers", 3), s.num("pages", 16), s.num("page_size", 5), s.num("heads", 4),
                      s.num("head_dim", 8), at::TensorOptions().dtype(dtype_of(s.str("dtype", "f32"))), quant_of(s));
  cache.alloc_n(cache.n_pages());
  const int64_t seed = s.num("seed", 1);
  cache.k_cache().copy_(side_pattern(cache.k_cache(), seed));
  cache.v_cache().copy_(side_pattern(cache.v_cache(), seed + 7));
  // Scales of quantized sides: positive and distinct.
  if (cache.k_scales().defined()) cache.k_scales().copy_(side_pattern(cache.k_scales(), seed + 3).abs() + 0.25);
  if (cache.v_scales().defined()) cache.v_scales().copy_(side_pattern(cache.v_scales(), seed + 5).abs() + 0.25);
  return cache;
}

/// The sent pages, fragmented: i -> (5 i + 3) mod n_pages.
std::vector<int64_t> sent_pages(const Spec& s) {
  const int64_t n = pages_for(s.num("tokens", 13), s.num("page_size", 5));
  std::vector<int64_t> pages;
  for (int64_t i = 0; i < n; ++i) pages.push_back((5 * i + 3) % s.num("pages", 16));
  return pages;
}

HeadRange sent_heads(const Spec& s) { return {s.num("begin", 0), s.num("end", -1)}; }

/// The receiver's cache; r_hold pages (every other one from 0) stay
/// allocated before the transfer so that the free list is fragmented.
template <class L>
PagedCache<L> receiver_cache(const Spec& s) {
  const HeadRange h = sent_heads(s);
  const int64_t width = (h.end == -1 ? s.num("heads", 4) : h.end) - h.begin;
  PagedCache<L> cache(s.r_num("layers", 3), s.num("r_pages", 16), s.r_num("page_size", 5),
                      s.num("r_heads", width), s.r_num("head_dim", 8),
                      at::TensorOptions().dtype(dtype_of(s.r_str("dtype", "f32"))), r_quant_of(s));
  std::vector<int64_t> all = cache.alloc_n(cache.n_pages());
  for (int64_t p = 0; p < cache.n_pages(); ++p) {
    if (p % 2 == 1 || p / 2 >= s.num("r_hold", 3)) cache.free(p);
  }
  return cache;
}

/// Tokens [0, n_tokens) of `pages`, layer `layer`, as [1, T, H, D] k and v.
template <class L>
std::pair<at::Tensor, at::Tensor> tokens_of(const PagedCache<L>& cache, int64_t layer, const std::vector<int64_t>& pages,
                                            int64_t n_tokens) {
  const at::Tensor table = ints(pages).view({1, -1});
  return cache.gather(layer, table, ints({n_tokens}));
}

/// "" when the received pages hold exactly the sender's tokens and heads.
template <class L>
std::string verify(const Spec& s, const PagedCache<L>& cache, const std::vector<int64_t>& pages) {
  std::string error;
  with_layout(s.str("layout", "NHD"), [&](auto tag) {
    using SL = decltype(tag);
    const PagedCache<SL> sender = sender_cache<SL>(s);
    const int64_t n_tokens = s.num("tokens", 13);
    HeadRange h = sent_heads(s);
    if (h.end == -1) h.end = sender.n_kv_heads();
    if (static_cast<int64_t>(pages.size()) != pages_for(n_tokens, cache.page_size())) {
      error = "received " + std::to_string(pages.size()) + " pages";
      return;
    }
    for (int64_t layer = 0; layer < cache.n_layers() && error.empty(); ++layer) {
      const auto want = tokens_of(sender, layer, sent_pages(s), n_tokens);
      const auto got = tokens_of(cache, layer, pages, n_tokens);
      if (!bitwise_equal(got.first, want.first.narrow(2, h.begin, h.end - h.begin)) ||
          !bitwise_equal(got.second, want.second.narrow(2, h.begin, h.end - h.begin))) {
        error = "layer " + std::to_string(layer) + " differs";
      }
    }
  });
  return error;
}

/// Whether two snapshots hold the same scales (both undefined for a native side).
bool same_scales(const CacheSnapshot& a, const CacheSnapshot& b) {
  const auto same = [](const at::Tensor& x, const at::Tensor& y) {
    return x.defined() == y.defined() && (!x.defined() || bitwise_equal(x, y));
  };
  return same(a.k_scales, b.k_scales) && same(a.v_scales, b.v_scales);
}

/// "" when `call` threw a c10::Error containing `expected` (or, with
/// `expected` empty, did not throw).
template <class Call>
std::string outcome(const std::string& expected, Call&& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (expected.empty()) return "unexpected error: " + msg;
    if (msg.find(expected) == std::string::npos) return "error without '" + expected + "': " + msg;
    return "";
  }
  return expected.empty() ? "" : "expected an error containing '" + expected + "', none thrown";
}

/// s.backend = generic: the device-agnostic ATen path (what CUDA caches take).
pagedkv::Backend backend_of(const Spec& s) {
  return s.str("backend") == "generic" ? pagedkv::Backend::generic : pagedkv::Backend::automatic;
}

// ---- roles: each returns "" on success, else what went wrong ----

using Role = std::function<std::string(Group&, const Spec&)>;

/// send_pages (s: to, id, expect = the sender's expected error, repeat).
std::string role_send(Group& group, const Spec& s) {
  const pagedkv::ScopedBackend backend(backend_of(s));
  std::string error;
  with_layout(s.str("layout", "NHD"), [&](auto tag) {
    using L = decltype(tag);
    const PagedCache<L> cache = sender_cache<L>(s);
    const CacheSnapshot before(cache);
    const at::Tensor pages = ints(sent_pages(s), s.str("index") == "i32" ? at::kInt : at::kLong);
    for (int64_t attempt = 0; attempt < s.num("repeat", 1) && error.empty(); ++attempt) {
      const bool last = attempt + 1 == s.num("repeat", 1);
      error = outcome(last ? s.str("expect") : "rejected", [&] {
        pagedkv::send_pages(group, static_cast<int>(s.num("to", group.getRank() == 0 ? 1 : 0)), cache, pages, s.num("tokens", 13),
                            s.num("id", 1), milliseconds(s.num("timeout_ms", kTimeout.count())), sent_heads(s));
      });
    }
    const CacheSnapshot after(cache);
    if (!bitwise_equal(after.k, before.k) || !bitwise_equal(after.v, before.v) || !same_scales(after, before) ||
        after.n_free != before.n_free) {
      error += "; the sender's cache changed";
    }
  });
  return error;
}

/// recv_pages (s: from, r_id, r_expect), then verifies and frees.
std::string role_recv(Group& group, const Spec& s) {
  const pagedkv::ScopedBackend backend(backend_of(s));
  std::string error;
  with_layout(s.r_str("layout", "NHD"), [&](auto tag) {
    using L = decltype(tag);
    PagedCache<L> cache = receiver_cache<L>(s);
    const CacheSnapshot before(cache);
    std::vector<int64_t> pages;
    error = outcome(s.str("r_expect"), [&] {
      pages = pagedkv::recv_pages(group, static_cast<int>(s.num("from", group.getRank() == 0 ? 1 : 0)), cache, s.num("r_id", s.num("id", 1)),
                                  milliseconds(s.num("r_timeout_ms", kTimeout.count())));
    });
    if (!s.str("r_expect").empty()) {
      const CacheSnapshot after(cache);
      if (!bitwise_equal(after.k, before.k) || !bitwise_equal(after.v, before.v) || !same_scales(after, before) ||
          after.refs != before.refs) {
        error += "; a failed receive changed the cache or pool";
      }
      return;
    }
    if (!error.empty()) return;
    for (const int64_t p : pages) {
      if (cache.ref_count(p) != 1) error += "; page " + std::to_string(p) + " has ref_count != 1";
    }
    if (error.empty()) error = verify(s, cache, pages);
    for (const int64_t p : pages) cache.free(p);
    if (cache.n_free() != before.n_free) error += "; pages leaked";
    cache.check();
  });
  return error;
}

/// A sender that sends a valid header, reads the reply, then sends only
/// s.sent_layers of the payload messages (garbage) and dies (exit 3).
std::string role_send_and_die(Group& group, const Spec& s) {
  namespace w = pagedkv::transfer::wire;
  const PagedCache<NHD> cache = sender_cache<NHD>(s);
  const std::vector<int64_t> pages = sent_pages(s);
  HeadRange heads{0, cache.n_kv_heads()};
  std::vector<at::Tensor> header{
      ints(pagedkv::transfer::header_words(cache, static_cast<int64_t>(pages.size()), s.num("tokens", 13),
                                                  s.num("id", 1), heads))};
  std::vector<at::Tensor> reply{at::zeros({w::kReplyWords}, at::kLong)};
  group.send(header, 0, w::kHeaderTag)->wait(kTimeout);
  group.recv(reply, 0, w::kReplyTag)->wait(kTimeout);
  const int64_t layer_elems = 2 * static_cast<int64_t>(pages.size()) * cache.geometry().page_elems;
  for (int64_t layer = 0; layer < s.num("sent_layers", 0); ++layer) {
    std::vector<at::Tensor> chunk{at::full({layer_elems}, 99.0, at::kFloat)};
    group.send(chunk, 0, w::kPayloadTag)->wait(kTimeout);
  }
  std::fflush(nullptr);
  _exit(3);
}

/// A receiver that accepts a header, receives s.recv_layers payload
/// messages and dies (exit 3).
std::string role_recv_and_die(Group& group, const Spec& s) {
  namespace w = pagedkv::transfer::wire;
  std::vector<at::Tensor> header{at::zeros({w::kHeaderWords}, at::kLong)};
  group.recv(header, 0, w::kHeaderTag)->wait(kTimeout);
  std::vector<at::Tensor> reply{ints({w::kReplyMagic, w::accept, header[0][w::transfer_id].item<int64_t>(), 0})};
  group.send(reply, 0, w::kReplyTag)->wait(kTimeout);
  const int64_t layer_bytes = header[0][w::payload_bytes].item<int64_t>() / header[0][w::n_layers].item<int64_t>();
  for (int64_t layer = 0; layer < s.num("recv_layers", 0); ++layer) {
    std::vector<at::Tensor> chunk{at::empty({layer_bytes}, at::kByte)};
    group.recv(chunk, 0, w::kPayloadTag)->wait(kTimeout);
  }
  std::fflush(nullptr);
  _exit(3);
}

/// recv_sequence into a table that already holds one sequence; a failure
/// (s.r_expect) must leave the table, its pool and its cache as they were.
std::string role_recv_sequence(Group& group, const Spec& s) {
  PagedCache<NHD> cache = receiver_cache<NHD>(s);
  for (int64_t p = 0; p < cache.n_pages(); ++p) {
    if (cache.ref_count(p) > 0) cache.free(p);
  }
  SequenceTable<NHD> seqs(cache);
  const int64_t first = seqs.create();
  if (!seqs.reserve(first, s.num("r_hold", 3) * cache.page_size())) return "reserve failed";
  const CacheSnapshot before(cache);
  int64_t seq = -1;
  std::string error = outcome(s.str("r_expect"), [&] {
    seq = pagedkv::recv_sequence(group, 1, seqs, s.num("r_id", s.num("id", 1)), kTimeout);
  });
  if (!s.str("r_expect").empty()) {
    const CacheSnapshot after(cache);
    if (!bitwise_equal(after.k, before.k) || !bitwise_equal(after.v, before.v) || after.refs != before.refs) {
      error += "; a failed recv_sequence changed the cache or pool";
    }
    if (seqs.size() != 1 || seqs.contains(1)) error += "; a failed recv_sequence changed the table";
    if (seqs.create() != 1) error += "; the next id moved";
    return error;
  }
  if (!error.empty()) return error;
  if (seq != 1 || seqs.length(seq) != s.num("tokens", 13)) return "wrong sequence id or length";
  error = verify(s, cache, std::vector<int64_t>(seqs.pages(seq).begin(),
                                                seqs.pages(seq).begin() +
                                                    static_cast<std::ptrdiff_t>(pages_for(s.num("tokens", 13), cache.page_size()))));
  seqs.release(seq);
  seqs.release(first);
  if (cache.n_free() != cache.n_pages()) error += "; pages leaked";
  return error;
}

/// A rank that sends a header of garbage (s.garbage = huge: a well-formed
/// header, checksum included, announcing INT64_MAX tokens).
std::string role_send_garbage(Group& group, const Spec& s) {
  namespace w = pagedkv::transfer::wire;
  std::vector<at::Tensor> header{at::arange(w::kHeaderWords, at::kLong)};
  if (s.str("garbage") == "huge") {
    const PagedCache<NHD> cache = sender_cache<NHD>(s);
    std::vector<int64_t> words = pagedkv::transfer::header_words(cache, 3, 13, 1, HeadRange{0, 4});
    words[w::n_tokens] = std::numeric_limits<int64_t>::max();
    words[w::n_pages] = words[w::n_tokens] / 5 + 1;
    words[w::checksum] = w::checksum_of(words.data());
    header[0] = ints(words);
    std::vector<at::Tensor> reply{at::zeros({w::kReplyWords}, at::kLong)};
    group.send(header, 0, w::kHeaderTag)->wait(kTimeout);
    group.recv(reply, 0, w::kReplyTag)->wait(kTimeout);
    return reply[0][w::verdict].item<int64_t>() == w::short_pool ? "" : "expected a short_pool verdict";
  }
  std::vector<at::Tensor> reply{at::zeros({w::kReplyWords}, at::kLong)};
  group.send(header, 0, w::kHeaderTag)->wait(kTimeout);
  group.recv(reply, 0, w::kReplyTag)->wait(kTimeout);
  return reply[0][w::verdict].item<int64_t>() == w::bad_header ? "" : "expected a bad_header verdict";
}

/// Sends, for every header word but the checksum and the informational
/// sender_heads, a valid header with that word replaced by a random value
/// (the checksum recomputed, so validation goes past it). Every one must be
/// rejected: a header accepted by mistake leaves the receiver waiting for a
/// payload, which fails this role's reply wait.
std::string role_send_mutated_headers(Group& group, const Spec& s) {
  namespace w = pagedkv::transfer::wire;
  const PagedCache<NHD> cache = sender_cache<NHD>(s);
  const std::vector<int64_t> valid = pagedkv::transfer::header_words(cache, 3, 13, 1, HeadRange{0, 4});
  std::mt19937_64 rng(static_cast<uint64_t>(s.num("seed", 1)));
  std::string error;
  for (int64_t field = 0; field < w::checksum; ++field) {
    if (field == w::sender_heads) continue;
    std::vector<int64_t> words = valid;
    do {
      words[static_cast<size_t>(field)] = static_cast<int64_t>(rng() >> (rng() % 63));
    } while (words[static_cast<size_t>(field)] == valid[static_cast<size_t>(field)]);
    words[w::checksum] = w::checksum_of(words.data());
    std::vector<at::Tensor> header{ints(words)};
    std::vector<at::Tensor> reply{at::zeros({w::kReplyWords}, at::kLong)};
    group.send(header, 0, w::kHeaderTag)->wait(kTimeout);
    group.recv(reply, 0, w::kReplyTag)->wait(kTimeout);
    if (reply[0][w::verdict].item<int64_t>() == w::accept) {
      error += "field " + std::to_string(field) + " = " + std::to_string(words[static_cast<size_t>(field)]) +
               " accepted; ";
    }
  }
  return error;
}

/// Receives what role_send_mutated_headers sends: every call must throw
/// and leave the cache as it was.
std::string role_recv_mutated_headers(Group& group, const Spec& s) {
  PagedCache<NHD> cache = receiver_cache<NHD>(s);
  const CacheSnapshot before(cache);
  std::string error;
  for (int64_t field = 0; field < pagedkv::transfer::wire::checksum - 1; ++field) {
    error += outcome("rejected", [&] { pagedkv::recv_pages(group, 1, cache, 1, milliseconds(3000)); });
  }
  const CacheSnapshot after(cache);
  if (!bitwise_equal(after.k, before.k) || after.refs != before.refs) error += "; the cache changed";
  return error;
}

/// A rank that joins the group and never transfers (until it is killed).
std::string role_idle(Group&, const Spec&) {
  std::this_thread::sleep_for(kChildLimit);
  return "";
}


std::vector<int64_t> rank_list(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ':')) out.push_back(std::stoll(item));
  return out;
}

/// The spec of one route of a TP resharding (s: model_heads, src_tp,
/// dst_tp, src_ranks, dst_ranks as "a:b"): the source rank's cache holds its
/// own heads and its own values (seed 1 + source index).
Spec route_spec(const Spec& s, const pagedkv::HeadRoute& route) {
  const int64_t model_heads = s.num("model_heads", 4);
  const pagedkv::HeadRange held = pagedkv::tp_head_range(model_heads, s.num("src_tp", 1), route.src_rank);
  Spec out = s;
  out.set("heads", held.end - held.begin).set("seed", 1 + route.src_rank);
  out.set("begin", route.heads.begin).set("end", route.heads.end).set("id", 100 + route.dst_rank);
  out.set("to", rank_list(s.str("dst_ranks"))[static_cast<size_t>(route.dst_rank)]);
  out.set("from", rank_list(s.str("src_ranks"))[static_cast<size_t>(route.src_rank)]);
  return out;
}

int64_t index_of(const std::vector<int64_t>& ranks, int64_t rank) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == rank) return static_cast<int64_t>(i);
  }
  return -1;
}

/// A source rank of a resharding: sends every route that starts here.
std::string role_send_routes(Group& group, const Spec& s) {
  const int64_t me = index_of(rank_list(s.str("src_ranks")), group.getRank());
  std::string error;
  for (const auto& route : pagedkv::tp_routes(s.num("model_heads", 4), s.num("src_tp", 1), s.num("dst_tp", 1))) {
    if (route.src_rank == me) error += role_send(group, route_spec(s, route));
  }
  return error;
}

/// A destination rank of a resharding: receives its route and checks it.
std::string role_recv_route(Group& group, const Spec& s) {
  const int64_t me = index_of(rank_list(s.str("dst_ranks")), group.getRank());
  for (const auto& route : pagedkv::tp_routes(s.num("model_heads", 4), s.num("src_tp", 1), s.num("dst_tp", 1))) {
    if (route.dst_rank == me) return role_recv(group, route_spec(s, route));
  }
  return "no route to destination " + std::to_string(me);
}

/// Receives s.repeat transfers into caches that differ from the sender's in
/// one way each (every one rejected, naming the cause), then one that matches.
std::string role_recv_mismatches(Group& group, const Spec& s) {
  const std::vector<std::vector<std::string>> cases{
      {"r_dtype", "bf16", "dtype mismatch: expected BFloat16 (this cache's), got Half (the sender's)"},
      {"r_layers", "2", "n_layers mismatch: expected 2 (this cache's), got 3"},
      {"r_page_size", "4", "page_size mismatch: expected 4"},
      {"r_head_dim", "16", "head_dim mismatch: expected 16"},
      {"r_heads", "3", "n_kv_heads (the width of the sent head range) mismatch: expected 3"},
      {"r_id", "9", "wrong transfer id: expected 9, got 1"},
      {"r_pages", "4", "short pool: the transfer needs 3 pages, the pool has 2 free"},
      {"r_k_format", "fp8", "k quantization (KVFormat) mismatch: expected fp8_e4m3 (this cache's), got native"},
      {"r_v_format", "int8", "v quantization (KVFormat) mismatch: expected int8 (this cache's), got native"},
  };
  std::string error;
  for (const auto& c : cases) {
    Spec m = s;
    m.set(c[0], c[1]).set("r_expect", c[2]);
    const std::string e = role_recv(group, m);
    if (!e.empty()) error += c[0] + ": " + e + "; ";
  }
  return error + role_recv(group, s);
}

/// Both ranks send a transfer to the other and receive the other's at the
/// same time (a thread each), twice.
std::string role_exchange(Group& group, const Spec& s) {
  const int64_t me = group.getRank();
  const int64_t other = 1 - me;
  std::string error;
  for (int round = 0; round < 2; ++round) {
    Spec out = s;
    out.set("to", other).set("id", 10 * round + 1 + me).set("seed", 10 * round + 1 + me);
    Spec in = s;
    in.set("from", other).set("id", 10 * round + 1 + other).set("seed", 10 * round + 1 + other);
    std::string send_error;
    std::thread sender([&] { send_error = role_send(group, out); });
    error += role_recv(group, in);
    sender.join();
    error += send_error;
  }
  return error;
}

/// Bad arguments throw before anything is sent and change nothing.
std::string role_bad_args(Group& group, const Spec& s) {
  PagedCache<HND> cache = sender_cache<HND>(s);
  cache.free(15);
  const CacheSnapshot before(cache);
  const at::Tensor pages = ints(sent_pages(s));  // 3 pages for 13 tokens
  const auto send = [&](int dst, const at::Tensor& p, int64_t tokens, milliseconds timeout, HeadRange heads) {
    return [&, dst, tokens, timeout, heads] {
      pagedkv::send_pages(group, dst, cache, p, tokens, 1, timeout, heads);
    };
  };
  std::string error;
  const auto expect = [&](const std::string& what, const std::function<void()>& call) {
    const std::string e = outcome(what, call);
    if (!e.empty()) error += e + "; ";
  };
  const milliseconds t{1000};
  expect("pagedkv::send_pages<HND>: argument 'dst_rank' expected a rank of the group other than this one ([0, 2) "
         "without 0), got 0",
         send(0, pages, 13, t, {}));
  expect("argument 'dst_rank' expected a rank of the group", send(2, pages, 13, t, {}));
  expect("argument 'timeout' expected > 0 ms, got 0 ms", send(1, pages, 13, milliseconds(0), {}));
  expect("argument 'n_tokens' expected >= 0, got -1", send(1, pages, -1, t, {}));
  expect("argument 'pages' expected 4 pages (the pages that hold n_tokens = 16 at page_size 5), got 3",
         send(1, pages, 16, t, {}));
  expect("argument 'pages' expected allocated pages, got pages[0] = 15 which is free",
         send(1, ints({15, 1, 2}), 13, t, {}));
  expect("argument 'pages' expected 1-D", send(1, pages.view({1, 3}), 13, t, {}));
  expect("argument 'heads' expected 0 <= begin < end <= n_kv_heads = 4 (end -1 = all), got [2, 5)",
         send(1, pages, 13, t, {2, 5}));
  expect("got [2, 2)", send(1, pages, 13, t, {2, 2}));
  expect("pagedkv::recv_pages<HND>: argument 'src_rank' expected a rank of the group", [&] {
    pagedkv::recv_pages(group, 0, cache, 1, t);
  });
  expect("pagedkv::recv_pages<HND>: argument 'timeout' expected > 0 ms", [&] {
    pagedkv::recv_pages(group, 1, cache, 1, milliseconds(-5));
  });
  SequenceTable<HND> seqs(cache);
  expect("pagedkv::send_sequence<HND>: argument 'seq' expected a live sequence id of the table, got 4",
         [&] { pagedkv::send_sequence(group, 1, seqs, 4, 1, t); });
  before.expect_same(cache, "bad arguments");
  return error;
}

const std::map<std::string, Role>& roles() {
  static const std::map<std::string, Role> r{
      {"send", role_send},           {"recv", role_recv},
      {"send_and_die", role_send_and_die}, {"recv_and_die", role_recv_and_die},
      {"send_garbage", role_send_garbage}, {"idle", role_idle},
      {"exchange", role_exchange},   {"send_routes", role_send_routes},
      {"recv_route", role_recv_route}, {"recv_mismatches", role_recv_mismatches},
      {"bad_args", role_bad_args}, {"recv_sequence", role_recv_sequence},
      {"send_mutated_headers", role_send_mutated_headers}, {"recv_mutated_headers", role_recv_mutated_headers}};
  return r;
}

c10::intrusive_ptr<Group> make_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size) {
  auto options = Group::Options::create(milliseconds(20000));
  options->devices.push_back(Group::createDeviceForHostname("127.0.0.1"));
  return c10::make_intrusive<Group>(store, rank, size, options);
}

/// A child process running one role.
class Child {
 public:
  Child(const std::string& role, const Spec& spec, int rank, int size, uint16_t port) {
    std::vector<std::string> env_strings{"PAGEDKV_TRANSFER_ROLE=" + role, "PAGEDKV_TRANSFER_SPEC=" + spec.text(),
                                         "PAGEDKV_TRANSFER_RANK=" + std::to_string(rank),
                                         "PAGEDKV_TRANSFER_SIZE=" + std::to_string(size),
                                         "PAGEDKV_TRANSFER_PORT=" + std::to_string(port)};
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::string(*e).rfind("PAGEDKV_TRANSFER_", 0) != 0) env_strings.emplace_back(*e);
    }
    std::vector<char*> env;
    for (auto& e : env_strings) env.push_back(&e[0]);
    env.push_back(nullptr);
    std::string exe = "/proc/self/exe";
    char* argv[] = {&exe[0], nullptr};
    if (posix_spawn(&pid_, "/proc/self/exe", nullptr, nullptr, argv, env.data()) != 0) pid_ = -1;
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() { kill_now(); }

  /// The exit code within `limit`; -1 (and killed) past it.
  int wait(milliseconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (pid_ > 0) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(milliseconds(5));
    }
    kill_now();
    return -1;
  }

  void kill_now() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
};

/// Runs `rank0` as rank 0 here and child_roles[i] as rank i + 1; expects
/// every child to exit with child_codes[i] (default 0). Returns rank 0's
/// result.
std::string run_world(const std::string& rank0, const std::vector<std::string>& child_roles, const Spec& spec,
                      std::vector<int> child_codes = {}) {
  const int size = static_cast<int>(child_roles.size()) + 1;
  c10d::TCPStoreOptions store_options;
  store_options.port = 0;
  store_options.isServer = true;
  store_options.waitWorkers = false;
  store_options.timeout = milliseconds(20000);
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
  std::vector<std::unique_ptr<Child>> children;
  for (int r = 1; r < size; ++r) {
    children.push_back(std::make_unique<Child>(child_roles[static_cast<size_t>(r - 1)], spec, r, size,
                                               store->getPort()));
  }
  std::string result;
  {
    auto group = make_group(store, 0, size);
    result = roles().at(rank0)(*group, spec);
    child_codes.resize(children.size(), 0);
    for (size_t i = 0; i < children.size(); ++i) {
      if (child_codes[i] == -1) {  // an idle rank: done once rank 0 is
        children[i]->kill_now();
        continue;
      }
      const int code = children[i]->wait(child_codes[i] == 0 ? kChildLimit : milliseconds(5000));
      if (code != child_codes[i]) {
        result += "; child " + child_roles[i] + " (rank " + std::to_string(i + 1) + ") exited with " +
                  std::to_string(code) + ", expected " + std::to_string(child_codes[i]);
      }
    }
    for (auto& child : children) child->kill_now();  // before the group goes: its teardown may wait for peers
  }
  return result;
}

/// Runs in a child: joins the group and plays its role.
int child_main(const char* role) {
  const Spec spec(std::getenv("PAGEDKV_TRANSFER_SPEC"));
  const int rank = std::atoi(std::getenv("PAGEDKV_TRANSFER_RANK"));
  const int size = std::atoi(std::getenv("PAGEDKV_TRANSFER_SIZE"));
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(std::atoi(std::getenv("PAGEDKV_TRANSFER_PORT")));
  store_options.timeout = milliseconds(20000);
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
    auto group = make_group(store, rank, size);
    const std::string error = roles().at(role)(*group, spec);
    std::fflush(nullptr);
    if (!error.empty()) {
      std::fprintf(stderr, "[child %s rank %d] %s\n", role, rank, error.c_str());
      _exit(1);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[child %s rank %d] exception: %s\n", role, rank, e.what());
    _exit(2);
  }
  _exit(0);  // skip the group's teardown: the parent may already be gone
}

// ---- tests ----

TEST(Transfer, RoundTripIsBitExactForEveryLayoutDtypeAndIndexType) {
  for (const char* s_layout : {"NHD", "HND"}) {
    for (const char* r_layout : {"NHD", "HND"}) {
      for (const char* dtype : {"f32", "f16", "bf16"}) {
        Spec spec;
        spec.set("layout", s_layout).set("r_layout", r_layout).set("dtype", dtype);
        spec.set("index", std::string(dtype) == "f16" ? "i32" : "i64").set("tokens", 13);  // partial last page
        EXPECT_EQ(run_world("recv", {"send"}, spec), "") << spec.text();
      }
    }
  }
}

TEST(Transfer, TheGenericPathRoundTripsHeadSlicesAcrossLayouts) {
  for (const char* s_layout : {"NHD", "HND"}) {
    Spec spec;
    spec.set("backend", "generic").set("layout", s_layout).set("r_layout", s_layout[0] == 'N' ? "HND" : "NHD");
    spec.set("begin", 1).set("end", 3).set("dtype", "bf16");
    EXPECT_EQ(run_world("recv", {"send"}, spec), "") << spec.text();
  }
}

TEST(Transfer, EmptySequenceAndFullPagesRoundTrip) {
  for (int64_t tokens : {0, 5, 40}) {
    Spec spec;
    spec.set("tokens", tokens).set("r_hold", 0);
    EXPECT_EQ(run_world("recv", {"send"}, spec), "") << spec.text();
  }
}

TEST(Transfer, TheReceiverCanBeRankZeroOrTheSender) {
  Spec spec;
  spec.set("layout", "HND");
  EXPECT_EQ(run_world("send", {"recv"}, spec), "");
}

TEST(Transfer, SequencesRoundTripThroughSequenceTables) {
  // send_sequence from a table here; rank 1 (a child) receives with
  // recv_pages and checks the pages and tokens.
  Spec spec;
  spec.set("tokens", 17).set("to", 1).set("from", 0);
  const std::string result = [&] {
    c10d::TCPStoreOptions o;
    o.port = 0;
    o.isServer = true;
    o.waitWorkers = false;
    o.timeout = milliseconds(20000);
    auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
    Child child("recv", spec, 1, 2, store->getPort());
    auto group = make_group(store, 0, 2);
    // Sequence 1: 17 tokens (the sender's values), capacity 30: only the 4
    // pages that hold tokens are sent.
    PagedCache<NHD> cache = sender_cache<NHD>(spec);
    for (int64_t p = 0; p < cache.n_pages(); ++p) cache.free(p);
    SequenceTable<NHD> seqs(cache);
    const int64_t other = seqs.create();
    EXPECT_TRUE(seqs.reserve(other, 3));
    const int64_t seq = seqs.create();
    EXPECT_TRUE(seqs.reserve(seq, 30));
    seqs.commit_append(seq, 17);
    const PagedCache<NHD> reference = sender_cache<NHD>(spec);
    for (int64_t layer = 0; layer < cache.n_layers(); ++layer) {
      const auto kv = tokens_of(reference, layer, sent_pages(spec), 17);
      cache.write(layer, seqs.batch({seq}).first, 0, kv.first, kv.second);
    }
    const int64_t free_before = cache.n_free();
    pagedkv::send_sequence(*group, 1, seqs, seq, 1, kTimeout);
    EXPECT_EQ(cache.n_free(), free_before);
    EXPECT_EQ(seqs.length(seq), 17);
    const int code = child.wait(kChildLimit);
    return code == 0 ? std::string() : "child exited with " + std::to_string(code);
  }();
  EXPECT_EQ(result, "");
}

TEST(Transfer, RecvSequenceCreatesASequenceOfTheSentLength) {
  Spec spec;
  spec.set("tokens", 12).set("to", 0).set("layout", "HND");
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  o.timeout = milliseconds(20000);
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
  Child child("send", spec, 1, 2, store->getPort());
  auto group = make_group(store, 0, 2);
  PagedCache<NHD> cache(3, 16, 5, 4, 8, at::TensorOptions().dtype(at::kFloat));
  SequenceTable<NHD> seqs(cache);
  const int64_t first = seqs.create();
  ASSERT_TRUE(seqs.reserve(first, 7));
  const int64_t seq = pagedkv::recv_sequence(*group, 1, seqs, 1, kTimeout);
  EXPECT_EQ(seq, 1);
  EXPECT_EQ(seqs.length(seq), 12);
  EXPECT_EQ(verify(spec, cache, seqs.pages(seq)), "");
  seqs.release(seq);
  seqs.release(first);
  EXPECT_EQ(cache.n_free(), 16);
  EXPECT_EQ(child.wait(kChildLimit), 0);
}

TEST(Transfer, AFailedRecvSequenceLeavesTheTableAsItWas) {
  Spec short_pool;
  short_pool.set("r_pages", 5).set("r_expect", "short pool: the transfer needs 3 pages, the pool has 2 free");
  short_pool.set("expect", "rejected: short pool: the receiver needs 3 pages and has 2 free");
  EXPECT_EQ(run_world("recv_sequence", {"send"}, short_pool), "");
  Spec dies;
  dies.set("sent_layers", 2).set("r_expect", "peer gone");
  EXPECT_EQ(run_world("recv_sequence", {"send_and_die"}, dies, {3}), "");
  Spec ok;
  ok.set("layout", "HND");
  EXPECT_EQ(run_world("recv_sequence", {"send"}, ok), "");
}

TEST(Transfer, HeadSlicesGoFromOneRankToTwo) {
  // Rank 1 (TP 1, 4 kv heads) sends heads [0, 2) to rank 0 and [2, 4) to rank 2 (TP 2).
  Spec spec;
  spec.set("model_heads", 4).set("src_tp", 1).set("dst_tp", 2).set("src_ranks", "1").set("dst_ranks", "0:2");
  spec.set("layout", "HND").set("r_layout", "NHD").set("dtype", "bf16");
  EXPECT_EQ(run_world("recv_route", {"send_routes", "recv_route"}, spec), "");
}

TEST(Transfer, ReplicatedHeadsGoFromTwoRanksToOne) {
  // 2 kv heads over TP 4 (each head on two ranks) -> TP 2: the lowest rank
  // holding a head sends it; the other source ranks send nothing.
  Spec spec;
  spec.set("model_heads", 2).set("src_tp", 4).set("dst_tp", 2).set("src_ranks", "1:2:3:4").set("dst_ranks", "0:5");
  spec.set("layout", "NHD").set("r_layout", "HND").set("dtype", "f16");
  EXPECT_EQ(run_world("recv_route", {"send_routes", "send_routes", "send_routes", "send_routes", "recv_route"}, spec),
            "");
  // 1 kv head over TP 2 -> TP 1.
  spec.set("model_heads", 1).set("src_tp", 2).set("dst_tp", 1).set("src_ranks", "1:2").set("dst_ranks", "0");
  EXPECT_EQ(run_world("recv_route", {"send_routes", "send_routes"}, spec), "");
}

TEST(Transfer, TpHeadRangesAndRoutes) {
  EXPECT_EQ(pagedkv::tp_head_range(8, 4, 3).begin, 6);
  EXPECT_EQ(pagedkv::tp_head_range(8, 4, 3).end, 8);
  EXPECT_EQ(pagedkv::tp_head_range(2, 8, 5).begin, 1);  // replicated: ranks 4-7 hold head 1
  EXPECT_EQ(pagedkv::tp_head_range(2, 8, 5).end, 2);
  expect_error([] { pagedkv::tp_head_range(8, 3, 0); },
               {"pagedkv::tp_head_range: argument 'tp_size' expected a divisor of n_kv_heads 8"});
  expect_error([] { pagedkv::tp_head_range(2, 3, 0); }, {"expected a multiple of n_kv_heads 2"});
  expect_error([] { pagedkv::tp_head_range(8, 4, 4); }, {"argument 'tp_rank' expected in [0, 4), got 4"});
  const auto routes = pagedkv::tp_routes(8, 2, 4);  // 2 -> 4: each source splits its 4 heads in two
  ASSERT_EQ(routes.size(), 4u);
  EXPECT_EQ(routes[3].src_rank, 1);
  EXPECT_EQ(routes[3].heads.begin, 2);
  EXPECT_EQ(routes[3].heads.end, 4);
  // 2 -> 1 without replication: the receiver would need both senders' slices.
  expect_error([] { pagedkv::tp_routes(8, 2, 1); },
               {"pagedkv::tp_routes: expected destination rank 0's kv heads [0, 8) on one source rank"});
}

TEST(Transfer, EveryMismatchIsRejectedOnBothSidesAndTheGroupStaysUsable) {
  Spec spec;
  spec.set("dtype", "f16").set("repeat", 10).set("r_hold", 2);
  EXPECT_EQ(run_world("recv_mismatches", {"send"}, spec), "");
}

TEST(Transfer, QuantizedPagesTravelWithTheirScales) {
  const std::vector<std::pair<const char*, const char*>> formats{
      {"fp8", "fp8"}, {"int8", "int8"}, {"fp8", "int8"}, {"native", "int8"}, {"fp8", "native"}};
  for (const auto& f : formats) {
    for (const char* r_layout : {"NHD", "HND"}) {
      Spec spec;
      spec.set("layout", "HND").set("r_layout", r_layout).set("dtype", "f16");
      spec.set("k_format", f.first).set("v_format", f.second).set("tokens", 13);
      EXPECT_EQ(run_world("recv", {"send"}, spec), "") << spec.text();
    }
  }
}

TEST(Transfer, AHeaderOfGarbageIsRejected) {
  Spec spec;
  spec.set("from", 1).set("r_expect", "rejected: bad header: not a pagedkv transfer header");
  EXPECT_EQ(run_world("recv", {"send_garbage"}, spec), "");
  spec.set("garbage", "huge").set("r_expect", "rejected: short pool: the transfer needs 1844674407370955162 pages");
  EXPECT_EQ(run_world("recv", {"send_garbage"}, spec), "");
}

TEST(Transfer, EveryHeaderWordWithARandomValueIsRejected) {
  for (int64_t seed : {1, 2, 3}) {
    Spec spec;
    spec.set("seed", seed);
    EXPECT_EQ(run_world("recv_mutated_headers", {"send_mutated_headers"}, spec), "") << "seed " << seed;
  }
}

TEST(Transfer, ATimeoutThrowsAndChangesNothing) {
  Spec spec;
  spec.set("r_timeout_ms", 300).set("r_expect", "no header of transfer 1 from rank 1: timeout");
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(run_world("recv", {"idle"}, spec, {-1}), "");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(Transfer, ASenderDyingBeforeOrDuringThePayloadFailsTheReceiveCleanly) {
  for (int64_t sent_layers : {0, 1}) {
    Spec spec;
    spec.set("sent_layers", sent_layers).set("r_timeout_ms", 8000);
    spec.set("r_expect", "payload of transfer 1 from rank 1: peer gone");
    EXPECT_EQ(run_world("recv", {"send_and_die"}, spec, {3}), "") << "sent layers " << sent_layers;
  }
}

TEST(Transfer, AReceiverDyingFailsTheSend) {
  for (int64_t recv_layers : {0, 1}) {
    Spec spec;
    spec.set("recv_layers", recv_layers).set("timeout_ms", 8000).set("pages", 64).set("tokens", 300);
    spec.set("expect", "transfer 1 to rank 1: payload: peer gone");
    EXPECT_EQ(run_world("send", {"recv_and_die"}, spec, {3}), "") << "received layers " << recv_layers;
  }
}

TEST(Transfer, TwoTransfersInOppositeDirectionsInterleave) {
  Spec spec;
  spec.set("tokens", 23).set("layout", "HND");
  EXPECT_EQ(run_world("exchange", {"exchange"}, spec), "");
}

TEST(Transfer, BadArgumentsThrowBeforeAnythingIsSent) {
  EXPECT_EQ(run_world("bad_args", {"idle"}, Spec(), {-1}), "");
}

// ---- in-process tests: a scripted group (the group is a template parameter) ----

/// A work whose wait runs `complete` (which may throw, as Gloo's does).
struct FakeWork {
  std::function<bool()> complete;
  bool wait(milliseconds /*timeout*/) { return complete(); }
  void abort() {}
};

/// A group that records what is sent and serves receives from `inbox`, in
/// order; receive number `fail_at` and later fail with `failure` when
/// waited on. A receive into a buffer of another size than its message
/// fails the test (the receiver must post exactly the announced sizes).
struct FakeGroup {
  int rank = 0;
  std::vector<at::Tensor> sent;
  std::vector<at::Tensor> inbox;
  size_t received = 0;
  size_t fail_at = SIZE_MAX;
  size_t fail_send_at = SIZE_MAX;
  std::string failure = "[gloo/transport/tcp/pair.cc:589] Read error: Connection reset by peer";

  int getRank() const { return rank; }
  int getSize() const { return 2; }
  std::shared_ptr<FakeWork> send(std::vector<at::Tensor>& tensors, int /*dst*/, int /*tag*/) {
    const size_t index = sent.size();
    sent.push_back(tensors[0].clone());
    const std::string why = failure;
    const bool fails = index >= fail_send_at;
    return std::make_shared<FakeWork>(FakeWork{[fails, why] {
      if (fails) throw std::runtime_error(why);
      return true;
    }});
  }
  std::shared_ptr<FakeWork> recv(std::vector<at::Tensor>& tensors, int /*src*/, int /*tag*/) {
    const size_t index = received++;
    at::Tensor dst = tensors[0];
    const bool fails = index >= fail_at || index >= inbox.size();
    const at::Tensor message = fails ? at::Tensor() : inbox[index];
    const std::string why = failure;
    return std::make_shared<FakeWork>(FakeWork{[=] {
      if (fails) throw std::runtime_error(why);
      EXPECT_EQ(dst.nbytes(), message.nbytes()) << "receive " << index << " posted a buffer of another size";
      if (dst.nbytes() != message.nbytes()) throw std::runtime_error("size mismatch");
      std::memcpy(dst.data_ptr(), message.data_ptr(), message.nbytes());
      return true;
    }});
  }
};

/// The messages send_pages sends for `spec` (its reply accepted).
std::vector<at::Tensor> recorded_transfer(const Spec& spec) {
  namespace w = pagedkv::transfer::wire;
  FakeGroup sender;
  sender.inbox.push_back(ints({w::kReplyMagic, w::accept, spec.num("id", 1), 0}));
  const PagedCache<NHD> cache = sender_cache<NHD>(spec);
  pagedkv::send_pages(sender, 1, cache, ints(sent_pages(spec)), spec.num("tokens", 13), spec.num("id", 1), kTimeout,
                      sent_heads(spec));
  return sender.sent;
}

TEST(TransferInProcess, ARecordedTransferRoundTrips) {
  Spec spec;
  spec.set("begin", 1).set("end", 3);
  FakeGroup receiver;
  receiver.rank = 1;
  receiver.inbox = recorded_transfer(spec);
  ASSERT_EQ(receiver.inbox.size(), 1u + 3u);  // header + one message per layer
  PagedCache<NHD> cache = receiver_cache<NHD>(spec);
  const std::vector<int64_t> pages = pagedkv::recv_pages(receiver, 0, cache, 1, kTimeout);
  EXPECT_EQ(verify(spec, cache, pages), "");
  ASSERT_EQ(receiver.sent.size(), 1u);  // the reply
  EXPECT_EQ(receiver.sent[0][pagedkv::transfer::wire::verdict].item<int64_t>(), pagedkv::transfer::wire::accept);
}

TEST(TransferInProcess, APeerLostAtAnyMessageLeavesTheReceiverAsItWas) {
  Spec spec;
  const std::vector<at::Tensor> messages = recorded_transfer(spec);
  for (const std::string failure : {"Connection reset by peer", "Timed out waiting 300ms for recv operation"}) {
    for (size_t fail_at = 0; fail_at < messages.size(); ++fail_at) {
      for_each_layout([&](auto tag) {
        using L = decltype(tag);
        FakeGroup receiver;
        receiver.rank = 1;
        receiver.inbox = messages;
        receiver.fail_at = fail_at;
        receiver.failure = failure;
        PagedCache<L> cache = receiver_cache<L>(spec);
        const CacheSnapshot before(cache);
        expect_error([&] { pagedkv::recv_pages(receiver, 0, cache, 1, kTimeout); },
                     {fail_at == 0 ? "no header of transfer 1 from rank 0" : "payload of transfer 1 from rank 0",
                      failure[0] == 'T' ? "timeout" : "peer gone", "rebuild the process group"});
        before.expect_same(cache, "failure at message " + std::to_string(fail_at));
      });
    }
  }
  // The staging buffer dropped after the failures is not needed for the next transfer.
  FakeGroup receiver;
  receiver.rank = 1;
  receiver.inbox = messages;
  PagedCache<HND> cache = receiver_cache<HND>(spec);
  EXPECT_EQ(verify(spec, cache, pagedkv::recv_pages(receiver, 0, cache, 1, kTimeout)), "");
}

TEST(TransferInProcess, ASendFailingAtAnyStepThrowsAndLeavesTheSenderAsItWas) {
  namespace w = pagedkv::transfer::wire;
  Spec spec;
  const size_t n_sends = recorded_transfer(spec).size();  // header + 3 layers
  for (size_t fail_send_at = 0; fail_send_at <= n_sends; ++fail_send_at) {
    FakeGroup sender;
    sender.inbox.push_back(ints({w::kReplyMagic, w::accept, 1, 0}));
    if (fail_send_at == n_sends) sender.fail_at = 0;  // the reply is lost instead
    sender.fail_send_at = fail_send_at;
    const PagedCache<HND> cache = sender_cache<HND>(spec);
    const CacheSnapshot before(cache);
    expect_error([&] { pagedkv::send_pages(sender, 1, cache, ints(sent_pages(spec)), 13, 1, kTimeout); },
                 {"pagedkv::send_pages<HND>: transfer 1 to rank 1: ", "peer gone"});
    before.expect_same(cache, "failure at send " + std::to_string(fail_send_at));
  }
}

TEST(TransferInProcess, AHeadRangeFarOutsideIsRejectedBeforeItsWidthIsComputed) {
  // Found by fuzz/fuzz_transfer: end - begin overflowed (UBSan) before the
  // range was checked.
  namespace w = pagedkv::transfer::wire;
  Spec spec;
  const PagedCache<NHD> sender = sender_cache<NHD>(spec);
  for (const std::pair<int64_t, int64_t>& range :
       {std::make_pair(std::numeric_limits<int64_t>::min() + 5, int64_t{4}),
        std::make_pair(int64_t{2}, std::numeric_limits<int64_t>::min()), std::make_pair(int64_t{3}, int64_t{3})}) {
    std::vector<int64_t> words = pagedkv::transfer::header_words(sender, 3, 13, 1, HeadRange{0, 4});
    words[w::head_begin] = range.first;
    words[w::head_end] = range.second;
    words[w::checksum] = w::checksum_of(words.data());
    FakeGroup receiver;
    receiver.rank = 1;
    receiver.inbox = {ints(words)};
    PagedCache<NHD> cache = receiver_cache<NHD>(spec.set("r_heads", 4));
    const CacheSnapshot before(cache);
    expect_error([&] { pagedkv::recv_pages(receiver, 0, cache, 1, kTimeout); },
                 {"rejected: bad header: head range [" + std::to_string(range.first)});
    before.expect_same(cache);
    ASSERT_EQ(receiver.sent.size(), 1u);
    EXPECT_EQ(receiver.sent[0][w::verdict].item<int64_t>(), w::bad_header);
  }
}


/// A quantized spec: fp8 keys, int8 values, bf16 logical dtype, head_dim 3
/// (odd, so that sections need padding), heads [1, 3) of 4.
Spec quantized_spec() {
  Spec spec;
  spec.set("k_format", "fp8").set("v_format", "int8").set("dtype", "bf16").set("head_dim", 3);
  spec.set("begin", 1).set("end", 3);
  return spec;
}

TEST(TransferInProcess, QuantizedMessagesAreSectionsOfCodesAndScales) {
  namespace w = pagedkv::transfer::wire;
  const Spec spec = quantized_spec();
  // A larger transfer first leaves codes in this thread's staging buffer,
  // where the padding of the next one falls.
  recorded_transfer(quantized_spec().set("head_dim", 5));
  const std::vector<at::Tensor> messages = recorded_transfer(spec);
  ASSERT_EQ(messages.size(), 1u + 3u);  // header + one message per layer
  const std::vector<int64_t> header = pagedkv::transfer::header_words(
      sender_cache<NHD>(spec), 3, 13, 1, HeadRange{1, 3});
  EXPECT_EQ(header[w::k_format], 1);
  EXPECT_EQ(header[w::v_format], 2);
  // Per page of the slice: 5 tokens x 2 heads; codes 3 bytes a vector, scales 4.
  const int64_t codes = 3 * 5 * 2 * 3;  // 90 bytes per side: padded to 96
  const int64_t scales = 3 * 5 * 2 * 4;  // 120: padded to 128
  EXPECT_EQ(header[w::scale_bytes], 2 * 128);
  EXPECT_EQ(header[w::payload_bytes], 3 * (2 * 96 + 2 * 128));
  const PagedCache<NHD> sender = sender_cache<NHD>(spec);
  const std::vector<int64_t> pages = sent_pages(spec);
  for (int64_t layer = 0; layer < 3; ++layer) {
    const at::Tensor m = messages[static_cast<size_t>(layer) + 1];
    ASSERT_EQ(m.scalar_type(), at::kByte);
    ASSERT_EQ(m.numel(), 2 * 96 + 2 * 128);
    // The k section holds the slice's codes page by page, in the sender's layout.
    const at::Tensor k_codes = sender.k_cache()[layer].index_select(0, ints(pages)).narrow(2, 1, 2);
    EXPECT_TRUE(bitwise_equal(m.narrow(0, 0, codes), k_codes.reshape({-1}))) << "layer " << layer;
    const at::Tensor v_codes = sender.v_cache()[layer].index_select(0, ints(pages)).narrow(2, 1, 2);
    EXPECT_TRUE(bitwise_equal(m.narrow(0, 96, codes), v_codes.view(at::kByte).reshape({-1}))) << "layer " << layer;
    const at::Tensor k_scales = sender.k_scales()[layer].view({16, 5, 4}).index_select(0, ints(pages)).narrow(2, 1, 2);
    EXPECT_TRUE(bitwise_equal(m.narrow(0, 192, scales).view(at::kFloat), k_scales.reshape({-1}))) << "layer " << layer;
    const at::Tensor v_scales = sender.v_scales()[layer].view({16, 5, 4}).index_select(0, ints(pages)).narrow(2, 1, 2);
    EXPECT_TRUE(bitwise_equal(m.narrow(0, 320, scales).view(at::kFloat), v_scales.reshape({-1}))) << "layer " << layer;
    // Padding is zeros, not what the staging buffer held before.
    for (const int64_t pad : {int64_t{90}, int64_t{186}, int64_t{312}, int64_t{440}}) {
      EXPECT_EQ(m.narrow(0, pad, pad == 90 || pad == 186 ? 6 : 8).sum().item<int64_t>(), 0) << "pad at " << pad;
    }
  }
}

TEST(TransferInProcess, QuantizedPagesRoundTripOnEveryPathAndLayout) {
  for (const char* backend : {"automatic", "generic"}) {
    for_each_layout([&](auto tag) {
      using L = decltype(tag);
      Spec spec = quantized_spec();
      spec.set("backend", backend);
      const pagedkv::ScopedBackend scoped(backend_of(spec));
      FakeGroup receiver;
      receiver.rank = 1;
      receiver.inbox = recorded_transfer(spec);  // sent from NHD pages
      PagedCache<L> cache = receiver_cache<L>(spec);
      const std::vector<int64_t> pages = pagedkv::recv_pages(receiver, 0, cache, 1, kTimeout);
      EXPECT_EQ(verify(spec, cache, pages), "") << backend << " " << L::name;
      ASSERT_EQ(receiver.sent.size(), 1u);
      EXPECT_EQ(receiver.sent[0][pagedkv::transfer::wire::verdict].item<int64_t>(), pagedkv::transfer::wire::accept);
    });
  }
}

TEST(TransferInProcess, AQuantizedReceiveFailingAtAnyMessageLeavesCodesAndScalesAsTheyWere) {
  const Spec spec = quantized_spec();
  const std::vector<at::Tensor> messages = recorded_transfer(spec);
  for (size_t fail_at = 1; fail_at < messages.size(); ++fail_at) {
    FakeGroup receiver;
    receiver.rank = 1;
    receiver.inbox = messages;
    receiver.fail_at = fail_at;
    PagedCache<HND> cache = receiver_cache<HND>(spec);
    // Codes and scales of every page distinct from what arrives.
    cache.k_cache().fill_(7);
    cache.k_scales().fill_(3.0f);
    cache.v_scales().fill_(5.0f);
    const CacheSnapshot before(cache);
    expect_error([&] { pagedkv::recv_pages(receiver, 0, cache, 1, kTimeout); },
                 {"payload of transfer 1 from rank 0", "peer gone"});
    before.expect_same(cache, "failure at message " + std::to_string(fail_at));
  }
}

TEST(TransferInProcess, FormatsThatDifferAreRejectedNamingBoth) {
  namespace w = pagedkv::transfer::wire;
  const Spec spec = quantized_spec();
  const std::vector<at::Tensor> messages = recorded_transfer(spec);
  const std::vector<std::pair<std::string, std::string>> receivers{
      {"native", "k quantization (KVFormat) mismatch: expected native (this cache's), got fp8_e4m3 (the sender's)"},
      {"int8", "k quantization (KVFormat) mismatch: expected int8 (this cache's), got fp8_e4m3 (the sender's)"}};
  for (const auto& r : receivers) {
    Spec mine = spec;
    mine.set("r_k_format", r.first);
    FakeGroup receiver;
    receiver.rank = 1;
    receiver.inbox = messages;
    PagedCache<NHD> cache = receiver_cache<NHD>(mine);
    const CacheSnapshot before(cache);
    expect_error([&] { pagedkv::recv_pages(receiver, 0, cache, 1, kTimeout); }, {r.second});
    before.expect_same(cache);
    EXPECT_EQ(receiver.received, 1u);  // the header only
    ASSERT_EQ(receiver.sent.size(), 1u);
    EXPECT_EQ(receiver.sent[0][w::verdict].item<int64_t>(), w::mismatch);
  }
  // A native sender and a quantized receiver: the sender learns of the mismatch too.
  FakeGroup sender;
  sender.inbox.push_back(ints({w::kReplyMagic, w::mismatch, 1, 0}));
  const PagedCache<NHD> native = sender_cache<NHD>(Spec());
  expect_error([&] { pagedkv::send_pages(sender, 1, native, ints(sent_pages(Spec())), 13, 1, kTimeout); },
               {"rejected: mismatch", "quantization"});
  EXPECT_EQ(sender.sent.size(), 1u);  // the header, no payload
}

/// The tokens a windowed table's sequence still holds: its held columns, gathered.
std::pair<at::Tensor, at::Tensor> held_tokens(const SequenceTable<NHD>& seqs, int64_t seq, int64_t layer,
                                              int64_t from_column) {
  const std::vector<int64_t>& pages = seqs.pages(seq);
  const int64_t page_size = seqs.cache().page_size();
  return seqs.cache().gather(layer, table({std::vector<int64_t>(pages.begin() + from_column, pages.end())}),
                             ints({seqs.length(seq) - from_column * page_size}));
}

// A windowed table's sequence travels with the pages it still holds: the
// header names the released columns; a table whose window keeps nothing
// before them takes it (and releases what its own window drops), while a
// table that would need them, and recv_pages, refuse it on both sides.
TEST(TransferInProcess, WindowedSequencesMoveOnlyTheirHeldPages) {
  namespace w = pagedkv::transfer::wire;
  const auto make = [] { return PagedCache<NHD>(2, 12, 3, 2, 4, at::TensorOptions().dtype(at::kFloat)); };
  PagedCache<NHD> src = make();
  SequenceTable<NHD> src_seqs(src, /*window=*/4);
  const int64_t seq = src_seqs.create();
  ASSERT_TRUE(src_seqs.prepare_append(seq, 14));
  const auto pt = src_seqs.batch({seq});
  for (int64_t layer = 0; layer < 2; ++layer) {
    src.write(layer, pt.first, 0, pattern({1, 14, 2, 4}, 2 * layer, src.k_cache().options()),
              pattern({1, 14, 2, 4}, 2 * layer + 1, src.k_cache().options()));
  }
  src_seqs.commit_append(seq, 14);  // the next query sees [11, 14]: columns 0-2 released
  ASSERT_EQ(src_seqs.pages(seq)[2], -1);
  FakeGroup sender;
  sender.inbox.push_back(ints({w::kReplyMagic, w::accept, 7, 0}));
  pagedkv::send_sequence(sender, 1, src_seqs, seq, 7, kTimeout);
  ASSERT_EQ(sender.sent.size(), 1u + 2u);  // header + one message per layer
  EXPECT_EQ(sender.sent[0][w::first_page].item<int64_t>(), 3);
  EXPECT_EQ(sender.sent[0][w::n_pages].item<int64_t>(), 2);
  EXPECT_EQ(sender.sent[0][w::n_tokens].item<int64_t>(), 14);
  // The same window, and a smaller one (which releases one page more: (14 - 2 + 1) / 3 = 4).
  for (const int64_t window : {4, 2}) {
    PagedCache<NHD> dst = make();
    SequenceTable<NHD> dst_seqs(dst, window);
    FakeGroup receiver;
    receiver.rank = 1;
    receiver.inbox = sender.sent;
    const int64_t got = pagedkv::recv_sequence(receiver, 0, dst_seqs, 7, kTimeout);
    const int64_t released = window == 4 ? 3 : 4;
    EXPECT_EQ(dst_seqs.length(got), 14);
    ASSERT_EQ(dst_seqs.pages(got).size(), 5u);
    for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(dst_seqs.pages(got)[static_cast<size_t>(j)] < 0, j < released) << j;
    EXPECT_EQ(dst.n_free(), 12 - (5 - released)) << "window " << window;
    EXPECT_NO_THROW(dst_seqs.check());
    for (int64_t layer = 0; layer < 2; ++layer) {
      const auto want = held_tokens(src_seqs, seq, layer, released);
      const auto have = held_tokens(dst_seqs, got, layer, released);
      EXPECT_TRUE(bitwise_equal(have.first, want.first)) << "k, window " << window << ", layer " << layer;
      EXPECT_TRUE(bitwise_equal(have.second, want.second)) << "v, window " << window << ", layer " << layer;
    }
  }
  // A table that keeps every token and one with a larger window would need the released pages.
  for (const int64_t window : {0, 8}) {
    PagedCache<NHD> dst = make();
    SequenceTable<NHD> dst_seqs(dst, window);
    FakeGroup receiver;
    receiver.rank = 1;
    receiver.inbox = sender.sent;
    const CacheSnapshot before(dst);
    expect_error([&] { pagedkv::recv_sequence(receiver, 0, dst_seqs, 7, kTimeout); },
                 {"pagedkv::recv_sequence<NHD>", "rejected: window", "released the first 3 pages",
                  "window " + std::to_string(window)});
    before.expect_same(dst, "a refused windowed sequence");
    EXPECT_EQ(dst_seqs.size(), 0);
    ASSERT_EQ(receiver.sent.size(), 1u);
    EXPECT_EQ(receiver.sent[0][w::verdict].item<int64_t>(), w::window);
  }
  {
    PagedCache<NHD> dst = make();
    FakeGroup receiver;
    receiver.rank = 1;
    receiver.inbox = sender.sent;
    expect_error([&] { pagedkv::recv_pages(receiver, 0, dst, 7, kTimeout); },
                 {"pagedkv::recv_pages<NHD>", "rejected: window", "recv_sequence"});
    EXPECT_EQ(dst.n_free(), 12);
  }
  FakeGroup refused;  // the sender learns why
  refused.inbox.push_back(ints({w::kReplyMagic, w::window, 7, 0}));
  expect_error([&] { pagedkv::send_sequence(refused, 1, src_seqs, seq, 7, kTimeout); },
               {"pagedkv::send_pages<NHD>", "rejected: window", "before column 3"});
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* role = std::getenv("PAGEDKV_TRANSFER_ROLE")) return child_main(role);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
