// Exact offset search (decision form) in C++: the skyline search of
// memplan/layout/exact.py, node for node, about a hundred times faster.
//
// The method is minimalloc's (Moffitt, "MiniMalloc: A Lightweight Memory Allocator
// for Hardware-Accelerated Machine Learning", ASPLOS 2023; google/minimalloc) with
// exact.py's skyline branching rule:
//   - canonical placements: every buffer rests on offset 0 or on another buffer;
//     each section (a maximal time interval with a constant live set) has a skyline
//     below which all is placed or proven empty;
//   - branching: a lowest section with no slack must be filled from its skyline up,
//     so branch over the buffers that can sit exactly there, in the section with the
//     fewest (fail first); otherwise the lowest, leftmost open section: a buffer that
//     starts there sits at its skyline, or nothing does and the skyline rises to the
//     next level a buffer could rest at;
//   - cross-section inference: in every section touched by a move, the unplaced
//     bytes must fit above the lowest level any unplaced buffer there can reach, and
//     (a staircase) for every level L, the bytes of the buffers that cannot rest
//     below L must fit between L and the capacity;
//   - dominance: identical candidates (lifetime, size, alignment) tried once;
//   - decomposition where no buffer crosses a section boundary, statically and when
//     the last buffer crossing one is placed;
//   - candidate orders tried in turn under a doubling node budget or, when the
//     order list ends with "*", Luby restarts with a fresh random order each run.
// exact.py stays the reference (the tests compare the two); every result of either
// is checked by memplan/layout/validate.py before it is returned.
//
// The file also holds OffsetOrderSearch (minimalloc's own branching, below) and
// solve_portfolio, which runs both searches on two threads.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr int kFound = 0, kNotFound = 1, kAborted = 2, kTimeout = 3;
// The last order "*": after the orders before it, Luby restarts with random orders.
const char* const kLubyRestarts = "*";
constexpr int64_t kDone = std::numeric_limits<int64_t>::max();

// Sections (maximal time intervals with a constant live set) of a problem: each
// buffer's section range, the buffers covering each section, the bytes live in it,
// and how many buffers cross each section boundary. Both searches derive from it.
class Sections {
 protected:
  Sections(const std::vector<int64_t>& lower, const std::vector<int64_t>& upper, const std::vector<int64_t>& nbytes) {
    const int n = static_cast<int>(nbytes.size());
    std::vector<int64_t> points(lower);
    points.insert(points.end(), upper.begin(), upper.end());
    std::sort(points.begin(), points.end());
    points.erase(std::unique(points.begin(), points.end()), points.end());
    num_sections_ = std::max<int>(static_cast<int>(points.size()) - 1, 0);
    s_lo_.resize(n);
    s_hi_.resize(n);
    covering_.assign(num_sections_, {});
    total_.assign(num_sections_, 0);
    cuts_.assign(num_sections_, 0);
    for (int b = 0; b < n; ++b) {
      s_lo_[b] = static_cast<int>(std::lower_bound(points.begin(), points.end(), lower[b]) - points.begin());
      s_hi_[b] = static_cast<int>(std::lower_bound(points.begin(), points.end(), upper[b]) - points.begin());
      for (int s = s_lo_[b]; s < s_hi_[b]; ++s) {
        covering_[s].push_back(b);
        total_[s] += nbytes[b];
      }
      for (int s = s_lo_[b]; s + 1 < s_hi_[b]; ++s) ++cuts_[s];
    }
  }

  int num_sections_ = 0;
  std::vector<int> s_lo_, s_hi_, cuts_;  // per buffer: its sections [s_lo, s_hi); per boundary: buffers crossing it
  std::vector<std::vector<int>> covering_;  // per section: the buffers live in it
  std::vector<int64_t> total_;  // per section: unplaced bytes live in it
};

bool stopped(const std::atomic<bool>* flag) { return flag != nullptr && flag->load(std::memory_order_relaxed); }

// A flag Python sets to stop a running portfolio (another engine answered first).
struct StopToken {
  std::atomic<bool> flag{false};
  void set() { flag.store(true); }
};

std::chrono::steady_clock::time_point deadline_after(double time_limit_s) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(std::max(0.0, time_limit_s)));
}

