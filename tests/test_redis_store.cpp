// redis_store (stores/redis.hpp) against a real redis-server that each test
// starts on 127.0.0.1 (a free port, a temporary directory, no persistence)
// and stops: round trips, the budget, two caches (two engine replicas)
// sharing pages through the server, and a server that is stopped (slow) or
// killed: a miss or a refused put with a warning, within the timeout, and
// the device tier untouched; and the tier scripts of fuzz/tier_script.hpp
// with the server as the last tier.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../fuzz/tier_script.hpp"
#include "pagedkv/page_store.hpp"
#include "pagedkv/prefix_cache.hpp"
#include "pagedkv/stores/redis.hpp"
#include "pagedkv/torch_compat.hpp"
#include "warnings_capture.hpp"

#ifndef PAGEDKV_REDIS_SERVER
#define PAGEDKV_REDIS_SERVER "redis-server"
#endif

namespace {

using pagedkv::NHD;
using pagedkv::PagedCache;
using pagedkv::PageKey;
using pagedkv::PrefixCache;
using pagedkv::SequenceTable;
using pagedkv::StoredPage;
using pagedkv::stores::RedisStore;
using std::chrono::milliseconds;

constexpr int64_t kPage = 4;

using pagedkv_test::Warnings;

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

/// A redis-server of this test's own; SIGKILLed at the end if still running.
class RedisServer {
 public:
  RedisServer() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pagedkv-redis-XXXXXX").string();
    dir_ = ::mkdtemp(pattern.data());
    port_ = free_port();
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string port = std::to_string(port_);
      ::execlp(PAGEDKV_REDIS_SERVER, PAGEDKV_REDIS_SERVER, "--port", port.c_str(), "--bind", "127.0.0.1", "--dir",
               dir_.c_str(), "--save", "", "--appendonly", "no", "--loglevel", "warning", "--logfile",
               (dir_ + "/log").c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    // Up when it answers a PING (a second at most on an idle machine).
    for (int i = 0; i < 200 && !ready(); ++i) std::this_thread::sleep_for(milliseconds(25));
  }
  ~RedisServer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGCONT);
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    std::filesystem::remove_all(dir_);
  }
  bool ready() const {
    timeval tv{0, 200000};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, tv);
    bool ok = false;
    if (c != nullptr && c->err == 0) {
      auto* r = static_cast<redisReply*>(redisCommand(c, "PING"));
      ok = r != nullptr && r->type == REDIS_REPLY_STATUS;
      if (r != nullptr) freeReplyObject(r);
    }
    if (c != nullptr) redisFree(c);
    return ok;
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  void stop() { ::kill(pid_, SIGSTOP); }  // a server that does not answer (slow)
  void resume() { ::kill(pid_, SIGCONT); }
  void kill() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  std::string dir_;
  int port_ = -1;
  pid_t pid_ = -1;
};

at::Tensor bytes_of(int64_t n, uint8_t fill) {
  at::Tensor t = at::empty({n}, at::TensorOptions().dtype(at::kByte));
  std::memset(t.data_ptr<uint8_t>(), fill, static_cast<size_t>(n));
  return t;
}

#define REQUIRE_SERVER(server)                                              \
  do {                                                                      \
    if (!(server).ready()) GTEST_SKIP() << "redis-server did not start"; \
  } while (0)

TEST(RedisStore, RoundTripsReplacesAndErases) {
  RedisServer server;
  REQUIRE_SERVER(server);
  auto store = std::make_shared<RedisStore>(server.address());
  EXPECT_EQ(store->tier(), "remote");
  EXPECT_FALSE(store->get(PageKey{7}).defined());
  at::Tensor entry = at::randint(0, 256, {100000}, at::TensorOptions().dtype(at::kByte));
  entry[5] = 0;  // binary-safe: a zero byte inside
  EXPECT_TRUE(store->put(PageKey{7}, entry, nullptr));
  EXPECT_TRUE(at::equal(store->get(PageKey{7}), entry));
  EXPECT_TRUE(store->put(PageKey{7}, bytes_of(10, 3), nullptr));
  EXPECT_TRUE(at::equal(store->get(PageKey{7}), bytes_of(10, 3)));
  // Another client (another replica) sees it once the store's thread sent it.
  store->flush();
  RedisStore other(server.address());
  EXPECT_TRUE(at::equal(other.get(PageKey{7}), bytes_of(10, 3)));
  store->erase(PageKey{7});
  EXPECT_FALSE(store->get(PageKey{7}).defined());  // at once, before the DEL is sent
  store->flush();
  EXPECT_FALSE(other.get(PageKey{7}).defined());
}

