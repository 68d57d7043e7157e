"""What machine and software a precision benchmark ran on, and the command that ran it."""

from __future__ import annotations

import datetime
import os
import platform
import sys

import torch


def environment(device: torch.device) -> dict:
    import accelerate
    import transformers

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "gpu": gpu,
        "capability": list(torch.cuda.get_device_capability(device)) if gpu else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }
