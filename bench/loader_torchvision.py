#!/usr/bin/env python3
"""torchvision's ImageNet training pipeline on one thread, for bench_loader.

Reads an ImageFolder (the JPEGs bench_loader generated) with torchvision's
PIL loader and RandomResizedCrop(224) -> RandomHorizontalFlip -> ToTensor ->
Normalize, one sample at a time in this process (what one DataLoader worker
does), and prints images/s (wall) and images per CPU second (the figure that holds on
a shared machine). Without torchvision, the same steps in Pillow +
NumPy. Comparison only: the trainer does not depend on Python.

    python3 bench/loader_torchvision.py /tmp/bench_loader_jpegs [--epochs 2]
"""
import argparse
import math
import os
import random
import time

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def torchvision_pipeline(root):
    import torchvision  # first: without it, fail before the slow import of torch
    import torch
    from torchvision import datasets, transforms

    torch.set_num_threads(1)
    t = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    ds = datasets.ImageFolder(root, transform=t)
    return f"torchvision {torchvision.__version__} (PIL)", len(ds), lambda i: ds[i]


def pillow_pipeline(root):
    """torchvision's steps written out with Pillow and NumPy."""
    import numpy as np
    import PIL
    from PIL import Image

    files = []
    for cls in sorted(os.listdir(root)):
        for name in sorted(os.listdir(os.path.join(root, cls))):
            files.append(os.path.join(root, cls, name))
    mean = np.array(MEAN, dtype=np.float32)
    std = np.array(STD, dtype=np.float32)

    def crop_box(width, height):
        area = width * height
        for _ in range(10):
            target = area * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            w = int(round(math.sqrt(target * ratio)))
            h = int(round(math.sqrt(target / ratio)))
            if 0 < w <= width and 0 < h <= height:
                y = random.randint(0, height - h)
                x = random.randint(0, width - w)
                return x, y, w, h
        return 0, 0, width, height

    def sample(i):
        with open(files[i], "rb") as f:
            img = Image.open(f).convert("RGB")
        x, y, w, h = crop_box(*img.size)
        img = img.crop((x, y, x + w, y + h)).resize((224, 224), Image.BILINEAR)
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return (np.asarray(img, dtype=np.float32) / 255.0 - mean) / std

    return f"Pillow {PIL.__version__} + NumPy (torchvision's steps)", len(files), sample


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--pillow", action="store_true", help="skip torchvision")
    args = parser.parse_args()
    try:
        if args.pillow:
            raise ImportError
        name, n, get = torchvision_pipeline(args.root)
    except ImportError:
        name, n, get = pillow_pipeline(args.root)
    for i in range(min(n, 16)):  # warm up
        get(i)
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(args.epochs):
        for i in range(n):
            get(i)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    images = args.epochs * n
    print(f"  {name}, 1 thread: {images / seconds:.0f} images/s wall, "
          f"{images / cpu:.0f} images per CPU second ({images} images)")


if __name__ == "__main__":
    main()