TEST(RedisStore, KeepsItsBudgetLeastRecentlyUsedFirst) {
  RedisServer server;
  REQUIRE_SERVER(server);
  RedisStore store(server.address(), 300);
  std::vector<StoredPage> out;
  for (uint64_t k = 1; k <= 3; ++k) EXPECT_TRUE(store.put(PageKey{k}, bytes_of(100, static_cast<uint8_t>(k)), &out));
  EXPECT_TRUE(store.get(PageKey{1}).defined());
  EXPECT_TRUE(store.put(PageKey{4}, bytes_of(100, 4), &out));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].key.hash, 2u);
  EXPECT_TRUE(at::equal(out[0].entry, bytes_of(100, 2)));
  EXPECT_FALSE(store.get(PageKey{2}).defined());
  Warnings warnings;
  EXPECT_FALSE(store.put(PageKey{5}, bytes_of(301, 5), &out));
  EXPECT_TRUE(warnings.any("exceeds the budget"));
}

TEST(RedisStore, TwoEnginesShareCachedPagesBitForBit) {
  RedisServer server;
  REQUIRE_SERVER(server);
  at::manual_seed(1);
  std::vector<int64_t> prompt;
  for (int64_t i = 0; i < 3 * kPage + 1; ++i) prompt.push_back(100 + 3 * i);
  const at::Tensor tokens = at::tensor(prompt, at::kLong);
  at::Tensor written_k;
  {
    PagedCache<NHD> cache(2, 8, kPage, 2, 8, at::TensorOptions().dtype(at::kHalf));
    SequenceTable<NHD> seqs(cache);
    PrefixCache<NHD> prefix(seqs, {pagedkv::redis_store(server.address())});
    const int64_t seq = seqs.create();
    ASSERT_TRUE(seqs.prepare_append(seq, tokens.size(0)));
    auto [table, lengths] = seqs.batch({seq});
    const auto view = cache.bind(table, lengths + tokens.size(0));
    for (int64_t layer = 0; layer < 2; ++layer) {
      view.write(layer, 0, at::randn({1, tokens.size(0), 2, 8}).to(at::kHalf),
                 at::randn({1, tokens.size(0), 2, 8}).to(at::kHalf));
    }
    seqs.commit_append(seq, tokens.size(0));
    prefix.insert(seq, tokens);
    written_k = cache.gather(1, table, at::tensor({3 * kPage}, at::kLong)).first;
    seqs.release(seq);
    prefix.clear();
    EXPECT_EQ(prefix.stats().tiers[0].stored_pages, 3);
  }
  PagedCache<pagedkv::HND> cache(2, 8, kPage, 2, 8, at::TensorOptions().dtype(at::kHalf));
  SequenceTable<pagedkv::HND> seqs(cache);
  PrefixCache<pagedkv::HND> prefix(seqs, {pagedkv::redis_store(server.address())});
  const auto [seq, n] = prefix.acquire(tokens);
  EXPECT_EQ(n, 3 * kPage);
  EXPECT_EQ(prefix.stats().tiers[0].loaded_pages, 3);
  auto [table, lengths] = seqs.batch({seq});
  const at::Tensor k = cache.gather(1, table, lengths).first;
  EXPECT_TRUE(at::equal(k.view(at::kShort), written_k.view(at::kShort)));
  prefix.check();
}

