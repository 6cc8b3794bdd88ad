"""Exact offset solver on hard generated instances whose optimum is known by construction.

Each instance is a full rectangle (1000 time steps x 1 GiB in 1 KiB quanta) cut into n
buffers by random guillotine cuts, then shuffled: capacity = lower bound = optimum,
zero slack anywhere. `memplan.pack` must prove that optimum within the time limit;
greedy-by-size best fit's height is reported beside it. With `--minimalloc-dir`, also
every `*.csv` under that folder (google/minimalloc's `benchmarks/`: not shipped with
memplan), minimised the same way. Writes the `layout_exact` table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_layout_exact.py [--sizes 150,300,450] [--seeds 10]
        [--held-out N] [--minimalloc-dir DIR] [--no-write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402
from memplan.layout import cpsat, native, pack  # noqa: E402
from memplan.layout.exact import CPSAT_MIN_CORES, usable_cores  # noqa: E402
from memplan.layout.generate import tight_instance  # noqa: E402
from memplan.layout.minimalloc_csv import read_csv  # noqa: E402

BENCH = "layout_exact"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="150,200,250,300,350,400,450")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--minimalloc-dir", type=Path, default=None)
    parser.add_argument("--time-limit", type=float, default=5.0)
    parser.add_argument("--held-out", type=int, default=0, metavar="N",
                        help="also the largest size's next N seeds (after --seeds), as a row of their own: "
                             "seeds no tuning looked at")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    # Build / load the compiled search once, outside the timed runs (a first build
    # takes about 20 s, a cached load about 1.5 s).
    reversed_run = ("the offset-order search stops after 20% of each attempt's time and its thread "
                    "runs the skyline search on the time-reversed problem")
    if not native.available():
        engine = "python"
    elif cpsat.available() and usable_cores() >= CPSAT_MIN_CORES:
        engine = ("portfolio (the compiled skyline and offset-order searches and OR-Tools CP-SAT, one "
                  f"thread each; {reversed_run})")
    else:
        engine = (f"portfolio (the compiled skyline and offset-order searches, one thread each; {reversed_run}; "
                  f"CP-SAT left out with {usable_cores()} cores)")
    rows = []
    answered: dict[str, int] = {}
    sizes = [int(x) for x in args.sizes.split(",")]
    groups = [(n, str(n), range(args.seeds)) for n in sizes]
    if args.held_out > 0:
        held = range(args.seeds, args.seeds + args.held_out)
        groups.append((max(sizes), f"{max(sizes)} (held-out seeds {held.start}..{held.stop - 1})", held))
    for n, label, seeds in groups:
        times, proven, greedy_excess = [], 0, []
        for seed in seeds:
            problem, _ = tight_instance(n, seed=seed)
            optimum = problem.capacity
            problem.capacity = None  # minimise; the solver is not told the optimum
            solution = pack(problem, time_limit_s=args.time_limit)
            ok = solution.status == "optimal" and solution.height == optimum
            proven += ok
            if ok and seed < args.seeds:
                winner = str(solution.stats.get("engine", "")).removeprefix("portfolio: ")
                answered[winner] = answered.get(winner, 0) + 1
            times.append(solution.elapsed_s)
            greedy_excess.append(solution.stats["greedy_height"] / optimum - 1)
            print(
                f"n={n} seed={seed}: {solution.status} height {solution.height} optimum {optimum} "
                f"greedy {solution.stats['greedy_height']} {solution.elapsed_s:.2f} s "
                f"nodes {solution.stats['nodes']}",
                file=sys.stderr,
            )
        rows.append((label, len(seeds), proven, statistics.median(times), max(times), statistics.median(greedy_excess)))
    external = []
    if args.minimalloc_dir is not None:
        for path in sorted(args.minimalloc_dir.rglob("*.csv")):
            problem, _ = read_csv(path)
            problem.capacity = None
            solution = pack(problem, time_limit_s=args.time_limit)
            lower = problem.live_lower_bound()
            name = str(path.relative_to(args.minimalloc_dir))
            print(f"{name}: {solution.status} height {solution.height} lower bound {lower} "
                  f"{solution.elapsed_s:.2f} s {solution.stats.get('engine')}", file=sys.stderr)
            external.append((name, problem.num_buffers, solution, lower))
    lines = [
        f"<!-- bench:{BENCH} -->",
        "### Exact offset solver on tight generated instances",
        "",
        f"Command: `.venv/bin/python benchmarks/bench_layout_exact.py --sizes {args.sizes} "
        f"--seeds {args.seeds}" + (f" --held-out {args.held_out}" if args.held_out > 0 else "")
        + f" --time-limit {args.time_limit:g}`",
        "",
        "Each instance: a 1000-step x 1 GiB rectangle cut by random guillotine cuts into n buffers "
        "(sizes multiples of 1 KiB), shuffled; its optimum is the rectangle's height and equals the "
        "live lower bound (zero slack). `memplan.pack` minimises without being told the optimum; "
        f"time limit {args.time_limit:g} s per instance on this 2-core machine, {engine} search engine "
        f"(loaded before the timed runs). Seeds 0..{args.seeds - 1}; proven by: "
        + ", ".join(f"{k} search {v}" for k, v in sorted(answered.items())) + "."
        + (f" The last row: {args.held_out} more seeds of the largest size, which no choice of the "
           "search was tuned on." if args.held_out > 0 else ""),
        "",
        "| buffers | instances | optimum proven | median time (s) | max time (s) | greedy height over optimum (median) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n, count, proven, median_s, max_s, excess in rows:
        lines.append(f"| {n} | {count} | {proven}/{count} | {median_s:.2f} | {max_s:.2f} | +{excess:.1%} |")
    if external:
        lines += [
            "",
            "google/minimalloc's benchmark instances (not shipped; `--minimalloc-dir`), minimised the same way "
            "(minimalloc reports 0.6-4.9 s per challenging instance on a 2-core machine):",
            "",
            "| instance | buffers | lower bound | memplan height | optimal | time (s) | proven by |",
            "|---|---:|---:|---:|---|---:|---|",
        ]
        for name, count, solution, lower in external:
            lines.append(
                f"| {name} | {count} | {lower:,} | {solution.height:,} | {'yes' if solution.status == 'optimal' else 'no'} "
                f"| {solution.elapsed_s:.2f} | {str(solution.stats.get('engine', '')).removeprefix('portfolio: ')} |"
            )
    lines.append(f"<!-- /bench:{BENCH} -->")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        write_section(BENCH, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
