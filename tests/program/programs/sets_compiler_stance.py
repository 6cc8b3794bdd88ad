"""A program that sets the process's torch.compile stance, then trains a few steps."""

import torch

torch.compiler.set_stance("force_eager")
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
