"""A plain PyTorch loop trained with torchao's low-bit AdamW (`torchao.optim.AdamW8bit` or
`AdamW4bit`): each optimizer state of 4096 values or more is a tensor subclass of 8- or 4-bit
codes, block scales and a lookup table (torchao/optim/subclass_8bit.py, subclass_4bit.py),
updated by a `torch.compile`d step (torchao/optim/adam.py, `single_param_adam`).

python lowbit_adam_loop.py --data FILE [--bits 8|4] [--steps N] [--eager]

Every parameter is 64 x 64 (4096 values, quantized in both widths), so the compiled step
has one signature: the real run compiles it once. With --eager the program runs its
compiled functions as their eager ops (`torch.compiler.set_stance("force_eager")`).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--bits", type=int, choices=[8, 4], default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    if args.eager:
        torch.compiler.set_stance("force_eager")

    import torchao.optim

    data = torch.tensor(list(open(args.data, "rb").read()), dtype=torch.long) % 64
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 64, bias=False), nn.GELU(),
                          nn.Linear(64, 64, bias=False)).to(device)
    optimizer_class = torchao.optim.AdamW8bit if args.bits == 8 else torchao.optim.AdamW4bit
    optimizer = optimizer_class(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        starts = torch.randint(len(data) - 33, (8,), generator=gen)
        x = torch.stack([data[s:s + 32] for s in starts]).to(device)
        y = torch.stack([data[s + 1:s + 33] for s in starts]).to(device)
        loss = F.cross_entropy(model(x).view(-1, 64), y.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
