"""The small model that memory_timeline.py's tests record: the graded tests, their probes and the
private tests alike.

Five layers of known sizes by default (256 -> 1024 -> 256, a LayerNorm, 256 -> 256), seeded, so
that its parameter, gradient and optimizer-state bytes follow exact formulas on any device. At
grading time the activation tests record layers drawn from the same kinds (drawn_layers).
"""

import torch
import torch.nn as nn

PUBLIC = ("linear 1024", "gelu", "linear 256", "layernorm", "linear 256")
KINDS = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


def small_model(device="cpu", layers=PUBLIC):
    """nn.Sequential of ``layers`` ("linear N": N outputs; "layernorm"; or a KINDS name) on 256
    inputs, seeded."""
    torch.manual_seed(0)
    modules, width = [], 256
    for layer in layers:
        kind, *size = layer.split()
        if kind == "linear":
            modules.append(nn.Linear(width, int(size[0])))
            width = int(size[0])
        else:
            modules.append(nn.LayerNorm(width) if kind == "layernorm" else KINDS[kind]())
    return nn.Sequential(*modules).to(device)


def drawn_layers(gen):
    """2-3 linear layers of drawn widths, each followed by a drawn activation or LayerNorm, then a
    linear layer back to 256: the models the graded tests record at grading time."""
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    layers = []
    for _ in range(2 + int(torch.randint(2, (1,), generator=gen))):
        layers += [f"linear {pick((128, 384, 512, 768))}", pick((*sorted(KINDS), "layernorm"))]
    return (*layers, "linear 256")
