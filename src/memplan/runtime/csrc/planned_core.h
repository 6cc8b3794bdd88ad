// The device-neutral core of memplan's planned allocator: which arena offset serves
// the next allocation request, and the statistics of what happened.
//
// STWeaver/STAlloc's runtime (arXiv 2507.16274; public code infinigence/STAlloc): the
// n-th allocation request of an iteration is matched to the n-th entry of that
// iteration's plan (size checked) and served at the planned offset inside one arena;
// a request that does not match is placed best-fit (aligned) into the plan's dynamic
// reusable space intersected with what is free right now; anything else goes to the
// device's default allocator. Iterations beyond the last planned one replay the last
// planned iteration's entries (the plan is periodic).
//
// The core knows offsets only, never pointers, so the CPU glue (planned_allocator.cpp)
// and the CUDA glue (planned_allocator_cuda.cpp) share it. It is not thread safe: the
// glue holds a lock around every call.
//
// One deviation from STAlloc: a planned offset is served only if its bytes are free
// right now (a sorted map of the live arena ranges is checked). When the run departs
// from the plan (a tensor kept alive longer than it was when the plan was made), the
// request falls back instead of overwriting live data; it is counted as a conflict.
//
// A plan entry of offset -2 (LONG_LIVED, memplan/layout/plan.py) is a request that
// outlives its iteration (a kept loss, a logged metric): it goes to the default
// allocator directly, never into the dynamic space, whose ranges are free only during
// their window. Every fallback is counted under the reason it happened
// (CoreStats::fallback_reasons, named by kFallbackReasonNames).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace memplan {

struct DynamicWindow {
  int64_t begin_request;
  int64_t end_request;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [lo, hi) of the arena
};

struct GroupPlan {
  int64_t iteration;  // -1: prologue
  std::vector<int64_t> nbytes;
  std::vector<int64_t> offset;  // -1: not planned
  std::vector<DynamicWindow> windows;
};

constexpr int64_t kNotPlanned = -1;  // a dynamic request: the dynamic space, else the fallback
constexpr int64_t kLongLived = -2;   // outlives its iteration: the fallback serves it

// Why a request went to the default allocator; the order of kFallbackReasonNames.
enum FallbackReason : int {
  kUnplannedSize = 0,     // the n-th request's size differs from the plan's (and no dynamic room)
  kOutlivedIteration,     // the plan marks it long-lived (kLongLived)
  kBeyondPlan,            // more requests than the plan has entries (and no dynamic room)
  kConflict,              // its planned bytes were still held (and no dynamic room)
  kDynamicNoRoom,         // a dynamic entry (kNotPlanned) the dynamic space had no room for
  kNoPlan,                // the iteration has no plan (a prologue the plan lacks)
  kNumFallbackReasons
};
constexpr const char* kFallbackReasonNames[kNumFallbackReasons] = {
    "unplanned_size", "outlived_iteration", "beyond_plan", "conflict", "dynamic_no_room", "no_plan"};

struct IterationCounts {
  int64_t iteration = 0;
  int64_t requests = 0;
  int64_t served_planned = 0;
  int64_t served_dynamic = 0;
  int64_t fallbacks = 0;
};

// Why a planned request could not take its offset: which earlier request still held it.
struct Conflict {
  int64_t iteration, request, nbytes, offset;
  int64_t holder_iteration, holder_request, holder_offset, holder_nbytes;
};

struct CoreStats {
  int64_t requests = 0;
  int64_t served_planned = 0;
  int64_t served_dynamic = 0;
  int64_t fallbacks = 0;
  int64_t fallback_bytes = 0;  // requested bytes that went to the default allocator
  int64_t size_mismatches = 0;  // the n-th request's size differed from the plan's
  int64_t beyond_plan = 0;      // more requests than the plan has entries
  int64_t unplanned = 0;        // the plan's entry is dynamic (offset -1)
  int64_t conflicts = 0;        // the planned bytes were still in use
  int64_t long_lived = 0;       // the plan's entry is long-lived (offset kLongLived)
  int64_t demoted = 0;          // planned entries made long-lived: the run kept their tensor longer
  int64_t fallback_reasons[kNumFallbackReasons] = {};
  int64_t arena_live_bytes = 0;
  int64_t arena_live_allocations = 0;
  int64_t arena_peak_live_bytes = 0;
};

