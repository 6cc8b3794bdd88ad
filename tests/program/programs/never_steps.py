"""A program that calls its model but never takes an optimizer step."""

import time

import torch

model = torch.nn.Linear(8, 8)
while True:
    model(torch.ones(2, 8))
    time.sleep(0.05)
