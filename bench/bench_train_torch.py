"""PyTorch side of bench_train: the same training step (forward, backward,
SGD momentum 0.9, weight decay 1e-4) on the same model, batch, input size and
thread count, channels-last, synthetic data. Prints "samples_per_second
peak_rss_mib". Not a project dependency: bench_train calls it when torch is
importable.
"""
import argparse
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class SmallCNN(nn.Module):
    """models/small.h SmallCNN: conv-bn-relu-pool x2, fc 3136-128, dropout, fc 128-10."""

    def __init__(self, channels, classes, size):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc1 = nn.Linear(64 * (size // 4) ** 2, 128)
        self.fc2 = nn.Linear(128, classes)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = torch.flatten(x, 1)
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.model == "small_cnn":
        model = SmallCNN(a.channels, a.classes, a.size)
    else:
        import torchvision
        model = getattr(torchvision.models, a.model)(num_classes=a.classes)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(a.batch, a.channels, a.size, a.size).to(memory_format=torch.channels_last)
    y = torch.full((a.batch,), 3, dtype=torch.long)
    times = []
    for i in range(a.steps + 2):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    sps = a.batch / statistics.median(times)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(f"{sps:.3f} {peak:.1f}")


if __name__ == "__main__":
    main()
