"""Model FLOPs utilization: the device's peak, from the datasheet or measured.

MFU is the model's training FLOPs per second over the device's peak. The peak is the
vendor's dense bf16 figure where the device is known (no sparsity); elsewhere, and as
a second reference on every GPU (`measured_matmul_flops`), it is what a synchronised
bf16 matrix product reaches on this very device.
"""

from __future__ import annotations

import time

import torch

# Dense bf16 tensor-core peak FLOP/s by a substring of the CUDA device name, most specific
# first ("H100 PCIe" before "H100", "A100" before "A10", "GB200" before "B200").
DATASHEET_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10", 125e12),
)


def datasheet_peak(device_name: str) -> float | None:
    """The datasheet's dense bf16 peak of a device by its CUDA name, or None if unknown."""
    for key, flops in DATASHEET_BF16_FLOPS:
        if key in device_name:
            return flops
    return None


def measured_matmul_flops(
    device: torch.device, n: int | None = None, seconds: float = 0.5
) -> float:
    """FLOP/s of repeated n x n x n matrix products on `device`, timed with the device
    synchronised: bf16 on a GPU (n defaults to 8192), fp32 on the CPU (n 256)."""
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(3):  # warm-up: library load, clocks up
        a @ b
    sync()
    count, start = 0, time.perf_counter()
    while True:
        for _ in range(10 if cuda else 1):
            a @ b
            count += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * n**3 * count / elapsed


def peak_flops(device: torch.device, override: float | None = None) -> float:
    """The peak MFU is taken against: `override`, else the datasheet figure of a known
    GPU, else the measured matrix-product throughput of this device."""
    return peak_flops_and_source(device, override)[0]


def peak_flops_and_source(device: torch.device, override: float | None = None) -> tuple[float, str]:
    """`peak_flops` and one line saying where it came from (the trainer's summary states
    it: on a CPU, MFU is against a rate measured on this very machine, not a datasheet)."""
    if override:
        return override, "--peak-flops (given)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = datasheet_peak(name)
        if known:
            return known, f"datasheet dense bf16 peak of {name}"
        rate = measured_matmul_flops(device, seconds=0.2)
        return rate, f"measured: bf16 8192x8192 matmuls on {name}, 0.2 s, {rate / 1e12:.1f} TFLOP/s"
    rate = measured_matmul_flops(device, seconds=0.05)
    threads = torch.get_num_threads()
    return rate, (
        f"measured: fp32 256x256 matmuls on the CPU ({threads} thread{'s' * (threads > 1)}), "
        f"0.05 s, {rate / 1e9:.2f} GFLOP/s"
    )
