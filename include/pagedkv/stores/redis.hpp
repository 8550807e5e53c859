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
// - Every command waits at most `timeout`. A server that is down, killed
//   mid-transfer or slow makes the call a miss (or a refused put) with a
//   warning; the store then waits `retry` before it connects again, so a
//   dead server costs the engine one timeout per retry period, not per page.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <chrono>
#include <cstdint>
#include <cstring>
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
  RedisStore(const std::string& host_port, int64_t max_bytes = 0,
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
  }

  ~RedisStore() override {
    if (ctx_ != nullptr) redisFree(ctx_);
  }

  RedisStore(const RedisStore&) = delete;
  RedisStore& operator=(const RedisStore&) = delete;

  std::string tier() const override { return "remote"; }

  bool put(const PageKey& key, const at::Tensor& entry, std::vector<StoredPage>* pushed_out) override {
    if (!store_detail::valid_entry_tensor(entry)) return false;
    if (max_bytes_ > 0 && entry.numel() > max_bytes_) {
      warn_("pagedkv::redis_store(", host_, ":", port_, "): an entry of ", entry.numel(),
            " bytes exceeds the budget of ", max_bytes_, " bytes; not stored");
      return false;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    const std::string k = prefix_ + key.name();
    Reply r = command("SET %b %b", k.data(), k.size(), entry.data_ptr<uint8_t>(), static_cast<size_t>(entry.numel()));
    if (!r || r->type != REDIS_REPLY_STATUS) {
      if (r) fail("SET", r.get());
      return false;
    }
    if (max_bytes_ == 0) return true;
    index_.put(key.hash, entry.numel(), 0);
    while (index_.bytes() > max_bytes_) {
      const uint64_t old = index_.oldest()->key;
      if (old == key.hash) break;
      const std::string ok = prefix_ + PageKey{old}.name();
      if (pushed_out != nullptr) {
        at::Tensor bytes = fetch(ok);
        if (bytes.defined()) pushed_out->push_back(StoredPage{PageKey{old}, std::move(bytes)});
      }
      Reply d = command("DEL %b", ok.data(), ok.size());
      index_.erase(old);
      if (!d) break;
    }
    return true;
  }

  at::Tensor get(const PageKey& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    at::Tensor entry = fetch(prefix_ + key.name());
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
    const std::string k = prefix_ + key.name();
    command("DEL %b", k.data(), k.size());
    index_.erase(key.hash);
  }

  /// Whether the last command reached the server.
  bool connected() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return ctx_ != nullptr;
  }

 private:
  struct FreeReply {
    void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
  };
  using Reply = std::unique_ptr<redisReply, FreeReply>;

  static timeval to_timeval(std::chrono::milliseconds ms) {
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
    tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
    return tv;
  }

  /// A connection, or null while the server has failed within the last `retry`.
  redisContext* connection() {
    if (ctx_ != nullptr) return ctx_;
    const auto now = std::chrono::steady_clock::now();
    if (failed_ && now - failed_at_ < retry_) return nullptr;
    redisContext* c = redisConnectWithTimeout(host_.c_str(), port_, to_timeval(timeout_));
    if (c == nullptr || c->err != 0 || redisSetTimeout(c, to_timeval(timeout_)) != REDIS_OK) {
      warn_("pagedkv::redis_store(", host_, ":", port_, "): cannot connect (",
            c == nullptr ? "out of memory" : c->errstr, "); a miss, retried in ", retry_.count(), " ms");
      if (c != nullptr) redisFree(c);
      failed_ = true;
      failed_at_ = now;
      return nullptr;
    }
    failed_ = false;
    ctx_ = c;
    return ctx_;
  }

  /// Runs a command; null (connection dropped, warned) when the server did
  /// not answer within the timeout.
  template <class... Args>
  Reply command(const char* format, Args... args) {
    redisContext* c = connection();
    if (c == nullptr) return nullptr;
    auto* r = static_cast<redisReply*>(redisCommand(c, format, args...));
    if (r == nullptr) {
      warn_("pagedkv::redis_store(", host_, ":", port_, "): ", c->errstr[0] != '\0' ? c->errstr : "no reply",
            "; a miss, retried in ", retry_.count(), " ms");
      redisFree(ctx_);
      ctx_ = nullptr;
      failed_ = true;
      failed_at_ = std::chrono::steady_clock::now();
      return nullptr;
    }
    return Reply(r);
  }

  void fail(const char* what, const redisReply* r) {
    warn_("pagedkv::redis_store(", host_, ":", port_, "): ", what, " answered ",
          r->type == REDIS_REPLY_ERROR ? std::string(r->str, r->len) : "an unexpected reply", "; not stored");
  }

  /// The value of key k as an entry tensor; undefined on a miss.
  at::Tensor fetch(const std::string& k) {
    Reply r = command("GET %b", k.data(), k.size());
    if (!r || r->type == REDIS_REPLY_NIL) return at::Tensor();
    if (r->type != REDIS_REPLY_STRING) {
      fail("GET", r.get());
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
  mutable std::mutex mutex_;
  redisContext* ctx_ = nullptr;
  bool failed_ = false;
  std::chrono::steady_clock::time_point failed_at_{};
  store_detail::LruIndex<int> index_;
  store_detail::Warner warn_;
};

/// A tier on the Redis (or Valkey) server at host_port ("HOST:PORT"), shared
/// by every engine that names it. max_bytes = 0: the server's limit decides.
inline std::shared_ptr<PageStore> redis_store(const std::string& host_port, int64_t max_bytes = 0) {
  return std::make_shared<RedisStore>(host_port, max_bytes);
}

}  // namespace stores

using stores::redis_store;

}  // namespace pagedkv