class PlannedCore {
 public:
  PlannedCore(std::vector<GroupPlan> groups, int64_t arena_bytes, int64_t alignment_bytes,
              int64_t first_iteration)
      : groups_(std::move(groups)),
        arena_bytes_(arena_bytes),
        alignment_bytes_(std::max<int64_t>(alignment_bytes, 1)),
        iteration_(first_iteration) {
    counts_.push_back(IterationCounts{iteration_});
    select_group();
  }

  int64_t arena_bytes() const { return arena_bytes_; }
  int64_t iteration() const { return iteration_; }
  const CoreStats& stats() const { return stats_; }
  const std::vector<IterationCounts>& counts() const { return counts_; }
  const std::vector<Conflict>& conflict_log() const { return conflict_log_; }
  static constexpr size_t kConflictLogSize = 32;

  // The arena offset that serves the next request of `nbytes`, or -1: fall back.
  int64_t place(int64_t nbytes) {
    const int64_t index = request_++;
    stats_.requests++;
    counts_.back().requests++;
    if (group_ == nullptr) return fall_back(nbytes, kNoPlan);
    FallbackReason reason;
    const auto n = static_cast<int64_t>(group_->nbytes.size());
    if (index >= n) {
      stats_.beyond_plan++;
      reason = kBeyondPlan;
    } else if (group_->nbytes[index] != nbytes) {
      stats_.size_mismatches++;
      reason = kUnplannedSize;
    } else if (group_->offset[index] == kLongLived) {
      stats_.long_lived++;
      return fall_back(nbytes, kOutlivedIteration);
    } else if (group_->offset[index] < 0) {
      stats_.unplanned++;
      reason = kDynamicNoRoom;
    } else if (is_free(group_->offset[index], nbytes)) {
      take(group_->offset[index], nbytes, index, group_);
      stats_.served_planned++;
      counts_.back().served_planned++;
      return group_->offset[index];
    } else {
      stats_.conflicts++;
      log_conflict(index, nbytes, group_->offset[index]);
      demote_outlived_holder(group_->offset[index], nbytes);
      reason = kConflict;
    }
    const int64_t offset = best_fit_dynamic(index, nbytes);
    if (offset >= 0) {
      take(offset, nbytes, index, nullptr);
      stats_.served_dynamic++;
      counts_.back().served_dynamic++;
      return offset;
    }
    return fall_back(nbytes, reason);
  }

  // Give back the arena bytes at `offset` (served by place()); returns their count, or -1.
  int64_t release(int64_t offset) {
    auto it = live_.find(offset);
    if (it == live_.end()) return -1;
    const int64_t nbytes = it->second.end - it->first;
    stats_.arena_live_bytes -= nbytes;
    stats_.arena_live_allocations--;
    live_.erase(it);
    return nbytes;
  }

  void next_iteration() {
    iteration_++;
    request_ = 0;
    counts_.push_back(IterationCounts{iteration_});
    select_group();
  }

 private:
  int64_t fall_back(int64_t nbytes, FallbackReason reason) {
    stats_.fallbacks++;
    stats_.fallback_bytes += nbytes;
    stats_.fallback_reasons[reason]++;
    counts_.back().fallbacks++;
    return -1;
  }

  void select_group() {
    group_ = nullptr;
    for (auto& g : groups_) {
      if (g.iteration == iteration_) group_ = &g;
    }
    // Periodic: beyond the last planned iteration, replay it.
    if (group_ == nullptr && !groups_.empty() && groups_.back().iteration >= 0 &&
        iteration_ > groups_.back().iteration) {
      group_ = &groups_.back();
    }
  }

  struct LiveRange {
    int64_t end, iteration, request;
    GroupPlan* planned_by;  // the group whose planned offset it took; null: dynamic space
  };

  // The live range that overlaps [lo, lo + nbytes), or live_.end().
  std::map<int64_t, LiveRange>::const_iterator overlapping(int64_t lo, int64_t nbytes) const {
    auto it = live_.lower_bound(lo + nbytes);
    if (it == live_.begin()) return live_.end();
    --it;  // live ranges never overlap: the one with the largest start below hi reaches furthest
    return it->second.end > lo ? it : live_.end();
  }

