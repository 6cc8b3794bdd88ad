"""A DeepSpeed program: a causal LM built from a local config (`AutoConfig.from_pretrained(DIR)`,
random weights, fp32), wrapped by `deepspeed.initialize` with the JSON config `--deepspeed_config`
names and a client `torch.optim.AdamW` (foreach), trained on character-level data.

deepspeed --num_gpus N deepspeed_loop.py --model DIR --data FILE --deepspeed_config ds.json [--zero-init]
torchrun --nproc-per-node N deepspeed_loop.py --model DIR --data FILE --deepspeed_config ds.json
"""

import argparse
import contextlib
import json
import os

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--zero-init", action="store_true", help="build the model under deepspeed.zero.Init")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    model_config = AutoConfig.from_pretrained(args.model)
    torch.manual_seed(0)
    building = deepspeed.zero.Init(config_dict_or_path=config) if args.zero_init else contextlib.nullcontext()
    with building:
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    text = open(args.data).read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) % model_config.vocab_size for c in text])
    batch = config["train_micro_batch_size_per_gpu"]
    gen = torch.Generator().manual_seed(engine.global_rank)
    for step in range(args.steps):
        starts = torch.randint(len(data) - args.seq, (batch,), generator=gen)
        ids = torch.stack([data[s:s + args.seq] for s in starts]).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