class Search : private Sections {
 public:
  Search(const std::vector<int64_t>& lower, const std::vector<int64_t>& upper,
         const std::vector<int64_t>& nbytes, const std::vector<int64_t>& align,
         int64_t capacity, double time_limit_s, int64_t max_nodes)
      : Sections(lower, upper, nbytes), n_(static_cast<int>(nbytes.size())), size_(nbytes), align_(align),
        capacity_(capacity), max_nodes_(max_nodes) {
    deadline_ = deadline_after(time_limit_s);
    skyline_.assign(num_sections_, 0);
    starting_.assign(num_sections_, {});
    for (int b = 0; b < n_; ++b) starting_[s_lo_[b]].push_back(b);
    overlaps_.assign(n_, {});  // includes the buffer itself
    for (int b = 0; b < n_; ++b)
      for (int o = 0; o < n_; ++o)
        if (s_lo_[o] < s_hi_[b] && s_lo_[b] < s_hi_[o]) overlaps_[b].push_back(o);
    rest_.assign(n_, 0);
    placed_.assign(n_, 0);
    offset_.assign(n_, -1);
    rank_.assign(n_, 0);
  }

  int solve(const std::vector<std::string>& heuristics) {
    for (int s = 0; s < num_sections_; ++s)
      if (total_[s] > capacity_) return kNotFound;
    for (int b = 0; b < n_; ++b)
      if (size_[b] > capacity_) return kNotFound;
    int start = 0;
    for (int k = 0; k < num_sections_; ++k) {
      if (k == num_sections_ - 1 || cuts_[k] == 0) {
        if (max_total(start, k + 1) > 0) {
          int status = solve_part(start, k + 1, heuristics);
          if (status != kFound) return status;
        }
        start = k + 1;
      }
    }
    return kFound;
  }

  const std::vector<int64_t>& offsets() const { return offset_; }
  int64_t nodes() const { return nodes_; }
  int64_t backtracks() const { return backtracks_; }

 private:
  int64_t max_total(int a, int z) const {
    int64_t m = 0;
    for (int k = a; k < z; ++k) m = std::max(m, total_[k]);
    return m;
  }

