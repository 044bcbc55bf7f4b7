"""The small model that memory_timeline.py's tests record: the graded tests, their probes and the
private tests alike.

Five layers of known sizes (256 -> 1024 -> 256, a LayerNorm, 256 -> 256), seeded, so that its
parameter, gradient and optimizer-state bytes follow exact formulas on any device.
"""

import torch
import torch.nn as nn


def small_model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024),
        nn.GELU(),
        nn.Linear(1024, 256),
        nn.LayerNorm(256),
        nn.Linear(256, 256),
    ).to(device)
