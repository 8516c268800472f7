"""CAMPPlus (CAM++): the 192-d speaker x-vector of 16 kHz audio, S3Gen's ``speaker_encoder``.

Input: 80-bin Kaldi fbank (``kaldi_fbank.fbank``) with its per-utterance mean removed, (B, T, 80). The network:

* ``head`` (FCM): a 2-D ResNet front over (frequency, time), frequency strided by 8 in all, flattened to
  ``m_channels * 10`` channels;
* ``xvector``: a TDNN layer (kernel 5, stride 2), three densely connected blocks of CAM layers (12, 24 and 16
  layers, growth 32, kernel 3, dilations 1, 2, 2; each layer's context-aware mask mixes the utterance mean with
  100-frame segment means), each followed by a transit layer halving the channels; BatchNorm + ReLU; statistics
  pooling (mean and unbiased std over time); a dense layer to 192 with a non-affine BatchNorm.

Every BatchNorm runs on its stored running statistics (inference). State-dict names are the checkpoint's under
``speaker_encoder.`` (``speaker_encoder.xvector.block2.tdnnd7.cam_layer.linear_local.weight``,
``speaker_encoder.head.layer1.0.shortcut.1.running_var``).

Example::

    enc = CAMPPlus(CAMPPlusConfig.small()).eval()
    xvec = enc.embed(torch.randn(16000) * 0.1)        # (1, 192)
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from s3flow.model.voice.kaldi_fbank import fbank

SEGMENT_FRAMES = 100


@dataclass
class CAMPPlusConfig:
    """Sizes; ``full()`` is S3Gen's speaker encoder, ``small()`` is for tests (same strides and kernels)."""
    feat_dim: int = 80
    embedding_size: int = 192
    growth_rate: int = 32
    bn_size: int = 4
    init_channels: int = 128
    m_channels: int = 32
    block_layers: tuple = (12, 24, 16)

    @classmethod
    def full(cls) -> "CAMPPlusConfig":
        return cls()

    @classmethod
    def small(cls) -> "CAMPPlusConfig":
        return cls(growth_rate=8, init_channels=32, m_channels=8, block_layers=(2, 3, 2))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def bn_relu(channels: int, affine: bool = True, relu: bool = True) -> nn.Sequential:
    """Upstream's ``get_nonlinear('batchnorm-relu')``: named ``batchnorm`` and ``relu``."""
    layers = [("batchnorm", nn.BatchNorm1d(channels, affine=affine))]
    if relu:
        layers.append(("relu", nn.ReLU()))
    return nn.Sequential(OrderedDict(layers))


