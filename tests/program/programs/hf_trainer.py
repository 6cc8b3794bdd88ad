"""A Hugging Face `Trainer` script: a model from a local folder, a tiny character-level
dataset built from a text file, `TrainingArguments` from the command line.

python hf_trainer.py --model DIR --data FILE --output_dir DIR [TrainingArguments flags...]
"""

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments


@dataclass
class Data:
    model: str = field(metadata={"help": "a folder save_pretrained wrote"})
    data: str = field(metadata={"help": "a text file"})
    seq: int = 32


class CharDataset(torch.utils.data.Dataset):
    def __init__(self, path, vocab, seq):
        text = open(path).read()
        self.tokens = [ord(c) % vocab for c in text]
        self.seq = seq

    def __len__(self):
        return len(self.tokens) // self.seq

    def __getitem__(self, i):
        ids = torch.tensor(self.tokens[i * self.seq:(i + 1) * self.seq])
        return {"input_ids": ids, "labels": ids.clone()}


def main():
    data, args = HfArgumentParser((Data, TrainingArguments)).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(data.model, dtype=torch.float32)
    dataset = CharDataset(data.data, model.config.vocab_size, data.seq)
    Trainer(model=model, args=args, train_dataset=dataset).train()


if __name__ == "__main__":
    main()
