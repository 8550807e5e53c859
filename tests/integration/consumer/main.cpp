// Writes a prompt through a CacheView and reads it back.
#include <pagedkv/pagedkv.hpp>

#include <cstdio>

int main() {
  pagedkv::PagedCache<pagedkv::HND> cache(2, 16, 4, 2, 8, at::TensorOptions().dtype(at::kFloat));
  const auto pages = cache.alloc_n(3);
  const at::Tensor page_table = at::tensor({pages[2], pages[0], pages[1]}, at::kLong).view({1, 3});
  const at::Tensor k = at::randn({1, 10, 2, 8});
  const at::Tensor v = at::randn({1, 10, 2, 8});
  const auto view = cache.bind(page_table, 10);
  view.write(1, 0, k, v);
  const auto kv = view.gather(1);
  const bool ok = at::equal(kv.first, k) && at::equal(kv.second, v);
  std::printf("consumer: round trip %s\n", ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
