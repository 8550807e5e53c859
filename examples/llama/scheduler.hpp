// The engine loop: continuous batching over a paged KV cache.
//
// Every step has a token budget (--max-batch-tokens). Running requests go
// first, oldest first: a decoding request takes one token, one still in its
// prompt takes the rest of it or what the budget leaves (chunked prefill).
// What is left admits waiting requests, front first, while the pool has room
// for their first chunk; a new request first asks the PrefixCache for the
// longest cached prefix of its prompt and prefills only the rest.
//
// Pages are taken with SequenceTable::prepare_append before each step. When
// the pool runs short (free pages plus the prefix cache's evictable ones),
// the newest running request is preempted: swapped out to a host cache
// (SequenceTable::swap_out), or, when swapping is off or the host cache is
// full, released and later recomputed from its tokens (the prefix cache
// usually still holds most of them). Preempted requests resume before new
// ones. The oldest running request is never preempted for a younger one,
// and every request fits the pool on its own (requests.hpp checks that), so
// the loop always makes progress.
//
// With speculate > 0 (--speculate K), a decoding request drafts up to K
// tokens by prompt lookup (speculative.hpp) and computes its newest token
// and the drafts in the step's one forward pass (requests with as many
// drafts share an attention call); the longest prefix of drafts that equals
// the model's own greedy choices is kept, plus the model's next token, and
// the rejected drafts' K/V are rolled back (SequenceTable::truncate; on a
// windowed table only the kept tokens are committed, since a window cannot
// grow back). Greedy decoding makes the tokens exactly those without drafts.
//
// A model with sliding-window layers keeps their K/V in a second cache,
// through a windowed SequenceTable that frees the pages falling out of the
// window: every request has a sequence in both tables (the same id, created
// and released together), both are grown before a step (all or nothing),
// and preemption swaps or releases both. The prefix cache serves models
// without sliding layers only: a windowed table has already released the
// early pages a later request would share.
//
// A request finishes at max_new_tokens or at an EOS token (kept as its last
// token); its pages go back at once (the prefix cache keeps the full pages
// it registered, evictable, for later requests).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <functional>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "model.hpp"
#include "pagedkv/pagedkv.hpp"
#include "requests.hpp"
#include "speculative.hpp"

