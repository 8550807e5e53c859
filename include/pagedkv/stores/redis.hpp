// redis_store: a prefix tier on a Redis (or Valkey) server that engine
// replicas share (docs/tiers.md). Needs hiredis (Debian's libhiredis-dev);
// link the CMake target pagedkv::redis, which exists when CMake finds it.
//
// - One key per entry, "<prefix><PageKey::name()>", the entry's bytes as its
//   value: SET replaces a value whole, so no reader sees half an entry.
// - max_bytes = 0 (the default): the server's own limit decides what stays
//   (maxmemory with an LRU policy); the store never deletes on its own.
//   max_bytes > 0: this process deletes the least recently used entries it
//   knows (the ones it wrote or read) beyond that many bytes.
// - put queues the entry and returns; a thread of the store sends the SETs
//   (and DELs) on a connection of its own, so a slow server never holds up
//   the engine's step; until it is sent, get serves the entry from memory.
// - Every command waits at most `timeout`. A server that is down, killed
//   mid-transfer or slow makes the call a miss (or a refused put) with a
//   warning; the store then waits `retry` before it connects again, so a
//   dead server costs the engine one timeout per retry period, not per page.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pagedkv/checks.hpp"
#include "pagedkv/page_store.hpp"

namespace pagedkv {
namespace stores {

class RedisStore final : public PageStore {
 public:
  /// host_port: "HOST:PORT" (HOST a name or an IPv4 address).
  explicit RedisStore(const std::string& host_port, int64_t max_bytes = 0,
             std::chrono::milliseconds timeout = std::chrono::milliseconds(1000),
             std::chrono::milliseconds retry = std::chrono::milliseconds(2000), std::string prefix = "pagedkv:")
      : max_bytes_(max_bytes), timeout_(timeout), retry_(retry), prefix_(std::move(prefix)) {
    const checks::Caller caller{"redis_store", nullptr, nullptr};
    const size_t colon = host_port.rfind(':');
    int64_t port = -1;
    if (colon != std::string::npos && colon > 0 && colon + 1 < host_port.size()) {
      const std::string digits = host_port.substr(colon + 1);
      char* end = nullptr;
      port = digits.find_first_not_of("0123456789") == std::string::npos ? std::strtoll(digits.c_str(), &end, 10) : -1;
    }
    TORCH_CHECK(port >= 1 && port <= 65535, caller, ": argument 'host_port' expected HOST:PORT with a port in [1, 65535], got '",
                host_port, "'");
    checks::non_negative(caller, "max_bytes", max_bytes);
    TORCH_CHECK(timeout.count() >= 1, caller, ": argument 'timeout' expected >= 1 ms, got ", timeout.count(), " ms");
    host_ = host_port.substr(0, colon);
    port_ = static_cast<int>(port);
    writer_ = std::make_unique<detail::WriteBehind>(
        [this](uint64_t key, const at::Tensor& entry) { return write_entry(key, entry); },
        [this](uint64_t key) {
          const std::string k = prefix_ + PageKey{key}.name();
          command(writing_, "DEL %b", k.data(), k.size());
        },
        kMaxPendingBytes);
  }

  ~RedisStore() override {
    writer_.reset();  // sends what is queued (each command within the timeout)
    for (Connection* c : {&reading_, &writing_}) {
      if (c->ctx != nullptr) redisFree(c->ctx);
    }
  }

  RedisStore(const RedisStore&) = delete;
  RedisStore& operator=(const RedisStore&) = delete;

  static constexpr int64_t kMaxPendingBytes = int64_t{256} << 20;  // queued for sending at most

  std::string tier() const override { return "remote"; }

  /// Queues the entry for the store's own thread, which sends the SET on
  /// a connection of its own (so a slow server never holds up the caller);
  /// false at once while that connection is down (within its retry period).
  bool put(const PageKey& key, const at::Tensor& entry, std::vector<StoredPage>* pushed_out) override {
    if (!detail::valid_entry_tensor(entry)) return false;
    if (max_bytes_ > 0 && entry.numel() > max_bytes_) {
      warn_("pagedkv::redis_store(", host_, ":", port_, "): an entry of ", entry.numel(),
            " bytes exceeds the budget of ", max_bytes_, " bytes; not stored");
      return false;
    }
    if (now_ns() - writer_failed_ns_.load() < retry_ns()) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    forget_failed();
    writer_->put(key.hash, entry);
    if (max_bytes_ == 0) return true;
    index_.put(key.hash, entry.numel(), 0);
    while (index_.bytes() > max_bytes_) {
      const uint64_t old = index_.oldest()->key;
      if (old == key.hash) break;
      if (pushed_out != nullptr) {
        at::Tensor bytes = writer_->pending(old);
        if (!bytes.defined()) bytes = fetch(prefix_ + PageKey{old}.name());
        if (bytes.defined()) pushed_out->push_back(StoredPage{PageKey{old}, std::move(bytes)});
      }
      writer_->remove(old);
      index_.erase(old);
    }
    return true;
  }

  at::Tensor get(const PageKey& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    forget_failed();
    at::Tensor entry = writer_->pending(key.hash);  // not sent yet: served from memory
    if (!entry.defined()) {
      if (writer_->removing(key.hash)) return entry;  // its DEL is queued
      entry = fetch(prefix_ + key.name());
    }
    if (max_bytes_ > 0) {
      if (!entry.defined()) {
        index_.erase(key.hash);
      } else {
        if (index_.find(key.hash) == nullptr) index_.put(key.hash, entry.numel(), 0);
        index_.touch(key.hash);
      }
    }
    return entry;
  }

