"""A TRL `SFTTrainer` script: a model and its tokenizer from a local folder, a local JSON
dataset with a "text" field, `SFTConfig` from the command line.

python trl_sft.py --model DIR --data FOLDER --output_dir DIR [SFTConfig flags...]
"""

from dataclasses import dataclass, field

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer, TrlParser


@dataclass
class Paths:
    model: str = field(metadata={"help": "a folder with the model and its tokenizer"})
    data: str = field(metadata={"help": "a folder of JSON lines with a text field"})


def main():
    paths, args = TrlParser((Paths, SFTConfig)).parse_args_and_config()
    model = AutoModelForCausalLM.from_pretrained(paths.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(paths.model)
    dataset = load_dataset(paths.data, split="train")
    SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train()


if __name__ == "__main__":
    main()
