"""Convolutional models for the memory tests (torchvision does not import with the CPU
build of torch the tests run on): a ResNet-18 and a small batch-norm CNN, both with
in-place ReLUs, each returning ``{"loss": ...}``."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm, a projected shortcut
    when the shape changes, in-place ReLUs."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` layout, with a cross-entropy loss on ``labels``."""

    def __init__(self, num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        # one layer at a time, as torchvision does: a local holding an earlier output
        # would keep it alive past its last use, where no profile can see it
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        logits = self.fc(torch.flatten(self.avgpool(x), 1))
        return {"loss": nn.functional.cross_entropy(logits, labels)}


class SmallCNN(nn.Module):
    """Conv / batch-norm / in-place ReLU layers, a max pool, then a wide 3x3 convolution at
    8x8 whose weight gradient (2.25 MiB) outweighs any activation: it is model state, not
    activation memory."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        shapes = [(3, 16, 1), (16, 16, 1), (16, 16, 1), "pool", (16, 32, 1), (32, 32, 1),
                  (32, 256, 2), (256, 256, 1)]
        for shape in shapes:
            if shape == "pool":
                layers.append(nn.MaxPool2d(2))
                continue
            cin, cout, stride = shape
            layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                       nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.features(x).mean((2, 3)))
        return {"loss": nn.functional.cross_entropy(logits, labels)}


def resnet18(batch: int = 2, size: int = 224) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    x = torch.randn(batch, 3, size, size)
    return ResNet18().train(), (x, torch.randint(0, 1000, (batch,)))


def small_cnn(batch: int = 4, size: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    x = torch.randn(batch, 3, size, size)
    return SmallCNN().train(), (x, torch.randint(0, 10, (batch,)))
