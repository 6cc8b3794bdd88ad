"""A plain loop over a Hugging Face model loaded with `from_pretrained` from a local folder
(its bf16 weights trained in fp32), on character-level data (each character's code point
modulo the vocabulary is its token).

python hf_pretrained.py --model DIR --data FILE [--steps N] [--batch B] [--seq T] [--autocast]
"""

import argparse
import contextlib

import torch
from transformers import AutoModelForCausalLM


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--autocast", action="store_true")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    model.train()
    vocab = model.config.vocab_size
    tokens = torch.tensor([ord(c) % vocab for c in open(args.data).read()])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    window = args.batch * args.seq
    for step in range(args.steps):
        start = (step * window) % (len(tokens) - window)
        batch = tokens[start:start + window].view(args.batch, args.seq).to(device)
        precision = torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()
        with precision:
            out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {out.loss.item():.4f}, "
              f"allocated {torch.cuda.memory_allocated() if device.type == 'cuda' else 0}")


if __name__ == "__main__":
    main()