class BasicResBlock(nn.Module):
    """2-D residual block; frequency stride ``stride``, time stride 1."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=(stride, 1), bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out)) + self.shortcut(x)
        return F.relu(out)


class FCM(nn.Module):
    """(B, F, T) fbank -> (B, m_channels * F / 8, T)."""

    def __init__(self, m_channels: int = 32, feat_dim: int = 80):
        super().__init__()
        self.conv1 = nn.Conv2d(1, m_channels, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(m_channels)
        self.layer1 = nn.Sequential(BasicResBlock(m_channels, m_channels, 2), BasicResBlock(m_channels, m_channels))
        self.layer2 = nn.Sequential(BasicResBlock(m_channels, m_channels, 2), BasicResBlock(m_channels, m_channels))
        self.conv2 = nn.Conv2d(m_channels, m_channels, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(m_channels)
        self.out_channels = m_channels * (feat_dim // 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x.unsqueeze(1))))
        out = self.layer2(self.layer1(out))
        out = F.relu(self.bn2(self.conv2(out)))
        return out.reshape(out.shape[0], out.shape[1] * out.shape[2], out.shape[3])


class TDNNLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1):
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride,
                                padding=(kernel_size - 1) // 2, bias=False)
        self.nonlinear = bn_relu(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x))


class CAMLayer(nn.Module):
    """Local convolution gated by a context mask from the utterance mean plus 100-frame segment means."""

    def __init__(self, bn_channels: int, out_channels: int, kernel_size: int, dilation: int, reduction: int = 2):
        super().__init__()
        self.linear_local = nn.Conv1d(bn_channels, out_channels, kernel_size,
                                      padding=(kernel_size - 1) // 2 * dilation, dilation=dilation, bias=False)
        self.linear1 = nn.Conv1d(bn_channels, bn_channels // reduction, 1)
        self.linear2 = nn.Conv1d(bn_channels // reduction, out_channels, 1)

    @staticmethod
    def segment_means(x: torch.Tensor) -> torch.Tensor:
        """Mean of each 100-frame segment (the last one partial), repeated over its frames; (B, C, T)."""
        seg = F.avg_pool1d(x, kernel_size=SEGMENT_FRAMES, stride=SEGMENT_FRAMES, ceil_mode=True)
        return seg.repeat_interleave(SEGMENT_FRAMES, dim=-1)[..., : x.shape[-1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = x.mean(-1, keepdim=True) + self.segment_means(x)
        mask = torch.sigmoid(self.linear2(F.relu(self.linear1(context))))
        return self.linear_local(x) * mask


class CAMDenseTDNNLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, bn_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.nonlinear1 = bn_relu(in_channels)
        self.linear1 = nn.Conv1d(in_channels, bn_channels, 1, bias=False)
        self.nonlinear2 = bn_relu(bn_channels)
        self.cam_layer = CAMLayer(bn_channels, out_channels, kernel_size, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cam_layer(self.nonlinear2(self.linear1(self.nonlinear1(x))))


class CAMDenseTDNNBlock(nn.ModuleList):
    """Dense block: each layer sees the concatenation of the input and all earlier layers' outputs."""

    def __init__(self, num_layers: int, in_channels: int, growth: int, bn_channels: int, kernel_size: int,
                 dilation: int):
        super().__init__()
        for i in range(num_layers):
            self.add_module(f"tdnnd{i + 1}", CAMDenseTDNNLayer(in_channels + i * growth, growth, bn_channels,
                                                               kernel_size, dilation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = torch.cat([x, layer(x)], dim=1)
        return x


class TransitLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.nonlinear = bn_relu(in_channels)
        self.linear = nn.Conv1d(in_channels, out_channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.nonlinear(x))


class StatsPool(nn.Module):
    """(B, C, T) -> (B, 2C): mean and unbiased standard deviation over time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.mean(dim=-1), x.std(dim=-1, unbiased=True)], dim=-1)


class DenseLayer(nn.Module):
    """1x1 projection of the pooled statistics and a non-affine BatchNorm (no ReLU)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.linear = nn.Conv1d(in_channels, out_channels, 1, bias=False)
        self.nonlinear = bn_relu(out_channels, affine=False, relu=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nonlinear(self.linear(x.unsqueeze(-1)).squeeze(-1))


class CAMPPlus(nn.Module):
    """Speaker encoder; submodule names are the checkpoint's (under ``speaker_encoder.``)."""

    def __init__(self, config: CAMPPlusConfig | None = None):
        super().__init__()
        c = self.config = config or CAMPPlusConfig.full()
        self.head = FCM(c.m_channels, c.feat_dim)
        channels = self.head.out_channels
        self.xvector = nn.Sequential(OrderedDict([("tdnn", TDNNLayer(channels, c.init_channels, 5, stride=2))]))
        channels = c.init_channels
        for i, (layers, dilation) in enumerate(zip(c.block_layers, (1, 2, 2))):
            self.xvector.add_module(f"block{i + 1}", CAMDenseTDNNBlock(layers, channels, c.growth_rate,
                                                                       c.bn_size * c.growth_rate, 3, dilation))
            channels += layers * c.growth_rate
            self.xvector.add_module(f"transit{i + 1}", TransitLayer(channels, channels // 2))
            channels //= 2
        self.xvector.add_module("out_nonlinear", bn_relu(channels))
        self.xvector.add_module("stats", StatsPool())
        self.xvector.add_module("dense", DenseLayer(channels * 2, c.embedding_size))
        for m in self.modules():   # upstream's initialisation (what a fresh module starts from)
            if isinstance(m, (nn.Conv1d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """feats: (B, T, feat_dim) mean-normalised fbank -> (B, embedding_size)."""
        return self.xvector(self.head(feats.permute(0, 2, 1)))

    @torch.no_grad()
    def embed(self, wav16: torch.Tensor) -> torch.Tensor:
        """wav16: (n,) float32 at 16 kHz, n >= 400 -> (1, embedding_size) x-vector (not normalised)."""
        feats = fbank(wav16.reshape(-1).float(), num_mel_bins=self.config.feat_dim)
        feats = feats - feats.mean(dim=0, keepdim=True)
        return self.forward(feats[None])