namespace llama {

struct SchedulerOptions {
  int64_t max_batch_tokens = 2048;  ///< new tokens per step, over every sequence
  int64_t max_seqs = 256;           ///< running requests at most
  bool prefix_cache = true;
  std::vector<std::shared_ptr<pagedkv::PageStore>> prefix_tiers;  ///< below the pool, fastest first (page_store.hpp)
  bool swap = true;          ///< preempt by swapping to the host cache (else by recomputing)
  bool keep_logits = false;  ///< keep the logits each generated token was chosen from
  int64_t speculate = 0;     ///< drafted tokens per decoding request and step at most (0: none)
  /// Sliding layers' pages leave a sequence as they fall out of its window
  /// (a windowed table); false keeps them to the end, as a cache without
  /// windowed tables would: the same tokens, to measure what windows save.
  bool free_out_of_window = true;
};

/// A finished request: the generated tokens (and, with keep_logits, the
/// [vocab] logits each was chosen from).
struct Finished {
  std::string id;
  std::vector<int64_t> tokens;
  std::vector<std::vector<float>> logits;
};

struct SchedulerStats {
  int64_t steps = 0;
  int64_t prefill_steps = 0;     ///< steps that computed prompt (or recomputed) tokens
  int64_t prompt_tokens = 0;     ///< prompt tokens of the requests admitted (first admission)
  int64_t prefill_tokens = 0;    ///< prompt tokens computed (prefix-cache hits excluded)
  int64_t recomputed_tokens = 0; ///< tokens computed again after a preemption by recompute
  int64_t decode_tokens = 0;     ///< tokens computed as a decode step's single new token
  int64_t generated_tokens = 0;
  int64_t prefix_query_tokens = 0;  ///< prompt tokens offered to the prefix cache at admissions
  int64_t prefix_hit_tokens = 0;    ///< of which the cache held K/V (their prefill skipped)
  std::map<std::string, int64_t> prefix_tier_hit_tokens;  ///< of those, loaded from each tier (by PageStore::tier())
  int64_t preempted_swap = 0;
  int64_t preempted_recompute = 0;
  int64_t chunks = 0;            ///< prefill chunks that stopped short of the prompt's end
  int64_t peak_pages = 0;        ///< pool pages held (by sequences or the prefix cache) at most, both pools together
  int64_t peak_pages_full = 0;     ///< of the full-attention layers' pool
  int64_t peak_pages_sliding = 0;  ///< of the sliding-window layers' pool
  int64_t peak_running = 0;
  int64_t peak_batch_seqs = 0;   ///< sequences in one step at most
  double prefill_seconds = 0;    ///< wall time of steps that prefilled
  double decode_seconds = 0;     ///< wall time of decode-only steps
  int64_t spec_proposed_tokens = 0;  ///< drafted tokens computed (--speculate)
  int64_t spec_accepted_tokens = 0;  ///< of which the model's greedy choice agreed and they were kept
};

template <class Layout>
class Scheduler {
 public:
  /// `caches` (its host caches may be absent: preemption then recomputes)
  /// must outlive the scheduler. The prefix cache (options.prefix_cache)
  /// runs only for a model without sliding layers (prefix_cache_on()).
  Scheduler(const Model& model, KvCaches<Layout>& caches, SchedulerOptions options,
            std::function<void(Finished&&)> on_finished)
      : model_(model), caches_(caches), options_(options), on_finished_(std::move(on_finished)) {
    if (caches.full) full_ = std::make_unique<pagedkv::SequenceTable<Layout>>(*caches.full);
    if (caches.sliding) {
      sliding_ = std::make_unique<pagedkv::SequenceTable<Layout>>(
          *caches.sliding, options_.free_out_of_window ? model.config().sliding_window : 0);
    }
    if (!full_ && !sliding_) throw std::invalid_argument("llama scheduler: no cache");
    if (full_ && sliding_ && caches.full->page_size() != caches.sliding->page_size()) {
      throw std::invalid_argument("llama scheduler: the full and sliding caches have different page sizes");
    }
    // Swapping needs a host cache for every device one.
    if ((!full_ || caches.full_host) && (!sliding_ || caches.sliding_host)) {
      if (full_) full_host_ = std::make_unique<pagedkv::SequenceTable<Layout>>(*caches.full_host);
      if (sliding_) sliding_host_ = std::make_unique<pagedkv::SequenceTable<Layout>>(*caches.sliding_host);
    }
    if (options_.prefix_cache && !sliding_) {
      prefix_ = std::make_unique<pagedkv::PrefixCache<Layout>>(*full_, options_.prefix_tiers);
    }
    for (int64_t id : model.config().eos_token_ids) eos_.insert(id);
  }

  ~Scheduler() {
    // The prefix cache must go before the table it is attached to.
    prefix_.reset();
  }

  void add(const Request& r) {
    auto a = std::make_unique<Active>();
    a->id = r.id;
    a->tokens = r.prompt;
    a->n_prompt = static_cast<int64_t>(r.prompt.size());
    a->max_new = r.max_new_tokens;
    waiting_.push_back(a.get());
    all_.push_back(std::move(a));
  }

  bool idle() const { return running_.empty() && waiting_.empty(); }
  const SchedulerStats& stats() const { return stats_; }
  /// Whether a prefix cache runs (options.prefix_cache, and no sliding layers).
  bool prefix_cache_on() const { return prefix_ != nullptr; }
  /// Pages the prefix cache holds (0 without one).
  int64_t cached_pages() const { return prefix_ ? prefix_->n_cached() : 0; }
  /// Before exit: the prefix cache's pages go down to its tiers (PrefixCache::persist).
  void persist_prefix() {
    if (prefix_) prefix_->persist();
  }

