"""The Transformers docs' "Efficient Training on a Single GPU" script (v4.16-v4.25,
docs/source/en/perf_train_gpu_one.mdx at huggingface/transformers@0016acf7ef42): bert-large
sequence classification fine-tuned by `Trainer` on the page's dummy data, one experiment
per process as the page asks ("restart the Python kernel between experiments").

python hf_trainer_bert.py --model DIR --output_dir DIR [--batch N] [--grad_accum N]
    [--gradient_checkpointing] [--fp16] [--optim adafactor] [--adam8bit]

The flags are the page's `TrainingArguments` of each experiment; `--adam8bit` builds the
page's `bnb.optim.Adam8bit` over its two parameter groups and passes it to the Trainer.
"""

import argparse

import numpy as np
from datasets import Dataset
from torch import nn
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments, logging
from transformers.trainer_pt_utils import get_parameter_names


def dummy_dataset(seq_len=512, dataset_size=512):
    """The page's data: random token ids in [100, 30000) and binary labels."""
    dummy_data = {
        "input_ids": np.random.randint(100, 30000, (dataset_size, seq_len)),
        "labels": np.random.randint(0, 1, (dataset_size)),
    }
    ds = Dataset.from_dict(dummy_data)
    ds.set_format("pt")
    return ds


def adam8bit(model, training_args):
    """The page's 8-bit Adam: weight decay on every weight but biases and LayerNorms."""
    import bitsandbytes as bnb

    decay_parameters = get_parameter_names(model, [nn.LayerNorm])
    decay_parameters = [name for name in decay_parameters if "bias" not in name]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if n in decay_parameters],
         "weight_decay": training_args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n not in decay_parameters],
         "weight_decay": 0.0},
    ]
    return bnb.optim.Adam8bit(optimizer_grouped_parameters, betas=(training_args.adam_beta1, training_args.adam_beta2),
                              eps=training_args.adam_epsilon, lr=training_args.learning_rate)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a bert-large-uncased folder (config.json, model.safetensors)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--optim", default=None, help="TrainingArguments.optim (the page: adafactor)")
    parser.add_argument("--adam8bit", action="store_true", help="the page's bnb.optim.Adam8bit")
    flags = parser.parse_args()

    ds = dummy_dataset()
    model = AutoModelForSequenceClassification.from_pretrained(flags.model).to("cuda")
    # the page's default_args, less "evaluation_strategy": "steps": with no eval_dataset,
    # today's Trainer refuses it (the 2022 Trainer never reached an evaluation step)
    default_args = {"output_dir": flags.output_dir, "num_train_epochs": 1, "log_level": "error", "report_to": "none"}
    logging.set_verbosity_error()
    optional = {"optim": flags.optim} if flags.optim else {}
    training_args = TrainingArguments(per_device_train_batch_size=flags.batch,
                                      gradient_accumulation_steps=flags.grad_accum,
                                      gradient_checkpointing=flags.gradient_checkpointing, fp16=flags.fp16,
                                      **optional, **default_args)
    optimizers = (adam8bit(model, training_args), None) if flags.adam8bit else (None, None)
    trainer = Trainer(model=model, args=training_args, train_dataset=ds, optimizers=optimizers)
    result = trainer.train()
    print(f"Time: {result.metrics['train_runtime']:.2f}")


if __name__ == "__main__":
    main()
