// memplan's planned allocator on CPU: PlannedCore (planned_core.h) installed as
// PyTorch's CPU allocator (c10::SetCPUAllocator) for the duration of a Python context.
//
// A Session is one planned allocator (or one recorder). While it is installed, every
// CPU storage allocation comes here: in plan mode it is served at an arena offset when
// the core says so, else by c10::alloc_cpu (the default CPU allocator's own malloc) and
// counted; in record mode it is served by c10::alloc_cpu and logged (size, order,
// iteration), and so is its free. Each DataPtr carries a deleter that says how it was
// served, so frees after the context exits still reach the right place: a session
// keeps its arena until the last arena allocation is freed, then releases it. Tensors
// allocated before the context keep their old deleter and never come here.
//
// Like DefaultCPUAllocator, every allocation and free is reported to the profiler
// (c10::reportMemoryUsageToProfiler) so torch.profiler's memory timeline sees it.
//
// One lock guards all sessions: intra-op threads may allocate too.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "planned_core.h"

namespace memplan {
namespace {

enum class Mode { Record, Plan };

struct Session {
  Mode mode = Mode::Plan;
  bool installed = false;
  // plan mode
  std::unique_ptr<PlannedCore> core;
  char* base = nullptr;
  int64_t arena_bytes = 0;
  int64_t arena_allocations = 0;  // times the arena was allocated
  int64_t arena_releases = 0;
  std::unordered_map<void*, int64_t> fallback_live;  // pointer -> nbytes
  int64_t fallback_live_bytes = 0;
  int64_t peak_bytes = 0;       // arena held + fallback bytes live
  int64_t peak_live_bytes = 0;  // requested bytes live, arena and fallback
  // record mode
  std::vector<RecordedEvent> events;
  std::unordered_map<void*, std::pair<int64_t, int64_t>> record_live;  // pointer -> (buffer id, nbytes)
  int64_t record_iteration = 0;
  int64_t next_buffer = 0;

  int64_t held_bytes() const { return (base != nullptr ? arena_bytes : 0) + fallback_live_bytes; }
  int64_t live_bytes() const { return (core ? core->stats().arena_live_bytes : 0) + fallback_live_bytes; }
  void update_peaks() {
    peak_bytes = std::max(peak_bytes, held_bytes());
    peak_live_bytes = std::max(peak_live_bytes, live_bytes());
  }
  bool holds_memory() const { return base != nullptr || !fallback_live.empty() || !record_live.empty(); }
};

struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<Session>> sessions;  // installed, or still holding memory
  Session* active = nullptr;
  c10::Allocator* previous = nullptr;
};

// Never destroyed: tensors may be freed during interpreter shutdown.
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

void forget_if_done(Registry& r, Session* s) {
  if (s->installed || s->holds_memory()) return;
  r.sessions.erase(std::remove_if(r.sessions.begin(), r.sessions.end(),
                                  [s](const std::shared_ptr<Session>& p) { return p.get() == s; }),
                   r.sessions.end());
}

void release_arena(Session* s) {
  if (s->base != nullptr) {
    c10::free_cpu(s->base);
    s->base = nullptr;
    s->arena_releases++;
  }
}

void report(void* ptr, int64_t delta, const Session* s) {
  if (c10::memoryProfilingEnabled()) {
    const int64_t allocated = s ? s->live_bytes() : 0;
    const int64_t reserved = s ? s->held_bytes() : 0;
    c10::reportMemoryUsageToProfiler(ptr, delta, static_cast<size_t>(allocated),
                                     static_cast<size_t>(reserved), c10::Device(c10::DeviceType::CPU));
  }
}

void delete_nothing(void* /*unused*/) {}

void delete_arena(void* ptr) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto& sp : r.sessions) {
    Session* s = sp.get();
    if (s->base == nullptr) continue;
    char* p = static_cast<char*>(ptr);
    if (p < s->base || p >= s->base + s->arena_bytes) continue;
    const int64_t nbytes = s->core->release(p - s->base);
    report(ptr, -nbytes, s);
    if (!s->installed && s->core->stats().arena_live_allocations == 0) {
      release_arena(s);
      forget_if_done(r, s);
    }
    return;
  }
}

void delete_fallback(void* ptr) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto& sp : r.sessions) {
    Session* s = sp.get();
    auto it = s->fallback_live.find(ptr);
    if (it == s->fallback_live.end()) continue;
    s->fallback_live_bytes -= it->second;
    report(ptr, -it->second, s);
    s->fallback_live.erase(it);
    c10::free_cpu(ptr);
    forget_if_done(r, s);
    return;
  }
  c10::free_cpu(ptr);
}

void delete_recorded(void* ptr) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto& sp : r.sessions) {
    Session* s = sp.get();
    auto it = s->record_live.find(ptr);
    if (it == s->record_live.end()) continue;
    const auto [buffer, nbytes] = it->second;
    if (s->installed) s->events.push_back(RecordedEvent{1, buffer, nbytes, s->record_iteration, at::in_parallel_region()});
    s->record_live.erase(it);
    report(ptr, -nbytes, nullptr);
    c10::free_cpu(ptr);
    forget_if_done(r, s);
    return;
  }
  c10::free_cpu(ptr);
}