  /// One engine step: schedule, run the model once, sample, retire the
  /// finished. False when there is nothing left to do.
  bool step() {
    if (idle()) return false;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<Slot> slots = schedule();
    if (slots.empty()) throw std::logic_error("llama scheduler: no request could be scheduled (a bug)");
    const int64_t used_full = full_ ? full_->cache().n_pages() - full_->cache().n_free() : 0;
    const int64_t used_sliding = sliding_ ? sliding_->cache().n_pages() - sliding_->cache().n_free() : 0;
    stats_.peak_pages = std::max(stats_.peak_pages, used_full + used_sliding);
    stats_.peak_pages_full = std::max(stats_.peak_pages_full, used_full);
    stats_.peak_pages_sliding = std::max(stats_.peak_pages_sliding, used_sliding);
    stats_.peak_running = std::max(stats_.peak_running, static_cast<int64_t>(running_.size()));
    stats_.peak_batch_seqs = std::max(stats_.peak_batch_seqs, static_cast<int64_t>(slots.size()));
    bool prefill = false;
    for (const Slot& s : slots) prefill = prefill || s.n > 1 || computed(*s.r) < s.r->n_prompt;
    run(slots);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++stats_.steps;
    if (prefill) {
      ++stats_.prefill_steps;
      stats_.prefill_seconds += seconds;
    } else {
      stats_.decode_seconds += seconds;
    }
    return true;
  }

 private:
  enum class State { waiting, running, swapped };

  struct Active {
    std::string id;
    std::vector<int64_t> tokens;  ///< prompt, then every generated token
    int64_t n_prompt = 0;
    int64_t max_new = 0;
    int64_t seq = -1;  ///< in the device tables (swapped: its id there, marked swapped)
    State state = State::waiting;
    bool admitted_before = false;
    /// Leading pages of its sequence that are the prefix cache's own (shared
    /// at acquire, or registered by this request).
    int64_t chain_pages = 0;
    /// Whether its pages may still be registered in the prefix cache (see register_pages).
    bool registers = true;
    int64_t high_water = 0;        ///< tokens ever computed (a recompute starts below it)
    std::vector<std::vector<float>> logits;

    int64_t generated() const { return static_cast<int64_t>(tokens.size()) - n_prompt; }
    at::Tensor token_tensor() { return at::from_blob(tokens.data(), {static_cast<int64_t>(tokens.size())}, at::kLong); }
  };

  /// A request and the tokens it computes this step: n of its own, then
  /// its drafts (a decoding request with --speculate).
  struct Slot {
    Active* r;
    int64_t n;
    std::vector<int64_t> drafts = {};

    int64_t computes() const { return n + static_cast<int64_t>(drafts.size()); }
  };

  // ---- both tables in step: every request's sequence has the same id and
  // length in each ----

  /// The table that answers for both (they agree on lengths).
  pagedkv::SequenceTable<Layout>& first() const { return full_ ? *full_ : *sliding_; }
  int64_t page_size() const { return first().cache().page_size(); }
  int64_t computed(const Active& r) const { return r.seq < 0 ? 0 : first().length(r.seq); }

  int64_t create() {
    const int64_t seq = first().create();
    if (full_ && sliding_ && sliding_->create() != seq) {
      throw std::logic_error("llama scheduler: the full and sliding tables' ids diverged (a bug)");
    }
    return seq;
  }

  void release(int64_t seq) {
    if (full_) full_->release(seq);
    if (sliding_) sliding_->release(seq);
  }

  /// Room for n more tokens in both tables; false, and no page taken, when
  /// either pool is short (the sliding table's reserved pages are given back
  /// by truncating to its length).
  bool prepare_append(int64_t seq, int64_t n) {
    if (sliding_ && !sliding_->prepare_append(seq, n)) return false;
    if (full_ && !full_->prepare_append(seq, n)) {
      if (sliding_) sliding_->truncate(seq, sliding_->length(seq));
      return false;
    }
    return true;
  }

  void commit_append(int64_t seq, int64_t n) {
    if (full_) full_->commit_append(seq, n);
    if (sliding_) sliding_->commit_append(seq, n);
  }