  void set_order(const std::string& heuristic) {
    // Keys taken largest first: W sections spanned, Z size, A area (bytes x sections).
    std::vector<int> order(n_);
    std::iota(order.begin(), order.end(), 0);
    auto key = [this](char c, int b) -> int64_t {
      int64_t width = s_hi_[b] - s_lo_[b];
      if (c == 'W') return width;
      if (c == 'Z') return size_[b];
      if (c == 'A') return size_[b] * width;
      return 0;
    };
    // A trailing "/seed" breaks ties in a random order (a restart that differs).
    std::vector<uint32_t> tie(n_);
    std::iota(tie.begin(), tie.end(), 0u);
    const size_t slash = heuristic.find('/');
    const std::string keys = heuristic.substr(0, slash);
    if (slash != std::string::npos) {
      std::mt19937 rng(static_cast<uint32_t>(std::stoul(heuristic.substr(slash + 1))));
      std::shuffle(tie.begin(), tie.end(), rng);
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      for (char c : keys) {
        int64_t x = key(c, a), y = key(c, b);
        if (x != y) return x > y;
      }
      return tie[a] < tie[b];
    });
    for (int i = 0; i < n_; ++i) rank_[order[i]] = i;
  }

  // Luby's sequence (1, 1, 2, 1, 1, 2, 4, 1, ...), i >= 1.
  static int64_t luby(int64_t i) {
    while (true) {
      int k = 1;
      while ((int64_t{1} << k) - 1 < i) ++k;
      if ((int64_t{1} << k) - 1 == i) return int64_t{1} << (k - 1);
      i -= (int64_t{1} << (k - 1)) - 1;
    }
  }

  int solve_part(int s_start, int s_end, const std::vector<std::string>& heuristics) {
    if (!heuristics.empty() && heuristics.back() == kLubyRestarts) {
      // Restarts: the given orders first, then a fresh random candidate order each run,
      // run r stopping after 2n x luby(r) nodes. On tight packings the run time of one
      // order is heavy-tailed (a few hundred nodes, or over a hundred thousand: measured
      // over 120 random orders of five 350-450-buffer instances), which many short runs
      // exploit; the budgets keep growing, so a proof of infeasibility still completes.
      const int64_t unit = 2 * std::max<int64_t>(n_, 64);
      const size_t fixed = heuristics.size() - 1;
      for (int64_t r = 1;; ++r) {
        const size_t i = static_cast<size_t>(r - 1);
        set_order(i < fixed ? heuristics[i] : "/" + std::to_string(r));
        node_limit_ = nodes_ + unit * luby(r);
        int status = search(s_start, s_end);
        if (status != kAborted) return status;
      }
    }
    int64_t budget = std::max<int64_t>(n_, 64);
    while (true) {
      for (const std::string& h : heuristics) {
        set_order(h);
        node_limit_ = heuristics.size() > 1 ? nodes_ + budget : kDone;
        int status = search(s_start, s_end);
        if (status != kAborted) return status;
      }
      budget *= 2;
    }
  }

  int search(int s_start, int s_end) {
    ++nodes_;
    if (nodes_ > node_limit_) return kAborted;
    if (nodes_ > max_nodes_) return kTimeout;
    if ((nodes_ & 255) == 0 && (std::chrono::steady_clock::now() > deadline_ ||
                                stopped(stop_) || stopped(cancel_)))
      return kTimeout;
    int64_t lowest = kDone;
    for (int k = s_start; k < s_end; ++k)
      if (total_[k] > 0) lowest = std::min(lowest, skyline_[k]);
    if (lowest == kDone) return kFound;  // every buffer of this part is placed
    // A lowest section with no slack: some buffer sits right at its skyline.
    int best_row = -1;
    size_t best_count = 0;
    std::vector<int> candidates;
    for (int k = s_start; k < s_end; ++k) {
      if (total_[k] <= 0 || skyline_[k] != lowest || skyline_[k] + total_[k] != capacity_) continue;
      // Count up to the best so far: only a strictly smaller count changes the choice.
      size_t count = 0;
      for (int b : covering_[k])
        if (rest_[b] == lowest && (++count >= best_count && best_row >= 0)) break;
      if (best_row < 0 || count < best_count) {
        best_row = k;
        best_count = count;
        if (count <= 1) break;  // floors_fit keeps at least one: none can be fewer
      }
    }
    if (best_row >= 0) {
      for (int b : covering_[best_row])
        if (rest_[b] == lowest && lowest % align_[b] == 0) candidates.push_back(b);
      int status = branch(candidates, lowest, s_start, s_end);
      if (status == kNotFound) ++backtracks_;
      return status;
    }
    // Otherwise the lowest, leftmost open section: a buffer starting there, or nothing.
    int s = -1;
    for (int k = s_start; k < s_end; ++k)
      if (total_[k] > 0 && skyline_[k] == lowest) { s = k; break; }
    const int64_t h = lowest;
    for (int b : starting_[s]) {
      if (placed_[b] || h % align_[b] || h + size_[b] > capacity_) continue;
      int64_t top = 0;
      for (int k = s; k < s_hi_[b]; ++k) top = std::max(top, skyline_[k]);
      if (top != h) continue;
      candidates.push_back(b);
    }
    int status = branch(candidates, h, s_start, s_end);
    if (status != kNotFound) return status;
    // Nothing sits at (s, h): raise the section to the next level a buffer could rest at.
    int64_t rise = next_level(s, h);
    if (rise != kDone && rise + total_[s] <= capacity_) {
      skyline_[s] = rise;
      bool fits = true;
      const std::vector<int>& cov = covering_[s];
      std::vector<int64_t> saved(cov.size());
      int a = s, z = s + 1;  // the sections whose floors may have risen
      for (size_t i = 0; i < cov.size(); ++i) {
        const int o = cov[i];
        saved[i] = rest_[o];
        if (placed_[o] || saved[i] >= rise) continue;
        rest_[o] = rise;
        a = std::min(a, s_lo_[o]);
        z = std::max(z, s_hi_[o]);
        if (rise + size_[o] > capacity_) fits = false;
      }
      if (fits && floors_fit(a, z)) status = search(s_start, s_end);
      for (size_t i = 0; i < cov.size(); ++i) rest_[cov[i]] = saved[i];
      skyline_[s] = h;
    }
    if (status == kNotFound) ++backtracks_;
    return status;
  }

  int branch(std::vector<int>& candidates, int64_t h, int s_start, int s_end) {
    std::sort(candidates.begin(), candidates.end(), [this](int a, int b) { return rank_[a] < rank_[b]; });
    std::vector<std::tuple<int, int, int64_t, int64_t>> tried;
    for (int b : candidates) {
      const int lo = s_lo_[b], hi = s_hi_[b];
      // Same lifetime, size and alignment: interchangeable (alignment matters: an
      // aligned buffer can take offsets an unaligned twin leaves to it).
      const std::tuple<int, int, int64_t, int64_t> signature{lo, hi, size_[b], align_[b]};
      if (std::find(tried.begin(), tried.end(), signature) != tried.end()) continue;
      tried.push_back(signature);
      const int64_t top = h + size_[b];
      if (top > capacity_) continue;
      std::vector<int64_t> saved_sky(skyline_.begin() + lo, skyline_.begin() + hi);
      bool fits = true;
      for (int k = lo; k < hi; ++k) {
        skyline_[k] = top;
        total_[k] -= size_[b];
        if (top + total_[k] > capacity_) fits = false;
      }
      placed_[b] = 1;
      offset_[b] = h;
      const std::vector<int>& ov = overlaps_[b];
      std::vector<int64_t> saved_rest(ov.size());
      int a = lo, z = hi;  // the sections whose floors may have risen
      for (size_t i = 0; i < ov.size(); ++i) {
        const int o = ov[i];
        saved_rest[i] = rest_[o];
        if (o == b || placed_[o] || saved_rest[i] >= top) continue;
        rest_[o] = top;
        a = std::min(a, s_lo_[o]);
        z = std::max(z, s_hi_[o]);
        // An unplaced buffer pushed so high that it no longer fits: dead end.
        if (top + size_[o] > capacity_) fits = false;
      }
      rest_[b] = kDone;
      int status = kNotFound;
      if (fits && floors_fit(a, z)) status = place_rest(s_start, s_end, lo, hi);
      for (size_t i = 0; i < ov.size(); ++i) rest_[ov[i]] = saved_rest[i];
      placed_[b] = 0;
      for (int k = lo; k < hi; ++k) {
        total_[k] += size_[b];
        skyline_[k] = saved_sky[k - lo];
      }
      if (status != kNotFound) {
        if (status != kFound) offset_[b] = -1;
        return status;
      }
      offset_[b] = -1;
    }
    return kNotFound;
  }

  // In sections [a, z), where rest levels rose or bytes were placed, some unplaced
  // buffer must still sit low enough for the section's unplaced bytes to fit.
  bool floors_fit(int a, int z) {
    for (int k = a; k < z; ++k) {
      if (total_[k] <= 0) continue;
      int64_t lowest = kDone, high = 0, top = 0;
      const int64_t sky = skyline_[k];
      const std::vector<int>& cov = covering_[k];
      for (int b : cov) {
        const int64_t r = rest_[b];
        if (r == kDone) continue;
        lowest = std::min(lowest, r);
        if (r > sky) {
          high += size_[b];
          top = std::max(top, r);
        }
      }
      if (lowest == kDone || lowest + total_[k] > capacity_) return false;
      // Staircase: for every level L, the unplaced bytes that cannot sit below L
      // (those resting at L or above) must fit in [L, capacity). A level L at or
      // below capacity - (all bytes resting above the skyline) passes whatever
      // rests there, so only the levels above that threshold are sorted and checked,
      // and the bytes resting at or above such a level all rest above the threshold.
      if (top + high <= capacity_) continue;
      const int64_t threshold = std::max(sky, capacity_ - high);
      levels_.clear();
      for (int b : cov) {
        const int64_t r = rest_[b];
        if (r != kDone && r > threshold) levels_.emplace_back(r, size_[b]);
      }
      std::sort(levels_.begin(), levels_.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
      int64_t above = 0;  // bytes resting at or above the current level
      for (size_t i = 0; i < levels_.size(); ++i) {
        above += levels_[i].second;
        if ((i + 1 == levels_.size() || levels_[i + 1].first != levels_[i].first) && levels_[i].first + above > capacity_)
          return false;
      }
    }
    return true;
  }
  std::vector<std::pair<int64_t, int64_t>> levels_;

  // Search on after a buffer over sections [lo, hi) was placed, splitting the range
  // where no unplaced buffer crosses a boundary any more: the parts are independent.
  int place_rest(int s_start, int s_end, int lo, int hi) {
    std::vector<int> bounds{s_start};
    for (int k = lo; k + 1 < hi; ++k)
      if (--cuts_[k] == 0) bounds.push_back(k + 1);
    int status = kFound;
    if (bounds.size() == 1) {
      status = search(s_start, s_end);
    } else {
      bounds.push_back(s_end);
      for (size_t i = 0; i + 1 < bounds.size(); ++i) {
        int a = bounds[i], z = bounds[i + 1];
        if (a < z && max_total(a, z) > 0) {
          status = search(a, z);
          if (status != kFound) break;
        }
      }
    }
    for (int k = lo; k + 1 < hi; ++k) ++cuts_[k];
    return status;
  }

  // Lowest offset above h at which an unplaced buffer live in section s could rest.
  int64_t next_level(int s, int64_t h) const {
    int64_t best = kDone;
    for (int b : covering_[s]) {
      if (placed_[b]) continue;
      int64_t level = 0;
      bool any = false;
      for (int k = s_lo_[b]; k < s_hi_[b]; ++k) {
        if (k == s) continue;
        level = std::max(level, skyline_[k]);
        any = true;
      }
      if (!any) level = 0;
      const int64_t a = align_[b];
      if (level <= h && h % a != 0) {
        // It cannot sit at h for its alignment: it floats at the next aligned offset.
        level = h + 1;
      } else if (level <= h) {
        // It would rest on an unplaced buffer of another section: at least that high.
        int64_t smallest = kDone;
        for (int o : overlaps_[b]) {
          if (o == b || placed_[o] || (s_lo_[o] <= s && s < s_hi_[o])) continue;
          smallest = std::min(smallest, size_[o]);
        }
        if (smallest == kDone) continue;
        level = h + smallest;
      }
      level = (level + a - 1) / a * a;
      best = std::min(best, level);
    }
    return best;
  }

  int n_;
  std::vector<int64_t> size_, align_;
  int64_t capacity_;
  std::chrono::steady_clock::time_point deadline_;
  std::vector<int> rank_;
  std::vector<std::vector<int>> starting_, overlaps_;
  std::vector<int64_t> skyline_, rest_, offset_;
  std::vector<char> placed_;
  int64_t max_nodes_ = kDone;  // a deterministic budget: past it the search gives up as on a timeout
  int64_t node_limit_ = kDone, nodes_ = 0, backtracks_ = 0;

 public:
  const std::atomic<bool>* stop_ = nullptr;  // set by a portfolio partner that has answered
  const std::atomic<bool>* cancel_ = nullptr;  // set from Python (a StopToken): another engine has answered
};

