"""Test-wide setup: Triton runs under its CPU interpreter when no GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
