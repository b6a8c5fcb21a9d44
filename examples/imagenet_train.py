"""An ImageNet-style training script, shaped like pytorch/examples' ``imagenet/main.py``, run
unchanged on worker threads::

    python examples/imagenet_train.py --dummy -j 4 --steps 50                   # torch's DataLoader
    python -m threadloader run examples/imagenet_train.py --dummy -j 4 --steps 50  # worker threads

Nothing here mentions threadloader: ``python -m threadloader run`` makes the ``DataLoader`` below
a ``ThreadDataLoader``. With ``--seed`` the two commands print the same losses, step for step:
the same shuffled order, and the same random crops and flips, because each worker thread has its
own global torch RNG seeded as torch seeds a worker process (``tests/test_examples_imagenet.py``
checks it).

As in the original: argparse options, ``-j`` workers, a shuffling ``DataLoader`` over a
``--dummy`` dataset of synthetic images (here generated, as ``torchvision.datasets.FakeData``
does), ``RandomResizedCrop`` / ``RandomHorizontalFlip`` / ``Normalize`` transforms drawing from
the global torch RNG (written here: torchvision is not a dependency), SGD with momentum, and
``AverageMeter`` progress lines, the model and batches on CUDA when there is one
(``python -m threadloader run --device cuda ...`` then delivers the batches there already). The
model is a small ResNet-like net so that a CPU runs it.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

Transform = Callable[[torch.Tensor], torch.Tensor]


class FakeImages(Dataset[tuple[torch.Tensor, int]]):
    """Like torchvision's ``FakeData``: image i is random uint8 pixels from a generator seeded by
    i (the same image every time it is read), with a random label."""

    def __init__(self, size: int, image_size: tuple[int, int, int], classes: int, t: Transform):
        self.size, self.image_size, self.classes, self.transform = size, image_size, classes, t

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(index)
        image = torch.randint(0, 256, self.image_size, dtype=torch.uint8, generator=g)
        target = int(torch.randint(0, self.classes, (), generator=g))
        return self.transform(image), target


class RandomResizedCrop:
    """torchvision's ``RandomResizedCrop``: a random area and aspect ratio, resized (bilinear)."""

    def __init__(self, size: int, scale: tuple[float, float] = (0.08, 1.0)) -> None:
        self.size, self.scale, self.ratio = size, scale, (3 / 4, 4 / 3)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        _, height, width = image.shape
        area = height * width
        log_ratio = torch.log(torch.tensor(self.ratio))
        for _ in range(10):
            target = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,)).item())
                left = int(torch.randint(0, width - w + 1, size=(1,)).item())
                break
        else:  # the central crop
            h, w = height, width
            top, left = 0, 0
        crop = image[:, top : top + h, left : left + w].float().unsqueeze(0)
        out = F.interpolate(crop, size=(self.size, self.size), mode="bilinear", antialias=True)
        return out.squeeze(0)


class RandomHorizontalFlip:
    """torchvision's ``RandomHorizontalFlip(p=0.5)``."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.flip(-1) if torch.rand(1) < 0.5 else image


class ToTensorNormalize:
    """``ToTensor()`` then ``Normalize`` with ImageNet's mean and std."""

    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image / 255.0 - self.mean) / self.std


class Compose:
    def __init__(self, transforms: list[Transform]) -> None:
        self.transforms = transforms

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        for t in self.transforms:
            image = t(image)
        return image


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.down(x))


class TinyResNet(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16))
        self.layers = nn.Sequential(Block(16, 32, 2), Block(32, 64, 2))
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(F.relu(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class AverageMeter:
    """Computes and stores the average and current value (as in the original)."""

    def __init__(self, name: str, fmt: str = ":f") -> None:
        self.name, self.fmt = name, fmt
        self.val = self.avg = self.sum = 0.0
        self.count = 0

    def update(self, val: float, n: int = 1) -> None:
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self) -> str:
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)


def parse_args(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description="ImageNet-style training (synthetic images)")
    parser.add_argument("--dummy", action="store_true", help="use fake data (the only data here)")
    parser.add_argument("-j", "--workers", default=4, type=int, help="data loading workers")
    parser.add_argument("--epochs", default=1, type=int, help="number of total epochs to run")
    parser.add_argument("-b", "--batch-size", default=16, type=int, help="mini-batch size")
    parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, dest="lr")
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("-p", "--print-freq", default=10, type=int, help="print frequency")
    parser.add_argument("--seed", default=None, type=int, help="seed for initializing training")
    parser.add_argument("--steps", default=None, type=int, help="stop after this many steps")
    parser.add_argument("--images", default=512, type=int, help="synthetic training images")
    parser.add_argument("--image-size", default=40, type=int, help="synthetic image side")
    parser.add_argument("--crop", default=32, type=int, help="RandomResizedCrop size")
    parser.add_argument("--classes", default=10, type=int)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        torch.backends.cudnn.deterministic = True  # as the original (CPU kernels here are)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = TinyResNet(args.classes).to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    train_dataset = FakeImages(
        args.images,
        (3, args.image_size, args.image_size),
        args.classes,
        Compose([RandomResizedCrop(args.crop), RandomHorizontalFlip(), ToTensorNormalize()]),
    )
    train_loader = DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=torch.cuda.is_available(),
    )
    step = 0
    for epoch in range(args.epochs):
        step = train(train_loader, model, criterion, optimizer, epoch, device, args, step)
        if args.steps is not None and step >= args.steps:
            break


def train(
    loader: DataLoader[Any],
    model: nn.Module,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    epoch: int,
    device: torch.device,
    args: Any,
    step: int,
) -> int:
    batch_time, data_time, losses = (
        AverageMeter("Time", ":6.3f"),
        AverageMeter("Data"),
        AverageMeter("Loss", ":.4e"),
    )
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(loader):
        data_time.update(time.time() - end)
        # A no-op for batches already there (python -m threadloader run --device cuda).
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.update(loss.item(), images.size(0))
        batch_time.update(time.time() - end)
        end = time.time()
        step += 1
        print(f"step {step} loss {loss.item()!r}")  # every digit: runs compare exactly
        if i % args.print_freq == 0:
            print(f"Epoch: [{epoch}][{i}/{len(loader)}]\t{batch_time}\t{data_time}\t{losses}")
        if args.steps is not None and step >= args.steps:
            break
    return step


if __name__ == "__main__":
    main()
