"""Device specs and cluster topology: what the latency model and the placement search know about hardware.

A `DeviceSpec` is a roofline (peak dense FLOP/s, memory bandwidth, memory size) plus the
per-device NVLink-class bandwidth used for tensor-parallel all-reduces and intra-node KV
transfers. A `ClusterSpec` is `num_nodes` nodes of `devices_per_node` identical devices with
an intra-node and an inter-node link. Device index `d` lives on node `d // devices_per_node`.
"""

from __future__ import annotations

import dataclasses
import os

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator's roofline numbers (dense half precision, and the lower precisions' matmul peaks)."""

    name: str
    peak_flops: float  # FLOP/s, dense bf16/fp16
    mem_bandwidth: float  # bytes/s, HBM
    memory_bytes: int
    link_bandwidth: float  # bytes/s per device inside a node (NVLink-class), one direction
    # Share of memory a serving engine can use for weights + KV cache (the rest is activations,
    # workspace, fragmentation). 0.925 reproduces the A100 KV capacities of the DistServe
    # artifact within ~1.5 % (see placement/latency.py: kv_capacity_tokens).
    usable_memory_fraction: float = 0.925
    # Achievable shares of the roofline peaks for large GEMMs / streaming reads.
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.75
    # Fixed per-step overhead (launches, Python runtime, sampling), seconds.
    step_overhead_s: float = 0.010
    # Dense matmul peaks of the lower precisions (placement/precision.py): int8 x int8 (w8a8) and fp8 x fp8.
    # None for int8: its matmuls run at the 16-bit rate (no gain); None for fp8: the device has no fp8 units.
    int8_flops: float | None = None  # OP/s
    fp8_flops: float | None = None  # FLOP/s

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.mem_bandwidth <= 0 or self.memory_bytes <= 0 or self.link_bandwidth <= 0:
            raise ValueError(f"device {self.name}: peak_flops, bandwidths and memory must be positive")
        if any(rate is not None and rate <= 0 for rate in (self.int8_flops, self.fp8_flops)):
            raise ValueError(f"device {self.name}: int8_flops and fp8_flops are positive or None")

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction


def _cpu_spec() -> DeviceSpec:
    # A rough host CPU: AVX2-class FMA per core, DDR bandwidth. Only for the CPU test engine.
    cores = os.cpu_count() or 1
    return DeviceSpec(
        name="cpu",
        peak_flops=cores * 50e9,
        mem_bandwidth=20e9,
        memory_bytes=16 * GIB,
        link_bandwidth=10e9,
        flops_efficiency=0.3,
        bandwidth_efficiency=0.5,
        step_overhead_s=0.002,
    )


DEVICES: dict[str, DeviceSpec] = {
    "a100-80gb": DeviceSpec(
        "a100-80gb",
        peak_flops=312e12,
        mem_bandwidth=2.0e12,
        memory_bytes=80 * GIB,
        link_bandwidth=300e9,
        int8_flops=624e12,
    ),
    "a100-40gb": DeviceSpec(
        "a100-40gb",
        peak_flops=312e12,
        mem_bandwidth=1.555e12,
        memory_bytes=40 * GIB,
        link_bandwidth=300e9,
        int8_flops=624e12,
    ),
    "h100-80gb": DeviceSpec(
        "h100-80gb",
        peak_flops=989e12,
        mem_bandwidth=3.35e12,
        memory_bytes=80 * GIB,
        link_bandwidth=450e9,
        int8_flops=1979e12,
        fp8_flops=1979e12,
    ),
    "h200": DeviceSpec(
        "h200",
        peak_flops=989e12,
        mem_bandwidth=4.8e12,
        memory_bytes=141 * 10**9,
        link_bandwidth=450e9,
        int8_flops=1979e12,
        fp8_flops=1979e12,
    ),
    "tpu-v5e": DeviceSpec(
        "tpu-v5e",
        peak_flops=197e12,
        mem_bandwidth=0.819e12,
        memory_bytes=16 * GIB,
        link_bandwidth=100e9,
        int8_flops=394e12,
    ),
}


def get_device(name: str) -> DeviceSpec:
    """A device spec by name (`a100-80gb`, `h100-80gb`, `h200`, `tpu-v5e`, `cpu`)."""
    key = name.lower()
    if key == "cpu":
        return _cpu_spec()
    if key not in DEVICES:
        raise KeyError(f"unknown device {name!r}; known: {', '.join([*DEVICES, 'cpu'])}")
    return DEVICES[key]


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Homogeneous nodes of identical devices.

    `intra_node_bandwidth` defaults to the device's link bandwidth (NVLink);
    `inter_node_bandwidth` is per device pair across nodes (the paper's cluster: 25 Gb/s).
    """

    device: DeviceSpec
    num_nodes: int = 1
    devices_per_node: int = 8
    intra_node_bandwidth: float | None = None  # bytes/s
    inter_node_bandwidth: float = 25e9 / 8  # bytes/s
    link_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.devices_per_node < 1:
            raise ValueError("a cluster needs at least one node and one device per node")
        if self.inter_node_bandwidth <= 0:
            raise ValueError("inter_node_bandwidth must be positive")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def nvlink_bandwidth(self) -> float:
        return self.intra_node_bandwidth or self.device.link_bandwidth

    def node_of(self, device_index: int) -> int:
        return device_index // self.devices_per_node

    def bandwidth_between_nodes(self, node_a: int, node_b: int) -> float:
        return self.nvlink_bandwidth if node_a == node_b else self.inter_node_bandwidth

    def transfer_s(self, num_bytes: float, node_a: int, node_b: int) -> float:
        """Time to move `num_bytes` between two devices on the given nodes."""
        return self.link_latency_s + num_bytes / self.bandwidth_between_nodes(node_a, node_b)
