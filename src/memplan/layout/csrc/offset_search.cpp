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
//     bytes must fit above the lowest level any unplaced buffer there can reach;
//   - dominance: identical candidates tried once;
//   - decomposition where no buffer crosses a section boundary, statically and when
//     the last buffer crossing one is placed;
//   - candidate orders tried in turn under a doubling node budget.
// exact.py stays the reference (the tests compare the two); every result of either
// is checked by memplan/layout/validate.py before it is returned.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace {

constexpr int kFound = 0, kNotFound = 1, kAborted = 2, kTimeout = 3;
constexpr int64_t kDone = std::numeric_limits<int64_t>::max();

class Search {
 public:
  Search(const std::vector<int64_t>& lower, const std::vector<int64_t>& upper,
         const std::vector<int64_t>& nbytes, const std::vector<int64_t>& align,
         int64_t capacity, double time_limit_s, int64_t max_nodes)
      : n_(static_cast<int>(nbytes.size())), size_(nbytes), align_(align), capacity_(capacity),
        max_nodes_(max_nodes) {
    deadline_ = std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(std::max(0.0, time_limit_s)));
    std::vector<int64_t> points(lower);
    points.insert(points.end(), upper.begin(), upper.end());
    std::sort(points.begin(), points.end());
    points.erase(std::unique(points.begin(), points.end()), points.end());
    num_sections_ = std::max<int>(static_cast<int>(points.size()) - 1, 0);
    s_lo_.resize(n_);
    s_hi_.resize(n_);
    covering_.assign(num_sections_, {});
    starting_.assign(num_sections_, {});
    total_.assign(num_sections_, 0);
    skyline_.assign(num_sections_, 0);
    cuts_.assign(num_sections_, 0);
    for (int b = 0; b < n_; ++b) {
      s_lo_[b] = static_cast<int>(std::lower_bound(points.begin(), points.end(), lower[b]) - points.begin());
      s_hi_[b] = static_cast<int>(std::lower_bound(points.begin(), points.end(), upper[b]) - points.begin());
      starting_[s_lo_[b]].push_back(b);
      for (int s = s_lo_[b]; s < s_hi_[b]; ++s) {
        covering_[s].push_back(b);
        total_[s] += size_[b];
      }
      for (int s = s_lo_[b]; s + 1 < s_hi_[b]; ++s) ++cuts_[s];
    }
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

  int solve_part(int s_start, int s_end, const std::vector<std::string>& heuristics) {
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
    if ((nodes_ & 255) == 0 && std::chrono::steady_clock::now() > deadline_) return kTimeout;
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
    std::vector<std::tuple<int, int, int64_t>> tried;
    for (int b : candidates) {
      const int lo = s_lo_[b], hi = s_hi_[b];
      const std::tuple<int, int, int64_t> signature{lo, hi, size_[b]};
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
  bool floors_fit(int a, int z) const {
    for (int k = a; k < z; ++k) {
      if (total_[k] <= 0) continue;
      int64_t lowest = kDone;
      for (int b : covering_[k]) lowest = std::min(lowest, rest_[b]);
      if (lowest == kDone || lowest + total_[k] > capacity_) return false;
    }
    return true;
  }

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
      if (level <= h) {
        // It would rest on an unplaced buffer of another section: at least that high.
        int64_t smallest = kDone;
        for (int o : overlaps_[b]) {
          if (o == b || placed_[o] || (s_lo_[o] <= s && s < s_hi_[o])) continue;
          smallest = std::min(smallest, size_[o]);
        }
        if (smallest == kDone) continue;
        level = h + smallest;
      }
      const int64_t a = align_[b];
      level = (level + a - 1) / a * a;
      best = std::min(best, level);
    }
    return best;
  }

  int n_;
  std::vector<int64_t> size_, align_;
  int64_t capacity_;
  std::chrono::steady_clock::time_point deadline_;
  int num_sections_ = 0;
  std::vector<int> s_lo_, s_hi_, cuts_, rank_;
  std::vector<std::vector<int>> covering_, starting_, overlaps_;
  std::vector<int64_t> total_, skyline_, rest_, offset_;
  std::vector<char> placed_;
  int64_t max_nodes_ = kDone;  // a deterministic budget: past it the search gives up as on a timeout
  int64_t node_limit_ = kDone, nodes_ = 0, backtracks_ = 0;
};

std::tuple<int, std::vector<int64_t>, int64_t, int64_t> solve(
    const std::vector<int64_t>& lower, const std::vector<int64_t>& upper,
    const std::vector<int64_t>& nbytes, const std::vector<int64_t>& align, int64_t capacity,
    double time_limit_s, const std::vector<std::string>& heuristics, int64_t max_nodes) {
  int status;
  std::vector<int64_t> offsets;
  int64_t nodes, backtracks;
  {
    pybind11::gil_scoped_release release;
    Search search(lower, upper, nbytes, align, capacity, time_limit_s, max_nodes);
    status = search.solve(heuristics);
    if (status == kFound) offsets = search.offsets();
    nodes = search.nodes();
    backtracks = search.backtracks();
  }
  return std::make_tuple(status, offsets, nodes, backtracks);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "memplan's exact offset search (the skyline search of exact.py) in C++";
  m.def("solve", &solve, "(status, offsets, nodes, backtracks) for one capacity");
}
