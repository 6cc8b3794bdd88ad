"""A program that fails on its own after building its model."""

import torch

model = torch.nn.Linear(8, 8)
raise ValueError("no data found in ./data: give --data")
