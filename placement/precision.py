"""What a weight precision changes in the planner's terms: bytes per weight and the matmul rate.

An instance serves at the checkpoint's own precision (`InstanceSpec.quantization` None) or at one of
`jaxserve.core.plan.QUANTIZATIONS`. Only the decoder layers' matmul weights change (`models/quant.py` quantizes
linear layers); embeddings, the LM head, norms, biases, activations and the KV cache stay at the checkpoint's
dtype. Per weight of a layer matmul:

| precision | bytes per weight | matmul rate |
|---|---|---|
| checkpoint (fp16 / bf16) | 2 | the device's dense 16-bit peak |
| int8 (per-channel, weight-only) | 1 | 16-bit (dequantized to 16 bits before the multiply) |
| int4 (group 64, weight-only) | 0.5 + an f32 scale and min per 64 = 0.625 | 16-bit |
| w8a8 (int8 weights and activations) | 1 | `DeviceSpec.int8_flops` (A100: 624 TOPS, 2x); 16-bit rate if None |
| fp8 (fp8 weights and activations) | 1 | `DeviceSpec.fp8_flops` (H100 / H200: 2x); refused where None |

int8's per-channel f32 scale (4 bytes per output row: 4/h bytes a weight, < 0.1 % at h >= 4096) is not counted.
Decode reads every weight once per step, so its GEMMs cost the bytes; prefill's cost the FLOPs at the rate.
A quantized checkpoint (a GGUF) is its own precision already: `quantization` None serves it as stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxserve.core.plan import QUANTIZATIONS, DeploymentPlan, InstanceSpec
from placement.hardware import DEVICES, DeviceSpec
from placement.stage_latency import StageLatency

CHECKPOINT = "checkpoint"  # the name `--precisions` gives the checkpoint's own precision (quantization None)
INT4_GROUP = 64  # models/quant.py's default int4 group: an f32 scale and an f32 min per group
_WEIGHT_BYTES = {"int8": 1.0, "w8a8": 1.0, "fp8": 1.0, "int4": 0.5 + 8 / INT4_GROUP}


class PrecisionError(ValueError):
    """A precision the planner cannot use (unknown, or not on this device); the message says why."""


def weight_bytes(quantization: str | None, dtype_bytes: float) -> float:
    """Bytes of one layer-matmul weight at `quantization` (None: the checkpoint's `dtype_bytes`)."""
    if quantization is None:
        return dtype_bytes
    return _WEIGHT_BYTES[quantization]


def matmul_speedup(quantization: str | None, device: DeviceSpec) -> float:
    """The layer matmuls' rate at `quantization` over the device's 16-bit rate (`peak_flops`).

    Weight-only schemes multiply in 16 bits (1); w8a8 runs at `int8_flops` (1 where the spec gives none);
    fp8 at `fp8_flops`, and raises PrecisionError on a device without it."""
    check_supported(quantization, device)
    if quantization == "w8a8" and device.int8_flops is not None:
        return device.int8_flops / device.peak_flops
    if quantization == "fp8":
        assert device.fp8_flops is not None
        return device.fp8_flops / device.peak_flops
    return 1.0


def check_supported(quantization: str | None, device: DeviceSpec) -> None:
    """Raise PrecisionError for an unknown precision or one `device` cannot run (fp8 without fp8 units)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise PrecisionError(f"unknown precision {quantization!r}; expected {CHECKPOINT} or one of {QUANTIZATIONS}")
    if quantization == "fp8" and device.fp8_flops is None:
        have = ", ".join(name for name, spec in DEVICES.items() if spec.fp8_flops is not None)
        raise PrecisionError(f"fp8 needs fp8 matmul units ({have}); {device.name} has none")


def parse_precisions(text: str, device: DeviceSpec) -> tuple[str | None, ...]:
    """`--precisions`: comma-separated `checkpoint` and QUANTIZATIONS, each allowed on `device`, in the order
    given (None stands for `checkpoint`). Raises PrecisionError naming the first bad entry."""
    names = [n.strip() for n in text.split(",")]
    if not names or any(not n for n in names):
        raise PrecisionError(f"--precisions takes a comma-separated list of {CHECKPOINT}, {', '.join(QUANTIZATIONS)}")
    out: list[str | None] = []
    for name in names:
        q = None if name == CHECKPOINT else name
        check_supported(q, device)
        if q in out:
            raise PrecisionError(f"--precisions names {name} twice")
        out.append(q)
    return tuple(out)


def precision_name(quantization: str | None) -> str:
    return CHECKPOINT if quantization is None else quantization


def plan_precisions(plan: DeploymentPlan) -> str:
    """The plan's precision per role, e.g. `prefill w8a8, decode int4`; '' when every instance serves the
    checkpoint's own precision (so plans without quantization print as before)."""
    by_role: dict[str, list[str]] = {}
    for inst in plan.instances:
        names = by_role.setdefault(inst.role, [])
        if precision_name(inst.quantization) not in names:
            names.append(precision_name(inst.quantization))
    if all(names == [CHECKPOINT] for names in by_role.values()):
        return ""
    return ", ".join(f"{role} {'+'.join(names)}" for role, names in by_role.items())


def shape(inst: InstanceSpec) -> str:
    """`inst.shape` with its precision when quantized (`tp2 int4`)."""
    return inst.shape + (f" {inst.quantization}" if inst.quantization is not None else "")


def describe(plan: DeploymentPlan) -> str:
    """`plan.describe()` with its precisions appended when any instance is quantized."""
    extra = plan_precisions(plan)
    return plan.describe() + (f" [{extra}]" if extra else "")


@dataclasses.dataclass(frozen=True)
class RooflineRatio:
    """A profile's instance carried to another precision by the roofline: each step's time is the profile's at
    the checkpoint's precision times the roofline's time at the precision over its time at the checkpoint's,
    for that step's shape. The rule for a profile fitted at the checkpoint's precision only: the roofline says
    what share of a step is weight reads (decode), matmuls (prefill) or neither (attention, all-reduces, the LM
    head, which keep their time), the profile how long the step really takes."""

    base: StageLatency  # the profile's instance at the checkpoint's precision
    target: StageLatency  # the roofline at the precision
    reference: StageLatency  # the roofline at the checkpoint's precision

    @property
    def pp(self) -> int:
        return self.base.pp

    def prefill_stage_s(self, num_tokens: float, sum_sq: float, batch: int) -> float:
        ratio = self.target.prefill_stage_s(num_tokens, sum_sq, batch) / self.reference.prefill_stage_s(
            num_tokens, sum_sq, batch
        )
        return self.base.prefill_stage_s(num_tokens, sum_sq, batch) * ratio

    def decode_stage_s(self, batch: int, ctx_sum: float) -> float:
        return self.decode_stage_fn(batch)(ctx_sum)

    def decode_stage_fn(self, batch: int) -> Callable[[float], float]:
        base, target, ref = (_decode_fn(m, batch) for m in (self.base, self.target, self.reference))
        return lambda ctx_sum: base(ctx_sum) * (target(ctx_sum) / ref(ctx_sum))

    def chunk_stage_s(
        self, num_tokens: float, sum_sq: float, batch: int, decode_batch: int, decode_ctx_sum: float
    ) -> float:
        args = (num_tokens, sum_sq, batch, decode_batch, decode_ctx_sum)
        return self.base.chunk_stage_s(*args) * (self.target.chunk_stage_s(*args) / self.reference.chunk_stage_s(*args))

    def send_s(self, num_tokens: int) -> float:
        return self.base.send_s(num_tokens)


def _decode_fn(model: StageLatency, batch: int) -> Callable[[float], float]:
    make = getattr(model, "decode_stage_fn", None)
    if make is not None:
        fn: Callable[[float], float] = make(batch)
        return fn
    return lambda ctx_sum: model.decode_stage_s(batch, ctx_sum)
