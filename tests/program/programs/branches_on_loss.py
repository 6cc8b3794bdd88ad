"""A loop that branches on its loss in Python (`if loss > 10`): a read memplan refuses."""

import torch

model = torch.nn.Linear(8, 8).to("cuda" if torch.cuda.is_available() else "cpu")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    x = torch.ones(4, 8, device=next(model.parameters()).device)
    loss = model(x).pow(2).mean()
    if loss > 10:
        print("diverging")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