// ---------------------------------------------------------------------------------
// The offset-order search: minimalloc's own branching (Moffitt, ASPLOS 2023), written
// from the paper's description. Buffers are placed one at a time at their lowest
// viable offset (the highest top of the placed buffers they overlap), in
// non-decreasing (offset, pre-order rank): a canonical order, so every packing is
// reached once. Pruned by dominance (no buffer goes at or above the lowest top any
// unplaced buffer could reach: that buffer would fit under it) and by section
// inference with a monotonic floor (every later buffer goes at or above the current
// offset, so in each section max(offset, floor) + unplaced bytes <= capacity, where a
// section's floor is the top of what is placed there, raised to the lowest offset any
// of its unplaced buffers can take). Decomposes when the last unplaced buffer crossing
// a section boundary is placed. Pre-orders tried round robin under a doubling node
// budget. It has no Python twin: the tests check it against the skyline search
// (same feasibility answers on random problems) and validate every packing it finds.
class OffsetOrderSearch : private Sections {
 public:
  OffsetOrderSearch(const std::vector<int64_t>& lower, const std::vector<int64_t>& upper,
                    const std::vector<int64_t>& nbytes, const std::vector<int64_t>& align,
                    int64_t capacity, double time_limit_s, int64_t max_nodes)
      : Sections(lower, upper, nbytes), n_(static_cast<int>(nbytes.size())), lower_(lower), upper_(upper),
        size_(nbytes), align_(align), capacity_(capacity), max_nodes_(max_nodes) {
    deadline_ = deadline_after(time_limit_s);
    floor_.assign(num_sections_, 0);
    overlaps_.assign(n_, {});  // other buffers live at the same time
    for (int b = 0; b < n_; ++b)
      for (int o = 0; o < n_; ++o)
        if (o != b && s_lo_[o] < s_hi_[b] && s_lo_[b] < s_hi_[o]) overlaps_[b].push_back(o);
    offset_.assign(n_, -1);
    solution_.assign(n_, -1);
    min_offset_.assign(n_, 0);
    stamp_.assign(num_sections_, 0);
  }

