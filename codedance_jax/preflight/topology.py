"""Pod preflight: compile jitted steps for a TPU topology on a CPU-only machine and read their cost.

With `jax[tpu]` installed (libtpu brings the TPU compiler), `get_topology_desc("v5p:4x4x4", "tpu")`
gives compile-only devices of a slice; `jax.jit(f).lower(abstract args).compile()` then runs the
real TPU compiler, and the executable reports per-chip memory (`memory_analysis()`) and XLA's cost
model (`cost_analysis()`). Nothing runs and no TPU is needed, so a pod run's memory and a cost-model
MFU are known before the pod is booked.

`offline_tpu_env` must run before the TPU plugin loads (the first `topology_devices` call): libtpu
otherwise asks a GCE metadata server and the worker hosts where it is, and nothing here may reach
a network.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

import jax
import numpy as np

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int
    peak_bf16_flops: float  # dense bf16 matmul peak per chip (public spec sheets)
    hbm_bytes_per_s: float  # HBM bandwidth per chip (spec sheets), for the roofline fallback
    cores_per_chip: int  # TensorCores per chip: accelerator type names count cores (v5p-128 = 64 chips)
    # ICI bandwidth into one chip (one direction, all its links), for the weight reshard's time; 0 = not known.
    ici_bytes_per_s: float = 0.0
    # One host's slice (e.g. "2x2"), where libtpu compiles a program over some of a slice's chips only
    # when they are the whole slice ("On platforms with limited ICI routing device assignment should
    # include all slice devices": seen for v5e); a host's programs then compile on this slice.
    host_topology: str = ""


# HBM as libtpu reports it to jax (memory_stats()['bytes_limit']) where known; spec-sheet peaks.
# ICI: Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v5p, /v5e, /v6e) list the
# bidirectional inter-chip interconnect bandwidth per chip: v5p 1,200 GB/s (older versions of the
# page: "Interchip Interconnect BW 4,800 Gbps"), v5e 400 GB/s ("1,600 Gbps"), v6e 800 GB/s. One
# direction is half of it (the Gbps figures): what a chip can receive at most. v4: not looked up.
CHIPS = {
    "v4": Chip("v4", int(30.75 * GIB), 275e12, 1.2e12, 2),
    "v5e": Chip("v5e", int(15.75 * GIB), 197e12, 0.819e12, 1, 1600e9 / 8, "2x2"),
    "v5p": Chip("v5p", int(95.74 * GIB), 459e12, 2.765e12, 2, 4800e9 / 8),
    "v6e": Chip("v6e", int(31.25 * GIB), 918e12, 1.64e12, 1, 800e9 / 2),
}


def parse_topology(topology: str) -> tuple[Chip, tuple[int, ...]]:
    """'v5p:4x4x4' -> (Chip v5p, (4, 4, 4)); a clear ValueError otherwise."""
    m = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+)*)", topology.strip())
    if not m or m.group(1) not in CHIPS:
        raise ValueError(f"--topology={topology!r}: expected CHIP:AxB[xC] with CHIP one of {sorted(CHIPS)}, "
                         "e.g. v5p:4x4x4 or v5e:2x2")
    return CHIPS[m.group(1)], tuple(int(x) for x in m.group(2).split("x"))


def offline_tpu_env(topology: str) -> dict[str, str]:
    """Environment under which libtpu compiles for `topology` without any network look-up.

    TPU_SKIP_MDS_QUERY stops the GCE metadata-server query; a single localhost worker stops it from
    looking for the other hosts of the slice; JAX_PLATFORMS=cpu keeps jax from opening a TPU
    backend (there is none: the topology's devices are compile-only). Existing values are kept.
    """
    chip, dims = parse_topology(topology)
    chips = int(np.prod(dims))
    env = {
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_WORKER_ID": "0",
        "TPU_HOSTNAME_OVERRIDE": "localhost",
        "TPU_ACCELERATOR_TYPE": f"{chip.name}-{chips * chip.cores_per_chip}",
        "TPU_TOPOLOGY": "x".join(map(str, dims)),
        "JAX_PLATFORMS": "cpu",
        # Compile-only use claims no chip: let several preflights (or a test and its launcher) load libtpu.
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        "GCE_METADATA_HOST": "127.0.0.1:1",  # belt and braces: any metadata client fails at once, locally
        "GCE_METADATA_IP": "127.0.0.1:1",
    }
    for k, v in env.items():
        os.environ.setdefault(k, v)
    # jax reads JAX_PLATFORMS when it is imported; if it already was, set the option itself (this
    # only matters before the first backend starts, which preflight never needs).
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    return env


def libtpu_available() -> str | None:
    """None when libtpu is installed, else the reason (for test skips and the launcher's error)."""
    if importlib.util.find_spec("libtpu") is None and not os.environ.get("TPU_LIBRARY_PATH"):
        return ("libtpu is not installed: preflight needs the TPU compiler "
                "(python3 -m venv /tmp/tpu-venv && /tmp/tpu-venv/bin/pip install -r requirements-tpu.txt)")
    return None


def topology_devices(topology: str) -> list:
    """Compile-only devices of the slice (call `offline_tpu_env(topology)` first)."""
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(topology, "tpu").devices)


def topology_mesh(devices, data: int, fsdp: int, tensor: int) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh over compile-only devices, laid out along the torus when possible."""
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) == 1:
        known = int(np.prod([s for s in sizes if s != -1]))
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh data*fsdp*tensor = {sizes} does not use the topology's {len(devices)} chips")
    from jax.experimental import mesh_utils

    try:
        arr = mesh_utils.create_device_mesh(sizes, devices)
    except Exception:  # noqa: BLE001 - odd shapes: plain order is still a valid (slower) mesh
        arr = np.asarray(devices).reshape(sizes)
    return jax.sharding.Mesh(arr, ("data", "fsdp", "tensor"))


def abstract(tree, shardings):
    """ShapeDtypeStructs carrying shardings: lowering needs no arrays."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


@dataclasses.dataclass
class Report:
    name: str
    chips: int
    hbm_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    xla_flops: float  # per chip, XLA's count
    model_flops: float  # per chip, `train.flops` formula (0 when not a training step)
    optimal_seconds: float  # XLA's cost model; <= 0 when it gives none (seen for programs with loops)
    peak_flops: float
    bytes_accessed: float = 0.0  # per chip, XLA's count
    hbm_bytes_per_s: float = 0.0
    largest: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    note: str = ""
    resident_bytes: int = 0  # per chip, buffers the caller keeps alive during the call that are not its arguments
    # Per chip: time of work XLA's cost model does not see (the flash kernel's backward, costed at
    # peak flops by `preflight_plan.flash_backward_flops`); added to `seconds`, so MFU errs low.
    uncounted_seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        """Peak per chip: live arguments + temporaries + outputs not aliased to (donated) arguments,
        plus what the caller holds meanwhile (`resident_bytes`)."""
        return (self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes + self.code_bytes
                + self.resident_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.hbm_bytes

    @property
    def hbm_frac(self) -> float:
        return self.total_bytes / self.hbm_bytes

    @property
    def seconds(self) -> float:
        """XLA's optimal_seconds when positive, else the roofline of XLA's own counts (flops, bytes);
        plus `uncounted_seconds`."""
        if self.optimal_seconds > 0:
            return self.optimal_seconds + self.uncounted_seconds
        bw = self.bytes_accessed / self.hbm_bytes_per_s if self.hbm_bytes_per_s else 0.0
        return max(self.xla_flops / self.peak_flops, bw) + self.uncounted_seconds

    @property
    def xla_util(self) -> float:
        """XLA's flops over its time, against peak: hardware utilisation of the program per the cost model."""
        secs = self.seconds - self.uncounted_seconds
        return self.xla_flops / (secs * self.peak_flops) if secs > 0 else 0.0

    @property
    def loops_undercounted(self) -> bool:
        """XLA's cost analysis counts a loop body once (micro-batch scan, vocabulary-chunk map)."""
        counted = self.xla_flops + self.uncounted_seconds * self.peak_flops
        return bool(self.model_flops) and 0 < counted < 0.9 * self.model_flops

    @property
    def mfu(self) -> float:
        if not self.seconds or not self.model_flops:
            return 0.0
        return self.model_flops / (self.seconds * self.peak_flops)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(total_bytes=self.total_bytes, fits=self.fits, hbm_frac=self.hbm_frac, mfu=self.mfu, seconds=self.seconds,
                 xla_util=self.xla_util, loops_undercounted=self.loops_undercounted)
        return d


_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([a-z]+\d*)\[([\d,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}
_OPNAME = re.compile(r'op_name="([^"]*)"')


def largest_buffers(hlo_text: str, n: int = 6) -> list[tuple[int, str]]:
    """The n largest array values of the optimized per-chip HLO: (bytes, 'dtype[shape] op_name')."""
    seen: dict[str, int] = {}
    for line in hlo_text.splitlines():
        m = _SHAPE.match(line)
        if not m or m.group(2) not in _DTYPE_BYTES:
            continue
        dims = [int(x) for x in m.group(3).split(",") if x]
        size = int(np.prod(dims)) * _DTYPE_BYTES[m.group(2)] if dims else _DTYPE_BYTES[m.group(2)]
        op = _OPNAME.search(line)
        label = f"{m.group(2)}[{m.group(3)}] {op.group(1) if op else m.group(1)}"
        seen[label] = max(seen.get(label, 0), size)
    return sorted(((b, k) for k, b in seen.items()), reverse=True)[:n]


def compile_report(name: str, jitted, args, *, chip: Chip, chips: int, model_flops_total: float = 0.0,
                   note: str = "", kwargs: dict | None = None, resident_bytes: int = 0,
                   uncounted_flops_total: float = 0.0) -> Report:
    """Lower and compile `jitted` on abstract `args` (and static `kwargs`); per-chip memory and cost model.

    `chips`: the devices the function runs on (the slice for a training step, one host's chips for
    a rollout function): model flops are divided over them."""
    lowered = jitted.lower(*args, **(kwargs or {}))
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses programs over HBM
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        rep = _over_hbm_report(name, lowered, str(e), chip=chip, chips=chips, model_flops_total=model_flops_total)
        rep.resident_bytes = resident_bytes
        rep.uncounted_seconds = uncounted_flops_total / chips / chip.peak_bf16_flops
        return rep
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else (cost or {})
    rep = Report(
        name=name, chips=chips, hbm_bytes=chip.hbm_bytes,
        argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes),
        code_bytes=int(getattr(mem, "generated_code_size_in_bytes", 0)),
        xla_flops=float(cost.get("flops", 0.0)), model_flops=model_flops_total / chips,
        optimal_seconds=float(cost.get("optimal_seconds", 0.0)), peak_flops=chip.peak_bf16_flops, note=note,
        bytes_accessed=float(cost.get("bytes accessed", 0.0)), hbm_bytes_per_s=chip.hbm_bytes_per_s,
        resident_bytes=resident_bytes, uncounted_seconds=uncounted_flops_total / chips / chip.peak_bf16_flops,
    )
    rep.largest = largest_buffers(compiled.as_text())
    return rep


_NEED = re.compile(r"required for (?:HLO )?(\w[\w ]*?) \(([\d.]+)([KMGT]?)\)")


def _over_hbm_report(name, lowered, message, *, chip: Chip, chips: int, model_flops_total: float) -> Report:
    """A Report for a program the compiler refused: the size it states, buffers of the unpartitioned program."""
    m = _NEED.search(message)
    need = int(float(m.group(2)) * 1024 ** "BKMGT".index(m.group(3) or "B")) if m else chip.hbm_bytes + 1
    rep = Report(name=name, chips=chips, hbm_bytes=chip.hbm_bytes, argument_bytes=0, output_bytes=0, alias_bytes=0,
                 temp_bytes=need, code_bytes=0, xla_flops=0.0, model_flops=model_flops_total / chips,
                 optimal_seconds=0.0, peak_flops=chip.peak_bf16_flops, hbm_bytes_per_s=chip.hbm_bytes_per_s,
                 note="the TPU compiler refused it: " + message.strip().splitlines()[0][:300]
                 + "; largest buffers are global shapes before partitioning")
    try:
        rep.largest = largest_buffers(lowered.as_text(dialect="hlo"))
    except Exception:  # noqa: BLE001 - naming buffers is best effort
        rep.largest = []
    return rep


LINEAR_FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "code_bytes", "xla_flops",
                 "model_flops", "optimal_seconds", "bytes_accessed", "resident_bytes", "uncounted_seconds")


def extrapolate(base: Report, plus_text: Report, plus_vision: Report, more_text: int, more_vision: int,
                plus_text2: Report | None = None) -> Report:
    """base + more_text x (one text layer's increment) + more_vision x (one vision block's), field by field.

    plus_text2 (a compile with two text layers more than base): the temporaries' text-layer increment
    is taken between the two deeper points instead. A one-layer program has nothing live from one
    layer to the next, so its first increment can be a one-off: the 7B append's temporaries went
    8.75 -> 10.63 -> 10.63 -> 10.63 GiB at 1-4 layers (issue 37), where the 1 -> 2 line said 59 GiB."""
    vals = {f: getattr(base, f) + more_text * (getattr(plus_text, f) - getattr(base, f))
            + more_vision * (getattr(plus_vision, f) - getattr(base, f)) for f in LINEAR_FIELDS}
    note = (f"extrapolated linearly in depth from compiles at +0/+1 layers (+{more_text} text layers, "
            f"+{more_vision} vision blocks)")
    if plus_text2 is not None and more_text >= 1:
        per_layer = plus_text2.temp_bytes - plus_text.temp_bytes
        vals["temp_bytes"] = (plus_text.temp_bytes + (more_text - 1) * per_layer
                              + more_vision * (plus_vision.temp_bytes - base.temp_bytes))
        note += f"; temporaries from the +1/+2 layer compiles ({per_layer / GIB:+.2f} GiB per text layer)"
    vals = {f: (v if isinstance(getattr(base, f), float) else int(v)) for f, v in vals.items()}
    # One layer's transient working set (attention scores of a whole chunk) is there at any depth: where
    # the compiler's temporaries fell from one depth point to the next, the line would go below it.
    points = (base, plus_text, plus_vision) + ((plus_text2,) if plus_text2 is not None else ())
    floor = max(p.temp_bytes for p in points)
    if vals["temp_bytes"] < floor:
        note += (f"; temporaries fell with depth ({base.temp_bytes / GIB:.2f} -> {plus_text.temp_bytes / GIB:.2f} GiB), "
                 f"so they are kept at the depth points' largest, not the line's {vals['temp_bytes'] / GIB:.2f}")
        vals["temp_bytes"] = floor
    rep = dataclasses.replace(base, **vals, note="; ".join(x for x in (base.note, note) if x))
    rep.largest = (plus_text2 or plus_text).largest
    return rep


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}"


def format_table(reports: list[Report], topology: str) -> str:
    chip_hbm = reports[0].hbm_bytes if reports else 0
    chips = int(np.prod(parse_topology(topology)[1]))
    head = (f"preflight {topology}: {chips} chips, {_gib(chip_hbm)} GiB HBM per chip, "
            f"MFU against {reports[0].peak_flops / 1e12:.0f} TFLOP/s bf16 per chip" if reports else "")
    lines = [head, "",
             "| function | args GiB | temp GiB | out GiB | aliased GiB | total GiB | % HBM | fits | XLA TFLOP/chip "
             "| cost-model s | XLA util | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        mfu = (f"{100 * r.mfu:.1f}%" + ("**" if r.loops_undercounted else "")) if r.mfu else "-"
        util = f"{100 * r.xla_util:.1f}%" if r.xla_util else "-"
        secs = f"{r.seconds:.4f}" + ("" if r.optimal_seconds > 0 else "*") if r.seconds else "-"
        name = r.name if r.chips == chips else f"{r.name} [{r.chips} chips]"  # e.g. one host's share of the slice
        lines.append(f"| {name} | {_gib(r.argument_bytes)} | {_gib(r.temp_bytes)} | {_gib(r.output_bytes)} | "
                     f"{_gib(r.alias_bytes)} | {_gib(r.total_bytes)} | {100 * r.hbm_frac:.1f} | "
                     f"{'yes' if r.fits else 'NO'} | {r.xla_flops / 1e12:.2f} | {secs} | {util} | {mfu} |")
    if any(r.optimal_seconds <= 0 and r.xla_flops > 0 for r in reports):
        lines.append("- *: XLA gave no optimal_seconds; roofline max(XLA flops / peak, XLA bytes / HBM bandwidth)")
    if any(r.loops_undercounted for r in reports):
        lines.append("- **: XLA counted fewer flops than the model formula: its cost analysis counts a loop body once "
                     "(micro-batch scan, vocabulary-chunk map), so this MFU is overstated; XLA util (its flops over its "
                     "time) is the cost model's own utilisation")
    for r in reports:
        if r.uncounted_seconds:
            lines.append(f"- {r.name}: cost-model s includes {r.uncounted_seconds:.4f} s for the flash kernel's backward "
                         "at peak flops (XLA costs those calls by their bytes only)")
    for r in reports:
        held = f" (+{_gib(r.resident_bytes)} GiB per chip held by the caller, in total)" if r.resident_bytes else ""
        if r.note or held:
            lines.append(f"- {r.name}: {r.note}{held}")
        if r.largest and r.hbm_frac > 0.85:
            lines.append(f"- {r.name} largest buffers: " + "; ".join(f"{_gib(b)} GiB {k}" for b, k in r.largest))
    return "\n".join(lines)
