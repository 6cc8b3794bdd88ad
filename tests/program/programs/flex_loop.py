"""A training loop whose attention is PyTorch's flex attention, compiled as its docs say to
run it (`torch.compile(flex_attention)`), with a causal block mask.

python flex_loop.py [--steps N]
"""

import argparse

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

flex = torch.compile(flex_attention)


def causal(_b, _h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Attention(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.qkv(x).split(c, dim=2))
        return self.out(flex(q, k, v, block_mask=mask).transpose(1, 2).reshape(b, t, c))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Attention().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = create_block_mask(causal, None, None, 128, 128, device=device)
    for _ in range(args.steps):
        x = torch.randn(2, 128, 64, device=device)
        model(x, mask).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