  int solve(const std::vector<std::string>& heuristics) {
    for (int b = 0; b < n_; ++b)
      if (size_[b] > capacity_) return kNotFound;
    for (int s = 0; s < num_sections_; ++s)
      if (total_[s] > capacity_) return kNotFound;
    std::vector<Part> parts;
    int start = 0;
    for (int k = 0; k < num_sections_; ++k) {
      if (k == num_sections_ - 1 || cuts_[k] == 0) {
        Part part{start, k + 1, {}};
        for (int b = 0; b < n_; ++b)
          if (s_lo_[b] >= start && s_lo_[b] < k + 1) part.buffers.push_back(b);
        if (!part.buffers.empty()) parts.push_back(std::move(part));
        start = k + 1;
      }
    }
    if (heuristics.size() == 1) {
      current_heuristic_ = heuristics[0];
      for (const Part& part : parts) {
        int status = sub_solve(part);
        if (status != kFound) return status;
      }
      return kFound;
    }
    int64_t limit = n_;
    while (true) {
      limit *= 2;
      for (const std::string& h : heuristics) {
        node_budget_ = limit;
        current_heuristic_ = h;
        int status = kFound;
        for (const Part& part : parts) {
          status = sub_solve(part);
          if (status != kFound) break;
        }
        if (status != kAborted) return status;
      }
    }
  }

