"""Local GPUs: which exist, and which of them a new worker may have.

Called by the local backend at launch. Detection asks `nvidia-smi -L` (or torch, only if the
controller process already imported it; importing torch here would cost seconds and gigabytes).
What it must not do: remember allocations. Which devices are taken is derived every time from the
live worker processes (their CUDA_VISIBLE_DEVICES), so a restarted controller computes the same.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable

from mortal.controller.backends.base import InsufficientGPUs

CPU_NAMES = ("none", "cpu", "")
# Memory of one GPU of each type the spec may name (Modal's names, mortal.controller.backends.modal), in
# bytes as sold (80 GB is 80e9; torch reports a little less).
# A name that covers several sizes maps to the largest, so a check against it can only be too lenient.
GB = 10**9
GPU_MEMORY = {
    "T4": 16 * GB,
    "L4": 24 * GB,
    "A10": 24 * GB,
    "A10G": 24 * GB,
    "L40S": 48 * GB,
    "A100": 80 * GB,
    "A100-40GB": 40 * GB,
    "A100-80GB": 80 * GB,
    "RTX-PRO-6000": 96 * GB,
    "H100": 80 * GB,
    "H100!": 80 * GB,
    "H200": 141 * GB,
    "B200": 180 * GB,
    "B200+": 180 * GB,
}
_GPU_LINE = re.compile(r"^GPU (\d+):", re.MULTILINE)


def wants_gpu(gpu: str) -> bool:
    """False for the spec's 'none' (CPU)."""
    return gpu.strip().lower() not in CPU_NAMES


def gpu_memory(gpu: str) -> int | None:
    """Bytes of one GPU of type `gpu` (e.g. "H100", "a100-40gb"), None for CPU or a type not in the table."""
    return GPU_MEMORY.get(gpu.strip().upper())


def spec_name_of(device_name: str) -> str | None:
    """The spec's name for a GPU whose driver calls it `device_name` (torch.cuda.get_device_name,
    nvidia-smi -L: "NVIDIA H100 80GB HBM3" is H100, "NVIDIA A100-SXM4-40GB" is A100-40GB), None for one
    not in GPU_MEMORY.
    The longest name that appears in it wins, so A100-40GB beats A100. None for a variant of another size
    than its name's (H100 NVL: 94 GB), so a memory check never holds it to the wrong size."""
    if "NVL" in device_name.upper():
        return None
    words = device_name.upper().replace("SXM4-", "").replace("PCIE-", "").replace(" ", "-")
    names = [
        name
        for name in GPU_MEMORY
        if not name.endswith(("!", "+")) and re.search(rf"(^|[^A-Z0-9]){re.escape(name)}($|[^A-Z0-9])", words)
    ]
    return max(names, key=len, default=None)


def detect_gpus() -> list[str]:
    """Device ids this controller may hand out, as CUDA_VISIBLE_DEVICES entries.

    The controller's own CUDA_VISIBLE_DEVICES, when set, is the pool (an operator restricting the
    controller restricts its workers); otherwise every GPU nvidia-smi lists.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [str(i) for i in range(torch.cuda.device_count())]
    return _nvidia_smi_devices()


def _nvidia_smi_devices() -> list[str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_nvidia_smi_list(out.stdout) if out.returncode == 0 else []


def parse_nvidia_smi_list(text: str) -> list[str]:
    """Device indices from `nvidia-smi -L` ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)")."""
    return _GPU_LINE.findall(text)


def assign(gpu: str, count: int, devices: list[str], in_use: Iterable[str]) -> str:
    """The CUDA_VISIBLE_DEVICES value for a new worker: '' for CPU, else `count` free devices.

    Raises InsufficientGPUs (permanent when the machine has fewer than `count` at all).
    """
    if not wants_gpu(gpu):
        return ""
    taken = set(in_use)
    free = [d for d in devices if d not in taken]
    if count > len(free):
        raise InsufficientGPUs(count, len(free), len(devices), gpu)
    return ",".join(free[:count])


def parse_visible(value: str | None) -> tuple[str, ...]:
    """A worker's CUDA_VISIBLE_DEVICES as the devices it holds."""
    return tuple(d.strip() for d in (value or "").split(",") if d.strip())
