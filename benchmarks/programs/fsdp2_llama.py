"""A torchrun FSDP2 training script of a Hugging Face Llama built from its config, in the
style of torchtitan's: each decoder layer and the root `fully_shard`ed with bf16 parameters
and fp32 reduction, fused AdamW, random tokens.

torchrun --nproc-per-node 8 fsdp2_llama.py --config DIR [--batch B] [--seq T] [--checkpointing] [--steps N]
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="a folder with the model's config.json")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    config = AutoConfig.from_pretrained(args.config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq)).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.3f} peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