  bool can_swap() const { return (!full_ || full_host_) && (!sliding_ || sliding_host_); }

  /// Both tables' sequence to their host tables; false, nothing changed, if
  /// a host cache is short.
  bool swap_out(int64_t seq) {
    if (!can_swap()) return false;
    if (sliding_ && !sliding_->swap_out(seq, *sliding_host_)) return false;
    if (full_ && !full_->swap_out(seq, *full_host_)) {
      // The pages it just gave back are free: coming back cannot fail.
      if (sliding_ && !sliding_->swap_in(seq, *sliding_host_)) {
        throw std::logic_error("llama scheduler: a swap-out could not be undone (a bug)");
      }
      return false;
    }
    return true;
  }

  bool swap_in(int64_t seq) {
    if (sliding_ && !sliding_->swap_in(seq, *sliding_host_)) return false;
    if (full_ && !full_->swap_in(seq, *full_host_)) {
      if (sliding_ && !sliding_->swap_out(seq, *sliding_host_)) {
        throw std::logic_error("llama scheduler: a swap-in could not be undone (a bug)");
      }
      return false;
    }
    return true;
  }

  /// Whether a swapped sequence of `length` tokens and its next n fit the
  /// device pools once swapped in: the full table holds every page, the
  /// windowed one only those from its window's first page on.
  bool fits_swapped_in(int64_t length, int64_t n) const {
    if (full_ && pages_for(length + n) > full_->cache().n_free() + (prefix_ ? prefix_->n_reclaimable() : 0)) {
      return false;
    }
    if (sliding_) {
      const int64_t w = sliding_->window();
      const int64_t dropped = w > 0 && length >= w ? (length - w + 1) / page_size() : 0;
      if (pages_for(length + n) - dropped > sliding_->cache().n_free()) return false;
    }
    return true;
  }

  std::vector<Slot> schedule() {
    std::vector<Slot> slots;
    int64_t budget = options_.max_batch_tokens;
    bool preempted = false;
    // Running requests, oldest first; the newest give way when pages run short.
    for (size_t i = 0; i < running_.size() && budget > 0;) {
      Active& r = *running_[i];
      const int64_t n = std::min(pending(r), budget);
      std::vector<int64_t> drafts = n == 1 ? draft(r, budget - 1) : std::vector<int64_t>();
      const auto computes = n + static_cast<int64_t>(drafts.size());
      bool ok = prepare_append(r.seq, computes);
      while (!ok) {
        Active* victim = running_.back();
        preempt(*victim);
        preempted = true;
        if (victim == &r) break;
        ok = prepare_append(r.seq, computes);
      }
      if (!ok) break;  // r was the newest: it went back to the waiting queue
      slots.push_back({&r, n, std::move(drafts)});
      budget -= computes;
      ++i;
    }
    // Waiting requests, front first (preempted ones were put there), while
    // they fit. Not after a preemption: the pool is short.
    while (!preempted && budget > 0 && static_cast<int64_t>(running_.size()) < options_.max_seqs &&
           !waiting_.empty()) {
      Active& w = *waiting_.front();
      const bool swapped = w.state == State::swapped;
      int64_t cached = 0;
      pagedkv::PrefixStats tier_hits{};  // the tiers' counts before acquire
      if (swapped) {
        // Only when its next tokens fit as well: a request swapped in
        // without them would be swapped out again at the next step.
        const int64_t length = first().length(w.seq);
        const int64_t n = std::min(static_cast<int64_t>(w.tokens.size()) - length, budget);
        if (!fits_swapped_in(length, n)) break;
        if (!swap_in(w.seq)) break;
        w.chain_pages = 0;  // fresh pages: none of them is the prefix cache's
      } else if (prefix_) {
        tier_hits = prefix_->tiers().empty() ? pagedkv::PrefixStats{} : prefix_->stats();
        std::tie(w.seq, cached) = prefix_->acquire(w.token_tensor());
      } else {
        w.seq = create();
      }
      const int64_t n = std::min(pending(w), budget);
      const bool fits = prepare_append(w.seq, n);
      if (!fits && !swapped) {  // back to where it was
        release(w.seq);
        w.seq = -1;
        break;
      }
      if (!swapped) {
        w.chain_pages = cached / page_size();
        w.registers = true;
        stats_.prefix_query_tokens += static_cast<int64_t>(w.tokens.size());
        stats_.prefix_hit_tokens += cached;
        if (prefix_ && !prefix_->tiers().empty()) {
          const pagedkv::PrefixStats after = prefix_->stats();
          for (size_t t = 0; t < after.tiers.size(); ++t) {
            stats_.prefix_tier_hit_tokens[after.tiers[t].tier] +=
                after.tiers[t].hit_tokens - tier_hits.tiers[t].hit_tokens;
          }
        }
        if (!w.admitted_before) stats_.prompt_tokens += w.n_prompt;
        w.admitted_before = true;
      }
      waiting_.pop_front();
      w.state = State::running;
      running_.push_back(&w);
      if (!fits) break;  // swapped in but short after all (cannot happen: checked above); it waits its turn
      slots.push_back({&w, n});
      budget -= n;
    }
    return slots;
  }

