// memplan's planned allocator on CUDA: PlannedCore (planned_core.h) behind
// torch.cuda.memory.CUDAPluggableAllocator, as STAlloc runs its plans. Compiled and
// loaded only when CUDA is present (memplan.runtime.build.cuda_extension); the
// pluggable allocator must be installed before the process's first CUDA allocation and
// then serves every one. Outside a plan (g_core null) it is cudaMalloc/cudaFree; inside,
// planned requests get arena offsets and the rest fall back to cudaMalloc. Python drives
// it through ctypes (memplan.runtime.cuda). One stream assumed: an arena range freed on
// one stream and reused on another would need an event, which this glue does not make.
#include <cuda_runtime_api.h>
#include <sys/types.h>

#include <memory>
#include <mutex>
#include <vector>

#include "planned_core.h"

namespace {
std::mutex g_mutex;
std::unique_ptr<memplan::PlannedCore> g_core;  // null: no plan active
char* g_arena = nullptr;
int64_t g_arena_bytes = 0;
bool g_ended = true;

void release_arena_if_done() {
  if (g_ended && g_arena != nullptr && g_core && g_core->stats().arena_live_allocations == 0) {
    cudaFree(g_arena);
    g_arena = nullptr;
  }
}
}  // namespace

extern "C" {

void* memplan_cuda_malloc(ssize_t size, int /*device*/, cudaStream_t /*stream*/) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_ended && g_arena != nullptr && size > 0) {
    const int64_t offset = g_core->place(size);
    if (offset >= 0) return g_arena + offset;
  }
  void* p = nullptr;
  return cudaMalloc(&p, size) == cudaSuccess ? p : nullptr;
}

void memplan_cuda_free(void* ptr, ssize_t /*size*/, int /*device*/, cudaStream_t /*stream*/) {
  std::lock_guard<std::mutex> lock(g_mutex);
  char* p = static_cast<char*>(ptr);
  if (g_arena != nullptr && p >= g_arena && p < g_arena + g_arena_bytes) {
    g_core->release(p - g_arena);
    release_arena_if_done();
    return;
  }
  cudaFree(ptr);
}

// A plan, flattened: group g has iterations[g] and counts[g] entries in nbytes/offsets;
// window w belongs to iteration window_iteration[w], covers requests
// [window_begin[w], window_end[w]) and owns window_ranges[w] (lo, hi) pairs of ranges.
int memplan_cuda_begin(int64_t num_groups, const int64_t* iterations, const int64_t* counts,
                       const int64_t* nbytes, const int64_t* offsets, int64_t num_windows,
                       const int64_t* window_iteration, const int64_t* window_begin,
                       const int64_t* window_end, const int64_t* window_ranges, const int64_t* ranges,
                       int64_t arena_bytes, int64_t alignment_bytes, int64_t first_iteration) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_ended || g_arena != nullptr) return 1;  // a plan (or its arena) is still active
  std::vector<memplan::GroupPlan> groups;
  for (int64_t g = 0, at = 0; g < num_groups; at += counts[g], ++g) {
    groups.push_back({iterations[g], {nbytes + at, nbytes + at + counts[g]},
                      {offsets + at, offsets + at + counts[g]}, {}});
  }
  for (int64_t w = 0, at = 0; w < num_windows; at += window_ranges[w], ++w) {
    memplan::DynamicWindow window{window_begin[w], window_end[w], {}};
    for (int64_t k = 0; k < window_ranges[w]; ++k) window.ranges.emplace_back(ranges[2 * (at + k)], ranges[2 * (at + k) + 1]);
    for (auto& g : groups) {
      if (g.iteration == window_iteration[w]) g.windows.push_back(window);
    }
  }
  if (arena_bytes > 0 && cudaMalloc(reinterpret_cast<void**>(&g_arena), arena_bytes) != cudaSuccess) return 2;
  g_arena_bytes = arena_bytes;
  g_core = std::make_unique<memplan::PlannedCore>(std::move(groups), arena_bytes, alignment_bytes, first_iteration);
  g_ended = false;
  return 0;
}

void memplan_cuda_next_iteration() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_core) g_core->next_iteration();
}

void memplan_cuda_end() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_ended = true;
  release_arena_if_done();
}

// In the order of STAT_NAMES in memplan/runtime/cuda.py: served, fallbacks, arena_bytes,
// arena held (0/1), arena live bytes, conflicts, size mismatches, requests, served planned,
// served dynamic, beyond plan, unplanned, long lived, demoted, fallback bytes.
void memplan_cuda_stats(int64_t* out) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const memplan::CoreStats s = g_core ? g_core->stats() : memplan::CoreStats{};
  const int64_t values[15] = {s.served_planned + s.served_dynamic, s.fallbacks, g_arena_bytes,
                              g_arena != nullptr, s.arena_live_bytes, s.conflicts, s.size_mismatches,
                              s.requests, s.served_planned, s.served_dynamic, s.beyond_plan,
                              s.unplanned, s.long_lived, s.demoted, s.fallback_bytes};
  for (int i = 0; i < 15; ++i) out[i] = values[i];
}

// Fallbacks per reason, in the order of memplan::kFallbackReasonNames (planned_core.h).
void memplan_cuda_fallback_reasons(int64_t* out) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const memplan::CoreStats s = g_core ? g_core->stats() : memplan::CoreStats{};
  for (int k = 0; k < memplan::kNumFallbackReasons; ++k) out[k] = s.fallback_reasons[k];
}

}  // extern "C"
