"""The three 32x32 models of the CIFAR-10 recipe: a small CNN (the Keras ``cifar10_cnn`` example),
an AlexNet scaled to 32x32 inputs and the usual CIFAR variant of ResNet-18, as used for CIFAR-10
in the parameter-server experiments this project reproduces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override


class SmallCNN(nn.Module):
    """The "CNN" of the CIFAR-10 experiments: the Keras ``cifar10_cnn`` example (1,250,858 parameters).

    Two blocks of two 3x3 convolutions with max-pooling and dropout, then a 512-unit dense layer,
    which holds most of the parameters, as the Keras ``mnist_cnn`` of the MNIST recipe does.

    Args:
        num_classes: the logits of the last layer.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.25),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.25),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 6 * 6, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, num_classes),
        )

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class AlexNetCifar(nn.Module):
    """AlexNet scaled to 32x32 inputs (23,272,266 parameters).

    AlexNet's five convolutions (64-192-384-256-256 channels) with a 3x3 stride-2 stem instead of the
    11x11 stride-4 one, and its two 4096-unit dense layers on the 256x2x2 feature map, the variant
    commonly used for CIFAR-10 in distributed-SGD work. The dense layers make it communication-heavy.

    Args:
        num_classes: the logits of the last layer.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),  # 16 -> 8
            nn.Conv2d(64, 192, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),  # 8 -> 4
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),  # 4 -> 2
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.5), nn.Linear(256 * 2 * 2, 4096), nn.ReLU(inplace=True),
            nn.Dropout(0.5), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    """ResNet's two-3x3-convolution residual block, with a 1x1 projection when the shape changes.

    Args:
        in_planes: the input's channels.
        planes: the output's channels.
        stride: the first convolution's stride (2 halves the height and width).
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    @override
    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18Cifar(nn.Module):
    """ResNet-18 for 32x32 inputs (11,173,962 parameters): a 3x3 stride-1 stem and no max-pool.

    The standard CIFAR variant (as in He et al.'s CIFAR experiments and the common PyTorch
    reference): four stages of two BasicBlocks, 64-128-256-512 channels, global average pool.

    Args:
        num_classes: the logits of the last layer.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers: list[nn.Module] = []
        in_planes = 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1)]
            in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.linear = nn.Linear(512, num_classes)

    @override
    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.pool(self.layers(out))
        return self.linear(torch.flatten(out, 1))


ARCHS: dict[str, Callable[[], nn.Module]] = {"cnn": SmallCNN, "alexnet": AlexNetCifar, "resnet18": ResNet18Cifar}


def build_model(arch: str) -> nn.Module:
    """A fresh network for ``arch`` ("cnn", "alexnet" or "resnet18"), mapping [B, 3, 32, 32] to logits [B, 10].

    Args:
        arch: the network's name, a key of :data:`ARCHS`.

    Raises:
        ValueError: where ``arch`` is not one of :data:`ARCHS`.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(map(repr, ARCHS))}, got {arch!r}")
    return ARCHS[arch]()