  /// Up to options_.speculate (and `room`) tokens drafted for decoding
  /// request `r` by prompt lookup, never past its max_new_tokens: the step
  /// adds the model's own token after the accepted drafts.
  std::vector<int64_t> draft(const Active& r, int64_t room) const {
    const int64_t left = r.max_new - r.generated() - 1;
    const int64_t k = std::min({options_.speculate, room, left});
    if (k <= 0) return {};
    return prompt_lookup_draft(r.tokens, k);
  }

  /// Tokens `r` has not computed yet (its whole prompt at first, then the
  /// newest generated token).
  int64_t pending(const Active& r) const { return static_cast<int64_t>(r.tokens.size()) - computed(r); }

  /// Moves the newest running request `r` (running_.back()) to the front of
  /// the waiting queue: swapped out, or released to be recomputed.
  void preempt(Active& r) {
    running_.pop_back();
    if (options_.swap && swap_out(r.seq)) {
      r.state = State::swapped;
      ++stats_.preempted_swap;
    } else {
      release(r.seq);
      r.seq = -1;
      r.state = State::waiting;
      ++stats_.preempted_recompute;
    }
    waiting_.push_front(&r);
  }

  void run(const std::vector<Slot>& slots) {
    // Decode-like slots (one new token each, or one and the same number of
    // drafts) share one attention call; each prompt chunk has its own.
    std::map<int64_t, std::vector<const Slot*>> decoding;  // by tokens computed
    std::vector<const Slot*> chunks;
    for (const Slot& s : slots) {
      if (s.n == 1) {
        decoding[s.computes()].push_back(&s);
      } else {
        chunks.push_back(&s);
      }
    }
    std::vector<const Slot*> order;
    for (const auto& group : decoding) order.insert(order.end(), group.second.begin(), group.second.end());
    order.insert(order.end(), chunks.begin(), chunks.end());

    int64_t total = 0;
    for (const Slot* s : order) total += s->computes();
    at::Tensor tokens = at::empty({total}, at::kLong);
    at::Tensor positions = at::empty({total}, at::kLong);
    int64_t* tok = tokens.data_ptr<int64_t>();
    int64_t* pos = positions.data_ptr<int64_t>();
    StepInput in;
    std::vector<int64_t> logit_rows;
    std::vector<const Slot*> sampled;  // whose logits rows (1 + its drafts) come next in `logit_rows`
    int64_t row = 0;
    const auto add_group = [&](const std::vector<const Slot*>& group, int64_t n_new) {
      std::vector<int64_t> ids;
      for (const Slot* s : group) ids.push_back(s->r->seq);
      AttentionGroup g;
      g.row0 = row;
      g.n_seqs = static_cast<int64_t>(group.size());
      g.n_new = n_new;
      if (full_) std::tie(g.page_table, g.start) = full_->batch(ids);
      if (sliding_) std::tie(g.sliding_table, g.start) = sliding_->batch(ids);
      in.groups.push_back(std::move(g));
      for (const Slot* s : group) {
        Active& r = *s->r;
        const int64_t from = computed(r);
        for (int64_t j = 0; j < s->computes(); ++j) {
          tok[row + j] = j < s->n ? r.tokens[static_cast<size_t>(from + j)] : s->drafts[static_cast<size_t>(j - s->n)];
          pos[row + j] = from + j;
        }
        count_tokens(r, from, s->n);
        if (from + s->n == static_cast<int64_t>(r.tokens.size())) {
          for (int64_t j = s->n - 1; j < s->computes(); ++j) logit_rows.push_back(row + j);
          sampled.push_back(s);
        } else {
          ++stats_.chunks;
        }
        row += s->computes();
      }
    };
    for (const auto& group : decoding) add_group(group.second, group.first);
    for (const Slot* s : chunks) add_group({s}, s->n);
    in.tokens = tokens;
    in.positions = positions;
    in.logit_rows = at::tensor(logit_rows, at::kLong);

    const at::Tensor logits = model_.forward(caches_, in);  // [M, vocab] float32
    const at::Tensor next = logits.argmax(-1).cpu();       // lowest index on ties, as torch.argmax
    const at::Tensor host_logits = options_.keep_logits ? logits.cpu().contiguous() : at::Tensor();

    // Each sampled slot's new tokens, as greedy decoding without drafts would
    // choose them: the choice after its own token, then, while the draft
    // before equals the last choice, the choice after that draft.
    std::vector<std::vector<int64_t>> chosen(sampled.size());  // [slot][token]
    std::vector<int64_t> first_row(sampled.size());            // its first row of `next`
    int64_t m = 0;
    for (size_t i = 0; i < sampled.size(); ++i) {
      const Slot& s = *sampled[i];
      first_row[i] = m;
      const auto k = static_cast<int64_t>(s.drafts.size());
      for (int64_t j = 0; j <= k; ++j) {
        chosen[i].push_back(next.data_ptr<int64_t>()[m + j]);
        if (ended(*s.r, chosen[i]) || j == k || s.drafts[static_cast<size_t>(j)] != chosen[i].back()) break;
      }
      m += k + 1;
    }
    std::map<const Slot*, size_t> sampled_index;
    for (size_t i = 0; i < sampled.size(); ++i) sampled_index[sampled[i]] = i;
    for (const Slot* s : order) {
      const auto it = sampled_index.find(s);
      if (s->drafts.empty() || it == sampled_index.end()) {
        commit_append(s->r->seq, s->computes());
      } else {
        // Its own token and the drafts taken (each equal to the choice before it).
        const std::vector<int64_t>& taken = chosen[it->second];
        const auto accepted = static_cast<int64_t>(taken.size()) - 1;
        commit_computed(*s, s->n + accepted);
        stats_.spec_proposed_tokens += static_cast<int64_t>(s->drafts.size());
        stats_.spec_accepted_tokens += accepted;
        s->r->tokens.insert(s->r->tokens.end(), taken.begin(), taken.end() - 1);  // before their pages register
      }
      register_pages(*s->r);
    }
    std::vector<Active*> done;
    for (size_t i = 0; i < sampled.size(); ++i) {
      Active& r = *sampled[i]->r;
      r.tokens.push_back(chosen[i].back());
      stats_.generated_tokens += static_cast<int64_t>(chosen[i].size());
      if (options_.keep_logits) {
        for (size_t j = 0; j < chosen[i].size(); ++j) {
          const float* p = host_logits.data_ptr<float>() + (first_row[i] + static_cast<int64_t>(j)) * host_logits.size(1);
          r.logits.emplace_back(p, p + host_logits.size(1));
        }
      }
      if (ended(r, {})) done.push_back(&r);
    }
    for (Active* r : done) retire(*r);
  }