struct PlannedCPUAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &delete_nothing, cpu};
    auto& r = registry();
    std::unique_lock<std::mutex> lock(r.mutex);
    Session* s = r.active;
    const auto nbytes = static_cast<int64_t>(n);
    if (s == nullptr) {  // between install steps: behave like the default allocator
      lock.unlock();
      void* p = c10::alloc_cpu(n);
      return {p, p, &delete_fallback, cpu};
    }
    if (s->mode == Mode::Record) {
      void* p = c10::alloc_cpu(n);
      const int64_t id = s->next_buffer++;
      s->record_live.emplace(p, std::make_pair(id, nbytes));
      s->events.push_back(RecordedEvent{0, id, nbytes, s->record_iteration, at::in_parallel_region()});
      report(p, nbytes, nullptr);
      return {p, p, &delete_recorded, cpu};
    }
    const int64_t offset = s->core->place(nbytes);
    if (offset >= 0 && s->base != nullptr) {
      void* p = s->base + offset;
      s->update_peaks();
      report(p, nbytes, s);
      return {p, p, &delete_arena, cpu};
    }
    void* p = c10::alloc_cpu(n);
    s->fallback_live.emplace(p, nbytes);
    s->fallback_live_bytes += nbytes;
    s->update_peaks();
    report(p, nbytes, s);
    return {p, p, &delete_fallback, cpu};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PlannedCPUAllocator& planned_allocator() {
  static PlannedCPUAllocator* a = new PlannedCPUAllocator();
  return *a;
}

using WindowSpec = std::tuple<int64_t, int64_t, int64_t, std::vector<std::pair<int64_t, int64_t>>>;

std::shared_ptr<Session> new_planned(const std::vector<int64_t>& iterations,
                                     const std::vector<std::vector<int64_t>>& nbytes,
                                     const std::vector<std::vector<int64_t>>& offsets,
                                     const std::vector<WindowSpec>& windows, int64_t arena_bytes,
                                     int64_t alignment_bytes, int64_t first_iteration) {
  TORCH_CHECK(iterations.size() == nbytes.size() && nbytes.size() == offsets.size(),
              "one nbytes and one offset list per planned iteration");
  std::vector<GroupPlan> groups;
  for (size_t g = 0; g < iterations.size(); ++g) {
    TORCH_CHECK(nbytes[g].size() == offsets[g].size(), "iteration ", iterations[g],
                ": nbytes and offsets differ in length");
    for (size_t i = 0; i < nbytes[g].size(); ++i) {
      TORCH_CHECK(offsets[g][i] < 0 || offsets[g][i] + nbytes[g][i] <= arena_bytes, "iteration ",
                  iterations[g], " request ", i, " lies outside the arena");
    }
    groups.push_back(GroupPlan{iterations[g], nbytes[g], offsets[g], {}});
  }
  for (const auto& [iteration, begin, end, ranges] : windows) {
    for (auto& g : groups) {
      if (g.iteration != iteration) continue;
      std::vector<std::pair<int64_t, int64_t>> clipped;
      for (auto [lo, hi] : ranges) {
        lo = std::max<int64_t>(lo, 0);
        hi = std::min(hi, arena_bytes);
        if (lo < hi) clipped.emplace_back(lo, hi);
      }
      g.windows.push_back(DynamicWindow{begin, end, clipped});
    }
  }
  auto s = std::make_shared<Session>();
  s->mode = Mode::Plan;
  s->arena_bytes = arena_bytes;
  s->core = std::make_unique<PlannedCore>(std::move(groups), arena_bytes, alignment_bytes, first_iteration);
  return s;
}

std::shared_ptr<Session> new_recorder() {
  auto s = std::make_shared<Session>();
  s->mode = Mode::Record;
  return s;
}

void install(const std::shared_ptr<Session>& s) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  TORCH_CHECK(r.active == nullptr, "another memplan planned allocator is already installed");
  TORCH_CHECK(!s->installed, "this planned allocator is already installed");
  c10::Allocator* previous = c10::GetCPUAllocator();
  if (s->mode == Mode::Plan && s->base == nullptr && s->arena_bytes > 0) {
    s->base = static_cast<char*>(c10::alloc_cpu(static_cast<size_t>(s->arena_bytes)));
    s->arena_allocations++;
  }
  c10::SetCPUAllocator(&planned_allocator(), /*priority=*/0);
  if (c10::GetCPUAllocator() != &planned_allocator()) {
    release_arena(s.get());
    TORCH_CHECK(false, "PyTorch kept its CPU allocator: another allocator was installed with a higher priority");
  }
  r.previous = previous;
  r.active = s.get();
  s->installed = true;
  s->update_peaks();
  if (std::find(r.sessions.begin(), r.sessions.end(), s) == r.sessions.end()) r.sessions.push_back(s);
}