  const std::vector<int64_t>& offsets() const { return solution_; }
  int64_t nodes() const { return nodes_; }
  int64_t backtracks() const { return backtracks_; }

 private:
  struct Part {
    int lo, hi;  // sections [lo, hi)
    std::vector<int> buffers;
  };

  int64_t key(char c, int b, int64_t total) const {
    const int64_t width = upper_[b] - lower_[b];
    switch (c) {
      case 'W': return width;
      case 'A': return size_[b] * width;
      case 'T': return total;
      case 'C': return s_hi_[b] - s_lo_[b];
      case 'Z': return size_[b];
      default: return 0;
    }
  }

  int sub_solve(const Part& part) {
    const std::string& heuristic = current_heuristic_;
    const int m = static_cast<int>(part.buffers.size());
    std::vector<int64_t> totals(m, 0);
    for (int i = 0; i < m; ++i) {
      const int b = part.buffers[i];
      for (int s = s_lo_[b]; s < s_hi_[b]; ++s) totals[i] = std::max(totals[i], total_[s]);
    }
    std::vector<int> idx(m);
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](int x, int y) {
      const int a = part.buffers[x], b = part.buffers[y];
      for (char c : heuristic) {
        const int64_t ka = key(c, a, totals[x]), kb = key(c, b, totals[y]);
        if (ka != kb) return ka > kb;
      }
      return a < b;
    });
    std::vector<int> preorder(m);
    for (int i = 0; i < m; ++i) preorder[i] = part.buffers[idx[i]];
    std::vector<int> ranks(m);
    std::iota(ranks.begin(), ranks.end(), 0);
    return search(part, preorder, ranks, 0, 0);
  }

  int search(const Part& part, const std::vector<int>& preorder, const std::vector<int>& parent,
             int64_t min_offset, int min_rank) {
    if (node_budget_ <= 0) return kAborted;
    --node_budget_;
    ++nodes_;
    if (nodes_ > max_nodes_) return kTimeout;
    if ((nodes_ & 255) == 0 && (std::chrono::steady_clock::now() > deadline_ ||
                                stopped(stop_) || stopped(cancel_)))
      return kTimeout;
    // The unplaced buffers of the part by (lowest viable offset, pre-order rank).
    std::vector<std::pair<int64_t, int>> order;
    order.reserve(parent.size());
    for (int r : parent)
      if (offset_[preorder[r]] < 0) order.emplace_back(min_offset_[preorder[r]], r);
    if (order.empty()) {
      for (int b : part.buffers) solution_[b] = offset_[b];
      return kFound;
    }
    std::sort(order.begin(), order.end());
    std::vector<int> ranks(order.size());
    int64_t min_top = kDone;
    for (size_t i = 0; i < order.size(); ++i) {
      ranks[i] = order[i].second;
      min_top = std::min(min_top, order[i].first + size_[preorder[order[i].second]]);
    }
    // Every section must hold its unplaced bytes above the offset placed now (monotonic
    // floor): no candidate above capacity - (largest unplaced total) can pass the check.
    int64_t largest_total = 0;
    for (int s = part.lo; s < part.hi; ++s) largest_total = std::max(largest_total, total_[s]);
    for (const auto& [off, r] : order) {
      if (off + largest_total > capacity_) break;  // so does every later candidate
      if (off < min_offset || (off == min_offset && r < min_rank)) continue;  // not canonical
      if (off >= min_top) continue;  // dominated: an unplaced buffer fits below
      const int b = preorder[r];
      const int64_t top = off + size_[b];
      offset_[b] = off;
      // Raise the lowest viable offset of every unplaced buffer it overlaps.
      const size_t offset_mark = offset_log_.size();
      ++epoch_;
      affected_.clear();
      for (int o : overlaps_[b]) {
        if (offset_[o] >= 0 || min_offset_[o] >= top) continue;
        offset_log_.emplace_back(o, min_offset_[o]);
        const int64_t a = align_[o];
        min_offset_[o] = (top + a - 1) / a * a;
        for (int s = s_lo_[o]; s < s_hi_[o]; ++s)
          if (stamp_[s] != epoch_) {
            stamp_[s] = epoch_;
            affected_.push_back(s);
          }
      }
      // Section floors and unplaced totals.
      const size_t floor_mark = floor_log_.size();
      for (int s = s_lo_[b]; s < s_hi_[b]; ++s) {
        floor_log_.emplace_back(s, floor_[s]);
        floor_[s] = top;
        total_[s] -= size_[b];
      }
      for (int s : affected_) {
        int64_t lowest = kDone;
        for (int o : covering_[s])
          if (offset_[o] < 0) lowest = std::min(lowest, min_offset_[o]);
        if (lowest != kDone && floor_[s] < lowest) {
          floor_log_.emplace_back(s, floor_[s]);
          floor_[s] = lowest;
        }
      }
      bool ok = true;
      for (int s = part.lo; s < part.hi && ok; ++s)
        ok = std::max(off, floor_[s]) + total_[s] <= capacity_;
      int status = kNotFound;
      if (ok) status = decompose(part, preorder, ranks, off, r, b);
      for (size_t i = floor_log_.size(); i > floor_mark; --i) floor_[floor_log_[i - 1].first] = floor_log_[i - 1].second;
      floor_log_.resize(floor_mark);
      for (int s = s_lo_[b]; s < s_hi_[b]; ++s) total_[s] += size_[b];
      for (size_t i = offset_log_.size(); i > offset_mark; --i)
        min_offset_[offset_log_[i - 1].first] = offset_log_[i - 1].second;
      offset_log_.resize(offset_mark);
      offset_[b] = -1;
      if (status != kNotFound) return status;
    }
    ++backtracks_;
    return kNotFound;
  }

  int decompose(const Part& part, const std::vector<int>& preorder, const std::vector<int>& ranks,
                int64_t off, int r, int b) {
    solution_[b] = offset_[b];
    std::vector<int> cut_at = {part.lo};
    for (int s = s_lo_[b]; s + 1 < s_hi_[b]; ++s)
      if (--cuts_[s] == 0) cut_at.push_back(s + 1);
    int status = kFound;
    if (cut_at.size() == 1) {
      status = search(part, preorder, ranks, off, r);
    } else {
      cut_at.push_back(part.hi);
      for (size_t c = 1; c < cut_at.size(); ++c) {
        Part sub{cut_at[c - 1], cut_at[c], {}};
        for (int o : part.buffers)
          if (offset_[o] < 0 && s_lo_[o] < sub.hi && sub.lo < s_hi_[o]) sub.buffers.push_back(o);
        if (sub.buffers.empty()) continue;
        status = sub_solve(sub);
        if (status != kFound) break;
      }
    }
    for (int s = s_lo_[b]; s + 1 < s_hi_[b]; ++s) ++cuts_[s];
    return status;
  }

  std::string current_heuristic_;
  int n_;
  std::vector<int64_t> lower_, upper_, size_, align_;
  int64_t capacity_;
  int64_t max_nodes_;
  std::chrono::steady_clock::time_point deadline_;
  std::vector<std::vector<int>> overlaps_;
  std::vector<int64_t> floor_, offset_, solution_, min_offset_;
  std::vector<std::pair<int, int64_t>> offset_log_, floor_log_;
  std::vector<int> affected_;
  std::vector<uint64_t> stamp_;
  uint64_t epoch_ = 0;
  int64_t node_budget_ = kDone, nodes_ = 0, backtracks_ = 0;

 public:
  const std::atomic<bool>* stop_ = nullptr;  // set by a portfolio partner that has answered
  const std::atomic<bool>* cancel_ = nullptr;  // set from Python (a StopToken): another engine has answered
};

