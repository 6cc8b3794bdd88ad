"""PP 2 x TP 2 on 4 real gloo processes against `memplan estimate` (CPU ground truth).

A hand-rolled 1F1B schedule with real `send`/`recv` between the two stages; each stage's
modules under memplan's Llama TP plan (`apply_stage_layout`, as the trace applies it).
One warm-up step, then one profiled step per rank (torch.profiler's memory timeline);
the estimate is `estimate(..., device="cpu", allocator="none")`. Tiny configs. Writes the
`pptp_groundtruth` table of BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_pptp_gloo.py [--model llama-2-7b] [--layers 4] [--microbatches 1,2] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402
from memplan import models  # noqa: E402
from memplan.estimation import estimate  # noqa: E402
from memplan.parallel import Layout  # noqa: E402

BENCH = "pptp_groundtruth"


def rank_main(rank: int, world: int, workdir: str, fam: str, layers: int, mb: int, repeats: int) -> None:
    """One rank: its stage under the TP plan, a warm-up step, then `repeats` profiled steps."""
    import torch.distributed as dist

    from memplan.capture.groundtruth import profiler_peak_bytes
    from memplan.capture.pipeline import one_f_one_b, stage_modules
    from memplan.parallel.apply import apply_stage_layout, pipeline_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    layout = Layout(pp=2, tp=2, microbatches=mb)
    config = models.tiny_config(fam, num_hidden_layers=layers)
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32, optimizer_impl="foreach")
    mesh = pipeline_mesh(layout)
    stage = rank // 2
    torch.manual_seed(0)
    model = models.build_model(config, setup, device="cpu")
    mine, owned = stage_modules(model, 2, stage)
    ids = {id(p) for m in owned for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in ids:
            p.requires_grad_(False)
    apply_stage_layout(model, layout, "model.layers", owned, mesh)
    opt = models.build_optimizer(torch.nn.ModuleList(owned), setup, device="cpu")
    inner, vocab, hidden = model.model, config.vocab_size, config.hidden_size
    peer = rank + 2 if stage == 0 else rank - 2
    B, S = 2, 32

    def step():
        outs, ins, pending = {}, {}, []
        for op, m in one_f_one_b(2, stage, mb):
            if op == "F":
                tokens = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(m))
                if stage == 0:
                    h = inner.embed_tokens(tokens)
                else:
                    h = torch.empty(B, S, hidden)
                    dist.recv(h, peer)
                    h.requires_grad_(True)
                    ins[m] = h
                pos = torch.arange(S).unsqueeze(0).expand(B, -1)
                rope = inner.rotary_emb(h, pos)
                for blk in mine:
                    o = blk(h, attention_mask=None, position_ids=pos, position_embeddings=rope)
                    h = o[0] if isinstance(o, tuple) else o
                if stage == 0:
                    pending.append(dist.isend(h.detach(), peer))
                    outs[m] = h
                else:
                    logits = model.lm_head(inner.norm(h)).float()
                    outs[m] = torch.nn.functional.cross_entropy(logits.view(-1, vocab), tokens.view(-1))
            else:
                out = outs.pop(m)
                if stage == 1:
                    (out / mb).backward()
                    pending.append(dist.isend(ins.pop(m).grad, peer))
                else:
                    g = torch.empty_like(out)
                    dist.recv(g, peer)
                    out.backward(g)
                    del g
                del out
        for w in pending:
            w.wait()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    dist.barrier()
    peaks = []
    for _ in range(repeats):
        peaks.append(profiler_peak_bytes(step))
        dist.barrier()
    Path(workdir, f"r{rank}.json").write_text(json.dumps(peaks))
    dist.destroy_process_group()


def measure(model: str, layers: int, mb: int, attempts: int = 3) -> list[int]:
    """Each rank's profiled peak. torch's memory-profile analysis sometimes fails on a
    backward op ("duplicate outputs"); as memplan.parallel.groundtruth does, the whole
    process set is then run again fresh (no value is chosen among attempts)."""
    import torch.multiprocessing as mp

    for attempt in range(attempts):
        with tempfile.TemporaryDirectory() as wd:
            try:
                mp.spawn(rank_main, args=(4, wd, model, layers, mb, 1), nprocs=4, join=True)
            except mp.ProcessRaisedException as exc:
                print(f"attempt {attempt + 1}: profiler analysis failed ({str(exc).strip().splitlines()[-1][:80]})",
                      file=sys.stderr)
                continue
            return [json.loads(Path(wd, f"r{r}.json").read_text())[0] for r in range(4)]
    raise RuntimeError(f"the profiler's memory analysis failed in {attempts} fresh runs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", default="1,2")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    config = models.tiny_config(args.model, num_hidden_layers=args.layers)
    setup = models.TrainingSetup(precision="32-true", batch=2, seq=32, optimizer_impl="foreach")
    rows = []
    for mb in [int(x) for x in args.microbatches.split(",")]:
        real = measure(args.model, args.layers, mb)
        est = estimate(config, setup, Layout(pp=2, tp=2, microbatches=mb), device="cpu", allocator="none")
        predicted = {rank: r.peak_allocated_bytes for r in est.per_rank for rank in (r.ranks or [r.rank])}
        for rank in range(4):
            error = (predicted[rank] - real[rank]) / real[rank]
            rows.append((mb, rank, "first" if rank < 2 else "last", real[rank], predicted[rank], error))
            print(f"micro-batches {mb} rank {rank}: real {real[rank]:,} estimate {predicted[rank]:,} {error:+.3%}",
                  file=sys.stderr)
    lines = [
        f"<!-- bench:{BENCH} -->",
        "### PP 2 x TP 2: estimate vs a real gloo run, every rank",
        "",
        f"Command: `.venv/bin/python benchmarks/bench_pptp_gloo.py --model {args.model} --layers {args.layers} "
        f"--microbatches {args.microbatches}`",
        "",
        f"Tiny {args.model} ({args.layers} blocks), batch 2, seq 32, AdamW foreach, fp32; 4 gloo processes, a "
        "hand-rolled 1F1B with real send/recv, each stage under the Llama TP plan; one profiled step per rank "
        "after a warm-up step. Estimate: traced per stage on a fake process group. Error = (estimate - real) / real.",
        "",
        "| micro-batches | rank | stage | real peak (B) | estimate (B) | error |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for mb, rank, stage, real_b, est_b, error in rows:
        lines.append(f"| {mb} | {rank} | {stage} | {real_b:,} | {est_b:,} | {error:+.3%} |")
    lines.append(f"<!-- /bench:{BENCH} -->")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        write_section(BENCH, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