void uninstall(const std::shared_ptr<Session>& s) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!s->installed) return;
  c10::SetCPUAllocator(r.previous, /*priority=*/0);
  r.active = nullptr;
  r.previous = nullptr;
  s->installed = false;
  if (s->core && s->core->stats().arena_live_allocations == 0) release_arena(s.get());
  forget_if_done(r, s.get());
}

py::dict stats(const std::shared_ptr<Session>& s) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  py::dict d;
  d["installed"] = s->installed;
  if (s->mode == Mode::Record) {
    d["events"] = static_cast<int64_t>(s->events.size());
    d["live_allocations"] = static_cast<int64_t>(s->record_live.size());
    d["iteration"] = s->record_iteration;
    return d;
  }
  const CoreStats& c = s->core->stats();
  d["served"] = c.served_planned + c.served_dynamic;
  d["served_planned"] = c.served_planned;
  d["served_dynamic"] = c.served_dynamic;
  d["fallbacks"] = c.fallbacks;
  d["fallback_bytes"] = c.fallback_bytes;
  d["requests"] = c.requests;
  d["size_mismatches"] = c.size_mismatches;
  d["beyond_plan"] = c.beyond_plan;
  d["unplanned"] = c.unplanned;
  d["conflicts"] = c.conflicts;
  d["long_lived"] = c.long_lived;
  d["demoted"] = c.demoted;
  py::dict reasons;
  for (int k = 0; k < kNumFallbackReasons; ++k) reasons[kFallbackReasonNames[k]] = c.fallback_reasons[k];
  d["fallback_reasons"] = reasons;
  d["arena_bytes"] = s->arena_bytes;
  d["arena_held"] = s->base != nullptr;
  d["arena_allocations"] = s->arena_allocations;
  d["arena_releases"] = s->arena_releases;
  d["arena_live_bytes"] = c.arena_live_bytes;
  d["arena_live_allocations"] = c.arena_live_allocations;
  d["arena_peak_live_bytes"] = c.arena_peak_live_bytes;
  d["fallback_live_bytes"] = s->fallback_live_bytes;
  d["fallback_live_allocations"] = static_cast<int64_t>(s->fallback_live.size());
  d["peak_bytes"] = s->peak_bytes;
  d["peak_live_bytes"] = s->peak_live_bytes;
  d["iteration"] = s->core->iteration();
  py::list per_iteration;
  for (const auto& k : s->core->counts()) {
    py::dict e;
    e["iteration"] = k.iteration;
    e["requests"] = k.requests;
    e["served_planned"] = k.served_planned;
    e["served_dynamic"] = k.served_dynamic;
    e["fallbacks"] = k.fallbacks;
    per_iteration.append(e);
  }
  d["iterations"] = per_iteration;
  py::list conflicts;
  for (const auto& c : s->core->conflict_log()) {
    py::dict e;
    e["iteration"] = c.iteration;
    e["request"] = c.request;
    e["nbytes"] = c.nbytes;
    e["offset"] = c.offset;
    e["holder_iteration"] = c.holder_iteration;
    e["holder_request"] = c.holder_request;
    e["holder_offset"] = c.holder_offset;
    e["holder_nbytes"] = c.holder_nbytes;
    conflicts.append(e);
  }
  d["conflict_log"] = conflicts;
  return d;
}

void next_iteration(const std::shared_ptr<Session>& s) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (s->mode == Mode::Record) {
    s->record_iteration++;
  } else {
    s->core->next_iteration();
  }
}

// (kind, buffer, nbytes, iteration, parallel) columns of a recorder's log.
std::tuple<std::vector<int8_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
           std::vector<int8_t>>
events(const std::shared_ptr<Session>& s) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<int8_t> kind, parallel;
  std::vector<int64_t> buffer, nbytes, iteration;
  for (const auto& e : s->events) {
    kind.push_back(e.kind);
    buffer.push_back(e.buffer);
    nbytes.push_back(e.nbytes);
    iteration.push_back(e.iteration);
    parallel.push_back(e.parallel);
  }
  return {kind, buffer, nbytes, iteration, parallel};
}

}  // namespace
}  // namespace memplan

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using memplan::Session;
  py::class_<Session, std::shared_ptr<Session>>(m, "Session")
      .def("install", &memplan::install)
      .def("uninstall", &memplan::uninstall)
      .def("next_iteration", &memplan::next_iteration)
      .def("stats", &memplan::stats)
      .def("events", &memplan::events)
      .def_property_readonly("arena_address", [](const std::shared_ptr<Session>& s) {
        std::lock_guard<std::mutex> lock(memplan::registry().mutex);
        return reinterpret_cast<uintptr_t>(s->base);
      });
  m.def("new_planned", &memplan::new_planned);
  m.def("new_recorder", &memplan::new_recorder);
  m.def("cpu_allocator_address", [] { return reinterpret_cast<uintptr_t>(c10::GetCPUAllocator()); });
  m.def("planned_allocator_address", [] { return reinterpret_cast<uintptr_t>(&memplan::planned_allocator()); });
  m.def("live_sessions", [] {
    std::lock_guard<std::mutex> lock(memplan::registry().mutex);
    return memplan::registry().sessions.size();
  });
}
