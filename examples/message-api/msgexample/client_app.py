"""msgexample: a Flower / PyTorch app."""

import torch
from flowerdro.clients import ClientKit

from msgexample.task import Net, load_data
from msgexample.task import test as test_fn
from msgexample.task import train as train_fn

# flowerdro serves every message type of every strategy with our model, data and train/test
kit = ClientKit(
    model_fn=Net,
    data_fn=load_data,
    loss_fn=torch.nn.CrossEntropyLoss(),
    train_fn=lambda net, loader, a: train_fn(net, loader, a.epochs, a.lr, a.device),
    test_fn=test_fn,
)

# Flower ClientApp
app = kit.client_app()