  bool is_free(int64_t lo, int64_t nbytes) const {
    if (lo < 0 || lo + nbytes > arena_bytes_) return false;
    return overlapping(lo, nbytes) == live_.end();
  }

  void log_conflict(int64_t index, int64_t nbytes, int64_t offset) {
    if (conflict_log_.size() >= kConflictLogSize) return;
    Conflict c{iteration_, index, nbytes, offset, -1, -1, -1, 0};
    auto it = overlapping(offset, nbytes);
    if (it != live_.end()) {
      c.holder_iteration = it->second.iteration;
      c.holder_request = it->second.request;
      c.holder_offset = it->first;
      c.holder_nbytes = it->second.end - it->first;
    }
    conflict_log_.push_back(c);
  }

  // The planned tensor that holds [lo, lo + nbytes) was made in an earlier iteration of
  // the group now replayed: it outlived the lifetime the plan gave it (the loop kept it).
  // Its entry becomes long-lived, so the next iterations serve it from the fallback
  // instead of leaving it where their planned requests will conflict with it again.
  void demote_outlived_holder(int64_t lo, int64_t nbytes) {
    auto it = overlapping(lo, nbytes);
    if (it == live_.end()) return;
    const LiveRange& holder = it->second;
    if (holder.planned_by != group_ || holder.iteration >= iteration_) return;
    if (group_->offset[holder.request] < 0) return;
    group_->offset[holder.request] = kLongLived;
    stats_.demoted++;
  }

  // nbytes > 0: the glue never asks the core about zero-byte requests.
  void take(int64_t lo, int64_t nbytes, int64_t index, GroupPlan* planned_by) {
    live_.emplace(lo, LiveRange{lo + nbytes, iteration_, index, planned_by});
    stats_.arena_live_bytes += nbytes;
    stats_.arena_live_allocations++;
    stats_.arena_peak_live_bytes = std::max(stats_.arena_peak_live_bytes, stats_.arena_live_bytes);
  }

  int64_t align_up(int64_t x) const { return (x + alignment_bytes_ - 1) / alignment_bytes_ * alignment_bytes_; }

  // Best fit into the free parts of the windows that cover request `index`.
  int64_t best_fit_dynamic(int64_t index, int64_t nbytes) const {
    int64_t best = -1;
    int64_t best_room = INT64_MAX;
    for (const auto& w : group_->windows) {
      if (index < w.begin_request || index >= w.end_request) continue;
      for (const auto& [lo, hi] : w.ranges) {
        // Walk the gaps between the live ranges that meet [lo, hi).
        auto it = live_.lower_bound(lo);
        if (it != live_.begin()) {
          auto prev = std::prev(it);
          if (prev->second.end > lo) it = prev;
        }
        int64_t cursor = lo;
        while (cursor < hi) {
          const int64_t gap_end = (it == live_.end()) ? hi : std::min(hi, it->first);
          const int64_t start = align_up(cursor);
          const int64_t room = gap_end - start;
          if (room >= nbytes && room < best_room) {
            best = start;
            best_room = room;
          }
          if (it == live_.end()) break;
          cursor = std::max(cursor, it->second.end);
          ++it;
        }
      }
    }
    return best;
  }

  std::vector<GroupPlan> groups_;
  int64_t arena_bytes_;
  int64_t alignment_bytes_;
  int64_t iteration_;
  int64_t request_ = 0;
  GroupPlan* group_ = nullptr;
  std::map<int64_t, LiveRange> live_;  // start -> (end, who took it)
  CoreStats stats_;
  std::vector<IterationCounts> counts_;
  std::vector<Conflict> conflict_log_;
};

// Recording mode: every request and free, in order, with the iteration it fell in.
struct RecordedEvent {
  int8_t kind;  // 0 alloc, 1 free
  int64_t buffer;
  int64_t nbytes;
  int64_t iteration;
  int8_t parallel;  // inside an intra-op parallel region: its order against others may vary
};

}  // namespace memplan
