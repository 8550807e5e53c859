// pagedkv.SequenceTable and pagedkv.PrefixCache: the C++ classes of the
// cache's layout, method for method.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "handles.hpp"
#include "pagedkv/prefix_cache.hpp"
#include "pagedkv/sequences.hpp"

namespace pagedkv_py {

Sequences::Sequences(Cache& cache, int64_t window) {
  cache.visit([&](auto& c) {
    using Layout = layout_of_t<decltype(c)>;
    table_ = std::make_unique<pagedkv::SequenceTable<Layout>>(c, window);
  });
}

int64_t Sequences::create() {
  return visit([](auto& t) { return t.create(); });
}
bool Sequences::reserve(int64_t seq, int64_t n_tokens) {
  return visit([&](auto& t) { return t.reserve(seq, n_tokens); });
}
int64_t Sequences::fork(int64_t seq) {
  return visit([&](auto& t) { return t.fork(seq); });
}
void Sequences::release(int64_t seq) {
  visit([&](auto& t) { t.release(seq); });
}
int64_t Sequences::length(int64_t seq) const {
  return std::visit([&](const auto& t) { return t->length(seq); }, table_);
}
bool Sequences::prepare_append(int64_t seq, int64_t n_tokens) {
  return visit([&](auto& t) { return t.prepare_append(seq, n_tokens); });
}
void Sequences::commit_append(int64_t seq, int64_t n_tokens) {
  visit([&](auto& t) { t.commit_append(seq, n_tokens); });
}
void Sequences::truncate(int64_t seq, int64_t n_tokens) {
  visit([&](auto& t) { t.truncate(seq, n_tokens); });
}
std::pair<at::Tensor, at::Tensor> Sequences::batch(const std::vector<int64_t>& seqs) const {
  return std::visit([&](const auto& t) { return t->batch(seqs); }, table_);
}
bool Sequences::swap_out(int64_t seq, Sequences& host) {
  return visit([&](auto& t) { return host.visit([&](auto& h) { return t.swap_out(seq, h); }); });
}
bool Sequences::swap_in(int64_t seq, Sequences& host) {
  return visit([&](auto& t) { return host.visit([&](auto& h) { return t.swap_in(seq, h); }); });
}
std::vector<int64_t> Sequences::pages(int64_t seq) const {
  return std::visit([&](const auto& t) { return t->pages(seq); }, table_);
}
int64_t Sequences::capacity(int64_t seq) const {
  return std::visit([&](const auto& t) { return t->capacity(seq); }, table_);
}
bool Sequences::swapped(int64_t seq) const {
  return std::visit([&](const auto& t) { return t->swapped(seq); }, table_);
}
bool Sequences::contains(int64_t seq) const {
  return std::visit([&](const auto& t) { return t->contains(seq); }, table_);
}
int64_t Sequences::size() const {
  return std::visit([](const auto& t) { return t->size(); }, table_);
}
int64_t Sequences::window() const {
  return std::visit([](const auto& t) { return t->window(); }, table_);
}
void Sequences::check() const {
  std::visit([](const auto& t) { t->check(); }, table_);
}

Prefix::Prefix(Sequences& seqs) {
  seqs.visit([&](auto& t) {
    using Layout = layout_of_t<decltype(t)>;
    prefix_ = std::make_unique<pagedkv::PrefixCache<Layout>>(t);
  });
}

int64_t Prefix::peek(const at::Tensor& tokens, uint64_t salt, int64_t max_tokens) const {
  return std::visit([&](const auto& p) { return p->peek(tokens, salt, max_tokens); }, prefix_);
}
std::pair<int64_t, int64_t> Prefix::acquire(const at::Tensor& tokens, uint64_t salt, int64_t max_tokens) {
  return std::visit([&](auto& p) { return p->acquire(tokens, salt, max_tokens); }, prefix_);
}
int64_t Prefix::insert(int64_t seq, const at::Tensor& tokens, uint64_t salt) {
  return std::visit([&](auto& p) { return p->insert(seq, tokens, salt); }, prefix_);
}
int64_t Prefix::evict(int64_t n_pages) {
  return std::visit([&](auto& p) { return p->evict(n_pages); }, prefix_);
}
void Prefix::clear() {
  std::visit([](auto& p) { p->clear(); }, prefix_);
}
int64_t Prefix::n_cached() const {
  return std::visit([](const auto& p) { return p->n_cached(); }, prefix_);
}
int64_t Prefix::n_evictable() const {
  return std::visit([](const auto& p) { return p->n_evictable(); }, prefix_);
}
pagedkv::PrefixStats Prefix::stats() const {
  return std::visit([](const auto& p) { return p->stats(); }, prefix_);
}
void Prefix::reset_stats() {
  std::visit([](auto& p) { p->reset_stats(); }, prefix_);
}
void Prefix::check() const {
  std::visit([](const auto& p) { p->check(); }, prefix_);
}

}  // namespace pagedkv_py