TEST(RedisStore, AStoppedOrKilledServerIsAMissWithAWarningWithinTheTimeout) {
  RedisServer server;
  REQUIRE_SERVER(server);
  RedisStore store(server.address(), 0, milliseconds(1000), milliseconds(300));
  ASSERT_TRUE(store.put(PageKey{1}, bytes_of(1000, 1), nullptr));
  store.flush();
  Warnings warnings;
  server.stop();  // accepts nothing, answers nothing: a slow server
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(store.get(PageKey{1}).defined());
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(3000));
  EXPECT_TRUE(warnings.any("redis_store(" + server.address() + ")"));
  // A put never waits for the server: its thread sends the SET, and times out there.
  start = std::chrono::steady_clock::now();
  store.put(PageKey{2}, bytes_of(10, 2), nullptr);
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(100));
  store.flush();  // the SET timed out (a warning): within the timeout
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(3000));
  // Within its retry period the store refuses puts at once.
  EXPECT_FALSE(store.put(PageKey{3}, bytes_of(10, 3), nullptr));
  server.resume();
  std::this_thread::sleep_for(milliseconds(350));
  EXPECT_TRUE(store.get(PageKey{1}).defined()) << "the store reconnects after the retry period";
  server.kill();
  const size_t before = warnings.messages.size();
  start = std::chrono::steady_clock::now();
  EXPECT_FALSE(store.get(PageKey{1}).defined());
  store.put(PageKey{4}, bytes_of(10, 4), nullptr);
  store.flush();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(3000));
  EXPECT_FALSE(store.get(PageKey{4}).defined());
  EXPECT_GT(warnings.messages.size(), before);

  // A prefix cache over the dead server: misses, and the device tier keeps its pages.
  PagedCache<NHD> cache(1, 8, kPage, 1, 4, at::TensorOptions().dtype(at::kFloat));
  SequenceTable<NHD> seqs(cache);
  auto dead = std::make_shared<RedisStore>(server.address(), 0, milliseconds(200));
  PrefixCache<NHD> prefix(seqs, {dead});
  const at::Tensor tokens = at::arange(2 * kPage + 1, at::kLong);
  const int64_t seq = seqs.create();
  ASSERT_TRUE(seqs.prepare_append(seq, tokens.size(0)));
  seqs.commit_append(seq, tokens.size(0));
  prefix.insert(seq, tokens);
  seqs.release(seq);
  EXPECT_EQ(prefix.peek(tokens), 2 * kPage);
  const auto [again, n] = prefix.acquire(tokens);
  EXPECT_EQ(n, 2 * kPage);  // from the device
  seqs.release(again);
  EXPECT_EQ(prefix.evict(1), 1);  // written down to nowhere: a warning, no exception
  dead->flush();  // its SET failed on the store's thread (whose warnings a handler here may not see)
  const auto [third, m] = prefix.acquire(tokens);
  EXPECT_EQ(m, kPage);
  seqs.release(third);
  prefix.check();
}

/// Random tier scripts (fuzz/tier_script.hpp, as in PrefixTiersProperty)
/// with the server after host memory and the directory: a store per engine
/// (a restart connects again, the server keeps what it holds), and the
/// server's key count checked against the KV events after every call.
TEST(RedisStore, TierScriptsWithTheServerAsTheLastTier) {
  RedisServer server;
  REQUIRE_SERVER(server);
  redisContext* conn = redisConnectWithTimeout("127.0.0.1", server.port(), timeval{2, 0});
  ASSERT_TRUE(conn != nullptr && conn->err == 0);
  const auto command = [&](const char* what) {
    auto* r = static_cast<redisReply*>(redisCommand(conn, what));
    const long long n = r != nullptr && r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
    if (r != nullptr) freeReplyObject(r);
    return n;
  };
  pagedkv_fuzz::TierOptions options;
  options.remote = [&] { return pagedkv::redis_store(server.address()); };
  options.remote_entries = [&](pagedkv::PageStore& store) {
    dynamic_cast<RedisStore&>(store).flush();
    return static_cast<int64_t>(command("DBSIZE"));
  };
  std::mt19937_64 rng(20261206);
  pagedkv_fuzz::TierSummary total;
  for (int i = 0; i < 12; ++i) {
    command("FLUSHALL");  // each script's model starts empty
    options.tiers = i % 3;  // host + disk, host, disk; then the server
    std::vector<uint8_t> bytes(1000);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    try {
      const auto s = pagedkv_fuzz::run_tier_script(bytes.data(), bytes.size(), options);
      total.loaded_pages += s.loaded_pages;
      total.restarts += s.restarts;
      total.corruptions += s.corruptions;
      total.last_tier_loaded_pages += s.last_tier_loaded_pages;
    } catch (const pagedkv_fuzz::Failure& failure) {
      ADD_FAILURE() << "script " << i << ": " << failure.what();
    }
  }
  redisFree(conn);
  EXPECT_GT(total.loaded_pages, 0);
  EXPECT_GT(total.restarts, 0);
  EXPECT_GT(total.corruptions, 0);
  EXPECT_GT(total.last_tier_loaded_pages, 0) << "no page came back from the server";
  RecordProperty("loaded_pages", static_cast<int>(total.loaded_pages));
  RecordProperty("server_loaded_pages", static_cast<int>(total.last_tier_loaded_pages));
  RecordProperty("restarts", static_cast<int>(total.restarts));
}

TEST(RedisStore, BadAddressesThrow) {
  for (const char* bad : {"", "localhost", "localhost:", ":6379", "host:0", "host:65536", "host:12x"}) {
    EXPECT_THROW(pagedkv::redis_store(bad), c10::Error) << bad;
  }
  EXPECT_THROW(pagedkv::redis_store("127.0.0.1:1", -1), c10::Error);
  // A well-formed address with no server: constructed, every call a miss.
  Warnings warnings;
  RedisStore nowhere("127.0.0.1:1", 0, milliseconds(100));
  EXPECT_FALSE(nowhere.get(PageKey{1}).defined());
  EXPECT_TRUE(warnings.any("cannot connect"));
}

}  // namespace
