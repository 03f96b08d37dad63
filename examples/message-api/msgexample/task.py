"""msgexample: the project's own model, data, training and evaluation (nothing of flowerdro here)."""

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

NUM_FEATURES, NUM_CLASSES = 16, 4


class Net(nn.Module):
    """A small MLP."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(NUM_FEATURES, 32)
        self.fc2 = nn.Linear(32, NUM_CLASSES)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(partition_id: int, num_partitions: int, batch_size: int = 32):
    """Synthetic, heterogeneous partitions: each client sees shifted clusters and its own class mix."""
    rng = np.random.default_rng(1000 + partition_id)
    centers = np.random.default_rng(0).normal(size=(NUM_CLASSES, NUM_FEATURES)) * 2.0
    shift = rng.normal(size=NUM_FEATURES) * 0.5
    mix = rng.dirichlet(np.full(NUM_CLASSES, 0.7))
    labels = rng.choice(NUM_CLASSES, size=150, p=mix)
    x = (centers[labels] + shift + rng.normal(size=(150, NUM_FEATURES))).astype(np.float32)
    x, y = torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64))
    trainloader = DataLoader(TensorDataset(x[:120], y[:120]), batch_size=batch_size, shuffle=True)
    testloader = DataLoader(TensorDataset(x[120:], y[120:]), batch_size=batch_size)
    return trainloader, testloader


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(int(epochs)):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (int(epochs) * len(trainloader))


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(device))
            loss += criterion(outputs, labels.to(device)).item()
            correct += (torch.max(outputs.data, 1)[1] == labels.to(device)).sum().item()
    return loss / len(testloader), correct / len(testloader.dataset)
