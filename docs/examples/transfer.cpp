// docs/transfer.md: a prefill worker sends a sequence to a decode worker
// over Gloo; then a head slice for a decode side at a higher tensor-parallel
// degree. The two ranks are threads of this process here (so the sample
// runs in ctest); in an engine they are processes, usually on two machines.
#include <pagedkv/pagedkv.hpp>
#include <pagedkv/transfer.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "samples.hpp"

namespace docs {
namespace {

//! [group]
/// The engine's process group between a prefill rank (0) and a decode rank (1): Gloo over TCP
/// here (NCCL for CUDA caches). pagedkv only calls its send / recv.
c10::intrusive_ptr<c10d::ProcessGroupGloo> make_group(const std::string& store_host, uint16_t store_port,
                                                      int rank, const std::string& my_address) {
  c10d::TCPStoreOptions store_options;
  store_options.port = store_port;  // a TCPStore server that both ranks reach
  auto store = c10::make_intrusive<c10d::TCPStore>(store_host, store_options);
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(30));
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(my_address));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, /*size=*/2, options);
}
//! [group]

constexpr int64_t kLayers = 2, kPageSize = 16, kHeads = 8, kHeadDim = 64;

/// Rank 0: prefills a 40-token sequence, sends it, then sends heads [4, 8) of it.
void prefill_worker(uint16_t port, const at::Tensor& k, const at::Tensor& v) {
  const auto group = make_group("127.0.0.1", port, /*rank=*/0, "127.0.0.1");
  pagedkv::PagedCache<pagedkv::NHD> cache(kLayers, 32, kPageSize, kHeads, kHeadDim);
  pagedkv::SequenceTable<pagedkv::NHD> seqs(cache);
  const int64_t seq = seqs.create();
  expect(seqs.prepare_append(seq, 40), "room for the prompt");
  const auto view = cache.bind(seqs.batch({seq}).first, at::tensor({40}, at::kLong));
  for (int64_t layer = 0; layer < kLayers; ++layer) view.write(layer, 0, k, v);
  seqs.commit_append(seq, 40);
  const int64_t request_id = 7;
  //! [send]
  // Prefill worker: the sequence's pages (every layer, k and v) to rank 1 (then it may release it).
  pagedkv::send_sequence(*group, /*dst_rank=*/1, seqs, seq, /*transfer_id=*/request_id, std::chrono::seconds(5));
  //! [send]
  //! [tp]
  // Decode runs at tensor-parallel degree 2, prefill at 1: each decode rank gets its 4 of the 8 kv heads.
  std::vector<pagedkv::HeadRoute> routes = pagedkv::tp_routes(/*n_kv_heads=*/8, /*src_tp=*/1, /*dst_tp=*/2);
  // routes[r]: {src_rank 0, dst_rank r, heads [4r, 4r + 4)}. Here: the slice of decode rank 1, raw pages.
  at::Tensor pages = at::tensor(seqs.pages(seq));  // [n] the pages holding tokens [0, 40)
  pagedkv::send_pages(*group, /*dst_rank=*/1, cache, pages, /*n_tokens=*/40, /*transfer_id=*/8,
                      std::chrono::seconds(5), routes[1].heads);
  //! [tp]
  seqs.release(seq);
}

/// Rank 1: receives the sequence into an HND cache, then the head slice into a 4-head cache.
void decode_worker(uint16_t port, const at::Tensor& k, const at::Tensor& v) {
  const auto group = make_group("127.0.0.1", port, /*rank=*/1, "127.0.0.1");
  pagedkv::PagedCache<pagedkv::HND> cache(kLayers, 32, kPageSize, kHeads, kHeadDim);
  pagedkv::SequenceTable<pagedkv::HND> seqs(cache);
  const int64_t request_id = 7;
  //! [recv]
  // Decode worker: a new sequence of the sent length in its own pages (any layout).
  int64_t mine = pagedkv::recv_sequence(*group, /*src_rank=*/0, seqs, /*transfer_id=*/request_id,
                                        std::chrono::seconds(5));
  //! [recv]
  const auto [k_got, v_got] = cache.gather(1, seqs.batch({mine}).first, seqs.batch({mine}).second);
  expect(seqs.length(mine) == 40 && at::equal(k_got, k) && at::equal(v_got, v), "the sequence bit for bit");

  pagedkv::PagedCache<pagedkv::HND> slice_cache(kLayers, 32, kPageSize, /*n_kv_heads=*/4, kHeadDim);
  //! [recv_pages]
  // Raw pages: the receiver's own page ids (ref_count 1), tokens [0, 40) in order.
  std::vector<int64_t> got = pagedkv::recv_pages(*group, /*src_rank=*/0, slice_cache, /*transfer_id=*/8,
                                                 std::chrono::seconds(5));
  //! [recv_pages]
  const at::Tensor table = at::tensor(got, at::kInt).view({1, -1});
  const auto [k_slice, v_slice] = slice_cache.gather(1, table, at::tensor({40}, at::kLong));
  expect(at::equal(k_slice, k.narrow(2, 4, 4)) && at::equal(v_slice, v.narrow(2, 4, 4)), "heads [4, 8)");
  seqs.release(mine);
}

}  // namespace

void transfer_sample() {
  // The store both ranks rendezvous through, on a free port of this machine.
  c10d::TCPStoreOptions server;
  server.port = 0;
  server.isServer = true;
  server.waitWorkers = false;
  const auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", server);
  const uint16_t port = static_cast<uint16_t>(store->getPort());
  const at::Tensor k = at::randn({1, 40, kHeads, kHeadDim}).to(at::kHalf);
  const at::Tensor v = at::randn({1, 40, kHeads, kHeadDim}).to(at::kHalf);
  std::exception_ptr errors[2];
  std::thread prefill([&] {
    try {
      prefill_worker(port, k, v);
    } catch (...) {
      errors[0] = std::current_exception();
    }
  });
  std::thread decode([&] {
    try {
      decode_worker(port, k, v);
    } catch (...) {
      errors[1] = std::current_exception();
    }
  });
  prefill.join();
  decode.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace docs