  /// Whether `r`, with `more` tokens chosen after its current ones, is done:
  /// at max_new_tokens, or its last token an EOS (with nothing more chosen,
  /// whether its current ones are).
  bool ended(const Active& r, const std::vector<int64_t>& more) const {
    const int64_t generated = r.generated() + static_cast<int64_t>(more.size());
    if (generated <= 0) return false;
    const int64_t last = more.empty() ? r.tokens.back() : more.back();
    return generated >= r.max_new || eos_.count(last) != 0;
  }

  /// Commits the first `kept` of the tokens slot `s` computed: all of them,
  /// or, with rejected drafts, its own token and the drafts taken. The
  /// rejected drafts' K/V go: truncated from the full table, never committed
  /// to the windowed one (whose window cannot grow back: its reserved pages
  /// past the kept tokens are simply written again).
  void commit_computed(const Slot& s, int64_t kept) {
    const int64_t seq = s.r->seq;
    if (kept == s.computes()) {
      commit_append(seq, kept);
      return;
    }
    if (sliding_) sliding_->commit_append(seq, kept);
    if (full_) {
      const int64_t length = full_->length(seq);
      full_->commit_append(seq, s.computes());
      full_->truncate(seq, length + kept);
    }
  }

  /// Sorts the n tokens from position `from` into prompt tokens computed
  /// for the first time, tokens computed again (after a preemption by
  /// recompute) and the newest generated token (a decode).
  void count_tokens(Active& r, int64_t from, int64_t n) {
    const int64_t end = from + n;
    const int64_t again = std::max<int64_t>(0, std::min(end, r.high_water) - from);
    const int64_t fresh_from = from + again;
    const int64_t prompt = std::max<int64_t>(0, std::min(end, r.n_prompt) - fresh_from);
    stats_.recomputed_tokens += again;
    stats_.prefill_tokens += prompt;
    stats_.decode_tokens += n - again - prompt;  // only the newest token can be both new and generated
    r.high_water = std::max(r.high_water, end);
  }

