"""A plain PyTorch training loop on character-level data: a small GPT-style model built in
the script, moved to the device, trained with AdamW, its loss logged with `loss.item()`.

python plain_loop.py --data FILE [--steps N] [--batch B] [--block T] [--checkpoint]
                     [--optimizer-in-backward] [--compile] [--layers L] [--swiglu]
                     [--save DIR]

With --save, each step appends a line to DIR/log.txt and the first saves DIR/ckpt.pt.
With --optimizer-in-backward, each parameter has its own AdamW, stepped in the parameter's
post-accumulate-grad hook (PyTorch's tutorial "How to save memory by fusing the optimizer
step into the backward pass"): `loss.backward()` is the whole update.
With --swiglu, each block's MLP is Llama's. With --compile, each block is compiled in place (`module.compile()`, torch.compile with
Inductor), as torchtitan and torchtune compile their transformer blocks.
"""

import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class SwiGLU(nn.Module):
    """Llama's MLP, `w2(silu(w1(x)) * w3(x))`."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, swiglu=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = SwiGLU(dim, 4 * dim) if swiglu else nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab, dim=64, heads=4, layers=2, block=32, use_checkpoint=False, swiglu=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, swiglu) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.use_checkpoint = use_checkpoint

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.use_checkpoint else block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--optimizer-in-backward", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--swiglu", action="store_true")
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    text = open(args.data).read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = GPT(len(chars), layers=args.layers, block=args.block, use_checkpoint=args.checkpoint,
                swiglu=args.swiglu).to(device)
    if args.compile:
        for block in model.blocks:
            block.compile()
    if args.optimizer_in_backward:
        optimizers = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}

        def step_in_backward(p):
            optimizers[p].step()
            optimizers[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_in_backward)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        starts = torch.randint(len(data) - args.block - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.block] for s in starts]).to(device)
        y = torch.stack([data[s + 1:s + 1 + args.block] for s in starts]).to(device)
        loss = model(x, y)
        loss.backward()
        if not args.optimizer_in_backward:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.4f} ppl {math.exp(loss.item()):.1f}")
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            with open(os.path.join(args.save, "log.txt"), "a") as log:
                log.write(f"{step} {loss.item():.4f}\n")
            if step == 0:
                torch.save(model.state_dict(), os.path.join(args.save, "ckpt.pt"))


if __name__ == "__main__":
    main()