  void erase(const PageKey& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    writer_->remove(key.hash);
    index_.erase(key.hash);
  }

  /// Returns once every entry put so far was sent (or failed, warned).
  void flush() { writer_->flush(); }

 private:
  struct FreeReply {
    void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
  };
  using Reply = std::unique_ptr<redisReply, FreeReply>;

  /// One connection and its failure state: the caller's (reading_, under
  /// mutex_) and the writer thread's (writing_, that thread only).
  struct Connection {
    redisContext* ctx = nullptr;
    bool failed = false;
    std::chrono::steady_clock::time_point failed_at{};
  };

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  int64_t retry_ns() const { return std::chrono::duration_cast<std::chrono::nanoseconds>(retry_).count(); }

  static timeval to_timeval(std::chrono::milliseconds ms) {
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
    tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
    return tv;
  }

  void failed(Connection& c) {
    if (c.ctx != nullptr) redisFree(c.ctx);
    c.ctx = nullptr;
    c.failed = true;
    c.failed_at = std::chrono::steady_clock::now();
    if (&c == &writing_) writer_failed_ns_.store(now_ns());
  }

  /// c's connection, or null while the server has failed within the last `retry`.
  redisContext* connection(Connection& c) {
    if (c.ctx != nullptr) return c.ctx;
    if (c.failed && std::chrono::steady_clock::now() - c.failed_at < retry_) return nullptr;
    redisContext* ctx = redisConnectWithTimeout(host_.c_str(), port_, to_timeval(timeout_));
    if (ctx == nullptr || ctx->err != 0 || redisSetTimeout(ctx, to_timeval(timeout_)) != REDIS_OK) {
      warn_("pagedkv::redis_store(", host_, ":", port_, "): cannot connect (",
            ctx == nullptr ? "out of memory" : ctx->errstr, "); a miss, retried in ", retry_.count(), " ms");
      if (ctx != nullptr) redisFree(ctx);
      c.ctx = nullptr;
      failed(c);
      return nullptr;
    }
    c.failed = false;
    c.ctx = ctx;
    if (&c == &writing_) writer_failed_ns_.store(kNever);
    return ctx;
  }

  /// Runs a command on c; null (connection dropped, warned) when the server
  /// did not answer within the timeout.
  template <class... Args>
  Reply command(Connection& c, const char* format, Args... args) {
    redisContext* ctx = connection(c);
    if (ctx == nullptr) return nullptr;
    auto* r = static_cast<redisReply*>(redisCommand(ctx, format, args...));
    if (r == nullptr) {
      warn_("pagedkv::redis_store(", host_, ":", port_, "): ", ctx->errstr[0] != '\0' ? ctx->errstr : "no reply",
            "; a miss, retried in ", retry_.count(), " ms");
      failed(c);
      return nullptr;
    }
    return Reply(r);
  }

  void unexpected(const char* what, const redisReply* r) {
    warn_("pagedkv::redis_store(", host_, ":", port_, "): ", what, " answered ",
          r->type == REDIS_REPLY_ERROR ? std::string(r->str, r->len) : "an unexpected reply", "; a miss");
  }

  /// The writer thread's job: one SET.
  bool write_entry(uint64_t key, const at::Tensor& entry) {
    const std::string k = prefix_ + PageKey{key}.name();
    Reply r = command(writing_, "SET %b %b", k.data(), k.size(), entry.data_ptr<uint8_t>(),
                      static_cast<size_t>(entry.numel()));
    if (!r || r->type != REDIS_REPLY_STATUS) {
      if (r) unexpected("SET", r.get());
      return false;
    }
    return true;
  }

  void forget_failed() {
    for (const uint64_t key : writer_->take_failed()) index_.erase(key);
  }

  /// The value of key k as an entry tensor; undefined on a miss.
  at::Tensor fetch(const std::string& k) {
    Reply r = command(reading_, "GET %b", k.data(), k.size());
    if (!r || r->type == REDIS_REPLY_NIL) return at::Tensor();
    if (r->type != REDIS_REPLY_STRING) {
      unexpected("GET", r.get());
      return at::Tensor();
    }
    at::Tensor entry = at::empty({static_cast<int64_t>(r->len)}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(entry.data_ptr<uint8_t>(), r->str, r->len);
    return entry;
  }

  std::string host_;
  int port_ = 0;
  int64_t max_bytes_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds retry_;
  std::string prefix_;
  std::mutex mutex_;
  Connection reading_;
  Connection writing_;
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::min() / 2;
  std::atomic<int64_t> writer_failed_ns_{kNever};  // when the writer's connection last failed (steady clock)
  detail::LruIndex<int> index_;
  detail::Warner warn_;
  std::unique_ptr<detail::WriteBehind> writer_;  // last: its thread uses everything above
};

/// A tier on the Redis (or Valkey) server at host_port ("HOST:PORT"), shared
/// by every engine that names it. max_bytes = 0: the server's limit decides.
inline std::shared_ptr<PageStore> redis_store(const std::string& host_port, int64_t max_bytes = 0) {
  return std::make_shared<RedisStore>(host_port, max_bytes);
}

}  // namespace stores

using stores::redis_store;

}  // namespace pagedkv