  /// Offers `r`'s newly completed full pages to the prefix cache, unless
  /// the cache already holds some of its tokens in pages of another sequence
  /// (two requests that computed the same prefix in the same step; a
  /// swapped-in request, whose pages are fresh copies). Registering pages
  /// below those would pin them: the prefix cache evicts a page only after
  /// every cached page that continues it, so a request running alone could
  /// then find the pool short by pages nobody uses, and wait forever.
  void register_pages(Active& r) {
    if (!prefix_ || !r.registers) return;
    const int64_t length = full_->length(r.seq);
    const int64_t full = length / page_size();
    if (full <= r.chain_pages) return;
    const at::Tensor tokens = r.token_tensor();
    if (prefix_->peek(tokens, 0, length) != r.chain_pages * page_size()) {
      r.registers = false;
      return;
    }
    prefix_->insert(r.seq, tokens);
    r.chain_pages = full;
  }

  int64_t pages_for(int64_t tokens) const { return (tokens + page_size() - 1) / page_size(); }

  void retire(Active& r) {
    release(r.seq);
    r.seq = -1;
    running_.erase(std::find(running_.begin(), running_.end(), &r));
    Finished f;
    f.id = r.id;
    f.tokens.assign(r.tokens.begin() + r.n_prompt, r.tokens.end());
    f.logits = std::move(r.logits);
    r.tokens = std::vector<int64_t>();
    on_finished_(std::move(f));
  }

  const Model& model_;
  KvCaches<Layout>& caches_;
  std::unique_ptr<pagedkv::SequenceTable<Layout>> full_, sliding_;  // either may be absent, not both
  std::unique_ptr<pagedkv::SequenceTable<Layout>> full_host_, sliding_host_;  // both, or neither (no swapping)
  std::unique_ptr<pagedkv::PrefixCache<Layout>> prefix_;  // attached to full_; destroyed first
  SchedulerOptions options_;
  std::function<void(Finished&&)> on_finished_;
  std::set<int64_t> eos_;
  std::vector<std::unique_ptr<Active>> all_;
  std::vector<Active*> running_;  // admission order: the back is the newest
  std::deque<Active*> waiting_;
  SchedulerStats stats_;
};

}  // namespace llama
