"""A Lightning `Trainer` script: the GPT of plain_loop.py in a `LightningModule`, character
windows of a text file in a `DataLoader`, the accelerator, devices, precision and steps from
the command line.

python lightning_loop.py --data FILE [--accelerator auto|cpu|gpu] [--devices N] [--precision P] [--max-steps N]
"""

import argparse

import lightning as L
import torch
from plain_loop import GPT
from torch.utils.data import DataLoader, Dataset


class Windows(Dataset):
    def __init__(self, path, block):
        text = open(path).read()
        self.chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
        self.block = block

    def __len__(self):
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i):
        chunk = self.data[i * self.block:(i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


class CharGPT(L.LightningModule):
    def __init__(self, vocab, block):
        super().__init__()
        self.model = GPT(vocab, block=block)

    def training_step(self, batch, _index):
        x, y = batch
        loss = self.model(x, y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = Windows(args.data, args.block)
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    trainer = L.Trainer(accelerator=args.accelerator, devices=devices, precision=args.precision,
                        max_steps=args.max_steps, logger=False, enable_checkpointing=False)
    trainer.fit(CharGPT(len(data.chars), args.block), DataLoader(data, batch_size=args.batch, shuffle=True))


if __name__ == "__main__":
    main()