// One search without the GIL: (status, offsets when found, nodes, backtracks).
template <typename S>
std::tuple<int, std::vector<int64_t>, int64_t, int64_t> run_search(
    const std::vector<int64_t>& lower, const std::vector<int64_t>& upper,
    const std::vector<int64_t>& nbytes, const std::vector<int64_t>& align, int64_t capacity,
    double time_limit_s, const std::vector<std::string>& heuristics, int64_t max_nodes) {
  int status;
  std::vector<int64_t> offsets;
  int64_t nodes, backtracks;
  {
    pybind11::gil_scoped_release release;
    S search(lower, upper, nbytes, align, capacity, time_limit_s, max_nodes);
    status = search.solve(heuristics);
    if (status == kFound) offsets = search.offsets();
    nodes = search.nodes();
    backtracks = search.backtracks();
  }
  return std::make_tuple(status, offsets, nodes, backtracks);
}

// Both searches at once, one thread each; the first definite answer (found, or
// proven infeasible) stops the other, and so does `token` (None or a StopToken)
// when Python sets it. The offset-order search stops at its own (shorter) time
// limit when told; then, with `mirrored`, its thread runs the skyline search on the
// time-reversed problem (lower' = T - upper, upper' = T - lower: the same packings,
// offset for offset) until the common deadline. The skyline search's canonical form
// is directional (it fills the leftmost open section, from buffers starting there),
// so the two directions fail on different instances: of thirty 450-buffer tight cuts,
// one takes the forward search over 30 s and the reversed 0.7 s, another the reverse.
// Returns (status, offsets, nodes, backtracks, engine): engine 0 the skyline search,
// 1 the offset-order search, 2 the skyline search on the reversed problem, -1 none.
std::tuple<int, std::vector<int64_t>, int64_t, int64_t, int> solve_portfolio(
    const std::vector<int64_t>& lower, const std::vector<int64_t>& upper,
    const std::vector<int64_t>& nbytes, const std::vector<int64_t>& align, int64_t capacity,
    double time_limit_s, const std::vector<std::string>& skyline_orders,
    const std::vector<std::string>& offset_orders, int64_t max_nodes, StopToken* token,
    double offset_order_time_limit_s, bool mirrored) {
  int status[3] = {kTimeout, kTimeout, kTimeout};
  std::vector<int64_t> offsets;
  int64_t nodes = 0, backtracks = 0;
  int engine = -1;
  {
    pybind11::gil_scoped_release release;
    std::atomic<bool> stop(false);
    Search skyline(lower, upper, nbytes, align, capacity, time_limit_s, max_nodes);
    OffsetOrderSearch offset_order(lower, upper, nbytes, align, capacity,
                                   std::min(time_limit_s, offset_order_time_limit_s), max_nodes);
    const int64_t end = upper.empty() ? 0 : *std::max_element(upper.begin(), upper.end());
    std::vector<int64_t> mirror_lower(upper.size()), mirror_upper(lower.size());
    for (size_t b = 0; b < upper.size(); ++b) {
      mirror_lower[b] = end - upper[b];
      mirror_upper[b] = end - lower[b];
    }
    Search mirror(mirror_lower, mirror_upper, nbytes, align, capacity, time_limit_s, max_nodes);
    skyline.stop_ = &stop;
    offset_order.stop_ = &stop;
    mirror.stop_ = &stop;
    if (token != nullptr) skyline.cancel_ = offset_order.cancel_ = mirror.cancel_ = &token->flag;
    std::thread partner([&] {
      status[1] = offset_order.solve(offset_orders);
      if (status[1] == kFound || status[1] == kNotFound) {
        stop.store(true);
        return;
      }
      if (!mirrored || stop.load() || (token != nullptr && token->flag.load())) return;
      status[2] = mirror.solve(skyline_orders);
      if (status[2] == kFound || status[2] == kNotFound) stop.store(true);
    });
    status[0] = skyline.solve(skyline_orders);
    if (status[0] == kFound || status[0] == kNotFound) stop.store(true);
    partner.join();
    for (int e = 0; e < 3 && engine < 0; ++e)
      if (status[e] == kFound || status[e] == kNotFound) engine = e;
    nodes = skyline.nodes() + offset_order.nodes() + mirror.nodes();
    backtracks = skyline.backtracks() + offset_order.backtracks() + mirror.backtracks();
    if (engine == 0 && status[0] == kFound) offsets = skyline.offsets();
    if (engine == 1 && status[1] == kFound) offsets = offset_order.offsets();
    if (engine == 2 && status[2] == kFound) offsets = mirror.offsets();
  }
  return std::make_tuple(engine >= 0 ? status[engine] : kTimeout, offsets, nodes, backtracks, engine);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "memplan's exact offset search (the skyline search of exact.py) in C++";
  m.def("solve", &run_search<Search>, "(status, offsets, nodes, backtracks) for one capacity");
  m.def("solve_offset_order", &run_search<OffsetOrderSearch>,
        "minimalloc's offset-order search: (status, offsets, nodes, backtracks) for one capacity");
  pybind11::class_<StopToken>(m, "StopToken")
      .def(pybind11::init<>())
      .def("set", &StopToken::set, "stop the portfolio this token was given to");
  m.def("solve_portfolio", &solve_portfolio,
        "both searches in two threads: (status, offsets, nodes, backtracks, engine); a StopToken "
        "(or None) stops them when set; the last argument: the offset-order search's thread then "
        "runs the skyline search on the time-reversed problem");
}
