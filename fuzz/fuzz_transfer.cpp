// libFuzzer target: the receiver of a page transfer (recv_pages) fed a
// header that the input mutates. A valid header for a small cache is built;
// each 9-byte record of the input picks a header word (1 byte) and XORs or
// sets it (8 bytes); the checksum is recomputed unless the first input byte
// is odd. The group is scripted (pagedkv's group type is a template
// parameter): after the header, each payload receive gets a message of
// exactly the size the header announced, or, from input bit 1 of the first
// byte, the peer is gone. Bit 2 of the first byte makes both caches
// quantized (fp8 keys, int8 values: codes and scales travel).
//
// The harness aborts when recv_pages throws anything but c10::Error, posts a
// payload buffer of another size than the header announced, throws having
// changed the cache (storage, scales, ref counts, n_free), or succeeds with pages
// that are not fresh (ref count 1) or not as many as the header's tokens need.
// Build and run: `make fuzz FUZZ_SECONDS=60` (fuzz/README.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Logging.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "pagedkv/transfer.hpp"

namespace {

namespace w = pagedkv::transfer::wire;

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "pagedkv fuzz_transfer failure: %s\n", why.c_str());
  std::abort();
}

struct Work {
  std::function<bool()> complete;
  bool wait(std::chrono::milliseconds /*timeout*/) { return complete(); }
  void abort() {}
};

/// Receive 0 is the header; every later one a payload message of
/// payload_bytes / n_layers bytes, or a lost peer.
struct ScriptedGroup {
  std::vector<int64_t> header;
  bool peer_gone = false;
  int receives = 0;

  int getRank() const { return 1; }
  int getSize() const { return 2; }
  std::shared_ptr<Work> send(std::vector<at::Tensor>& /*tensors*/, int /*dst*/, int /*tag*/) {
    return std::make_shared<Work>(Work{[] { return true; }});
  }
  std::shared_ptr<Work> recv(std::vector<at::Tensor>& tensors, int /*src*/, int /*tag*/) {
    const int index = receives++;
    at::Tensor dst = tensors[0];
    const std::vector<int64_t> h = header;
    const bool gone = peer_gone;
    return std::make_shared<Work>(Work{[index, dst, h, gone] {
      if (index == 0) {
        if (dst.nbytes() != h.size() * sizeof(int64_t)) fail("the header buffer has another size");
        std::memcpy(dst.data_ptr(), h.data(), dst.nbytes());
        return true;
      }
      if (gone) throw std::runtime_error("Connection reset by peer");
      const auto announced = static_cast<size_t>(h[w::payload_bytes] / h[w::n_layers]);
      if (dst.nbytes() != announced) fail("a payload buffer of another size than announced");
      std::memset(dst.data_ptr(), index, dst.nbytes());
      return true;
    }});
  }
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  at::set_num_threads(1);
  c10::SetStackTraceFetcher([] { return std::string(); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using Cache = pagedkv::PagedCache<pagedkv::HND>;
  using pagedkv::KVFormat;
  const uint8_t flags = size > 0 ? data[0] : 0;
  const pagedkv::KVQuant quant =
      (flags & 4) != 0 ? pagedkv::KVQuant{KVFormat::fp8_e4m3, KVFormat::int8} : pagedkv::KVQuant{};
  const pagedkv::PagedCache<pagedkv::NHD> sender(2, 8, 3, 4, 2, at::TensorOptions().dtype(at::kHalf), quant);
  Cache cache(2, 6, 3, 2, 2, at::TensorOptions().dtype(at::kHalf), quant);
  cache.alloc();  // page 0 held: the fresh pages start at 1
  ScriptedGroup group;
  // 7 tokens of heads [1, 3): a header the receiver accepts.
  group.header = pagedkv::transfer::header_words(sender, 3, 7, /*transfer_id=*/5, pagedkv::HeadRange{1, 3});
  for (size_t at = 1; at + 9 <= size; at += 9) {
    const size_t word = data[at] % static_cast<size_t>(w::kHeaderWords);
    int64_t value = 0;
    std::memcpy(&value, data + at + 1, sizeof(value));
    if (data[at] & 0x80) {
      group.header[word] = value;
    } else {
      group.header[word] ^= value;
    }
  }
  if ((flags & 1) == 0) group.header[w::checksum] = w::checksum_of(group.header.data());
  group.peer_gone = (flags & 2) != 0;

  const at::Tensor k_before = cache.k_cache().clone();
  const at::Tensor v_before = cache.v_cache().clone();
  const at::Tensor k_scales_before = quant.k == KVFormat::native ? at::Tensor() : cache.k_scales().clone();
  const at::Tensor v_scales_before = quant.v == KVFormat::native ? at::Tensor() : cache.v_scales().clone();
  const int64_t free_before = cache.n_free();
  try {
    const std::vector<int64_t> pages = pagedkv::recv_pages(group, 0, cache, 5, std::chrono::milliseconds(1000));
    const int64_t tokens = group.header[w::n_tokens];
    if (static_cast<int64_t>(pages.size()) != tokens / 3 + (tokens % 3 != 0 ? 1 : 0)) fail("page count");
    for (const int64_t p : pages) {
      if (cache.ref_count(p) != 1) fail("a returned page is not fresh");
    }
    if (cache.n_free() != free_before - static_cast<int64_t>(pages.size())) fail("n_free after success");
  } catch (const c10::Error& e) {
    if (std::string(e.what_without_backtrace()).find("pagedkv::recv_pages<HND>") == std::string::npos) {
      fail(std::string("an error without the function: ") + e.what_without_backtrace());
    }
    const bool scales_same = (!k_scales_before.defined() || at::equal(cache.k_scales(), k_scales_before)) &&
                             (!v_scales_before.defined() || at::equal(cache.v_scales(), v_scales_before));
    if (!at::equal(cache.k_cache(), k_before) || !at::equal(cache.v_cache(), v_before) || !scales_same ||
        cache.n_free() != free_before || cache.ref_count(0) != 1) {
      fail("a failed receive changed the cache");
    }
  } catch (const std::exception& e) {
    fail(std::string("not a c10::Error: ") + e.what());
  }
  cache.check();
  return 0;
}
