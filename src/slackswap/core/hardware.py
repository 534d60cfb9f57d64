"""The target machine: compute roofline, HBM, and the host link used for offloading.

Presets ship as TOML files in ``slackswap/hardware/presets``; each field cites its source
in the file's ``[sources]`` table. Users pass a preset name or a path to their own file.
"""

from __future__ import annotations

import json
import math
import re
import sys
import warnings
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field

from slackswap.core.jsonio import read_file, validate_model
from slackswap.errors import HardwareNotice, InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["Hardware", "Compute", "Memory", "HostLink", "Host", "Node", "HOST_SOURCES",
           "load_hardware", "profile_hardware", "hardware_presets", "on_node", "with_overrides",
           "parse_overrides", "DEFAULT_HARDWARE", "preset_for_gpu", "default_hardware",
           "notice"]


def _within(low: float, high: float) -> pydantic.AfterValidator:
    """Figures beyond these bounds describe no machine, and the times the cost model and
    the simulator compute from them would overflow."""
    def check(value: float) -> float:
        if not low <= value <= high:
            bounds = f"at least {low:g}" if high == math.inf else f"{low:g} to {high:g}"
            raise ValueError(f"{value:g} describes no machine; use {bounds}")
        return value
    return pydantic.AfterValidator(check)


# rates (per second; infinite: free) and sizes; efficiencies; fixed costs per kernel,
# copy or host op
Positive = Annotated[float, Field(gt=0), _within(1, math.inf)]
Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False), _within(1e-6, 1)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False), _within(0, 60)]
# A step table: rows of [threshold, efficiency]; the row with the largest threshold <= size applies.
StepTable = list[tuple[Annotated[float, Field(ge=0)], Fraction]]


def _check_table(table: StepTable) -> StepTable:
    thresholds = [row[0] for row in table]
    if not table or thresholds[0] != 0 or thresholds != sorted(set(thresholds)):
        raise ValueError("rows must start at threshold 0 and ascend strictly")
    return table


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class Compute(_Strict):
    peak_flops: dict[Literal["fp32", "tf32", "fp16", "bf16"], Positive]
    matmul_efficiency: StepTable
    matmul_efficiency_cap: Fraction
    attention_forward_efficiency: Fraction
    attention_backward_efficiency: Fraction
    # with a causal mask (FLOPs counted causally); None: as without one
    attention_causal_forward_efficiency: Fraction | None = None
    attention_causal_backward_efficiency: Fraction | None = None
    min_kernel_time_s: Seconds
    # NOTE [unaligned matmuls] in slackswap.core.costmodel: the most a 2-byte matmul with
    # an odd dimension reaches; None: priced as any other (left out of the file when unset)
    matmul_unaligned_efficiency: Fraction | None = Field(default=None,
                                                         exclude_if=lambda v: v is None)
    # NOTE [causal attention by sequence]: the query sequence the causal figures above
    # were measured at, and each kernel's fixed cost per query block in key blocks of
    # work; None: the causal figures at every sequence (left out of the file when unset)
    attention_reference_seq: Annotated[int, Field(ge=1)] | None = Field(
        default=None, exclude_if=lambda v: v is None)
    attention_causal_forward_overhead: Annotated[float, Field(ge=0, le=1e3)] | None = Field(
        default=None, exclude_if=lambda v: v is None)
    attention_causal_backward_overhead: Annotated[float, Field(ge=0, le=1e3)] | None = Field(
        default=None, exclude_if=lambda v: v is None)

    _table = pydantic.field_validator("matmul_efficiency")(_check_table)

    @pydantic.model_validator(mode="after")
    def _reference(self) -> Compute:
        if self.attention_reference_seq is None and (
                self.attention_causal_forward_overhead is not None
                or self.attention_causal_backward_overhead is not None):
            raise ValueError("attention_causal_*_overhead needs attention_reference_seq, the "
                             "sequence the causal attention figures were measured at")
        return self

    @pydantic.field_validator("peak_flops")
    @classmethod
    def _fp32(cls, peaks: dict[str, float]) -> dict[str, float]:
        if "fp32" not in peaks:
            raise ValueError("needs an fp32 peak, the rate of dtypes without their own")
        return peaks


class Memory(_Strict):
    capacity_bytes: Positive
    hbm_bandwidth: Positive
    bandwidth_efficiency: StepTable
    # NOTE [reductions] in slackswap.core.costmodel: the fraction of bandwidth a reduction
    # kernel reaches, by bytes moved; None: reductions priced as elementwise ops
    reduction_bandwidth_efficiency: StepTable | None = Field(default=None,
                                                            exclude_if=lambda v: v is None)
    # NOTE [unvectorized kernels] in slackswap.core.costmodel: elements per second an
    # elementwise kernel that loads one element at a time writes at most; None: such
    # kernels priced by their bytes
    unvectorized_elements_per_s: Positive | None = Field(default=None,
                                                         exclude_if=lambda v: v is None)
    # NOTE [kernel passes] in slackswap.core.costmodel: true where softmax and the loss are
    # priced by the bytes their CUDA kernels move; None: by their records' bytes
    kernel_passes: bool | None = Field(default=None, exclude_if=lambda v: v is None)
    # NOTE [random kernels] in slackswap.core.costmodel: random numbers per second a kernel
    # that draws them (dropout) makes at most; None: such kernels priced by their bytes
    random_elements_per_s: Positive | None = Field(default=None, exclude_if=lambda v: v is None)

    _table = pydantic.field_validator("bandwidth_efficiency")(_check_table)

    @pydantic.field_validator("reduction_bandwidth_efficiency")
    @classmethod
    def _reduction_table(cls, table: StepTable | None) -> StepTable | None:
        return None if table is None else _check_table(table)


class HostLink(_Strict):
    kind: str
    d2h_bandwidth: Positive
    h2d_bandwidth: Positive
    duplex_d2h_bandwidth: Positive
    duplex_h2d_bandwidth: Positive
    latency_s: Seconds
    # "copy": the copy engines move offloads while kernels run (the runtime's side
    # streams); "compute": each copy runs on the compute stream, between kernels, as
    # PyTorch's activation-offloading pass issues them (``sim.schedule.on_compute_stream``)
    stream: Literal["copy", "compute"] = "copy"


# NOTE [host costs]
#     What the host (CPU) spends issuing the step (the simulator's host, NOTE [host model]
#     in ``slackswap.sim.host``). ``dispatch_s`` is eager PyTorch's own cost per op; a
#     preset's [host] table sets it with a source. The runtime's own costs were measured
#     once, on one machine, and live here only: the defaults below, with their sources
#     in ``HOST_SOURCES``, which a hardware file takes for every field its [host] table
#     leaves out (a file without [host] gets them all; ``dispatch_s`` defaults to the
#     presets' value). Set a field to 0 to leave that cost out.
_DISPATCH_S = 7e-6
# NOTE [copy costs]
#     Issuing a copy costs the host the runtime's Python and the device calls it makes
#     (a stream switch, events, the copy; a reload also a device buffer): ``offload_s``
#     per offload, paid by the pack that issues it, and ``reload_s`` per reload, paid
#     where the host reaches its prefetch point. Those calls' costs are the GPU host's
#     and its driver's, so they are a preset's figures, not defaults: a table that
#     leaves them out counts nothing for them (the presets but ``h200``, whose figures
#     are ``benchmarks/host_work.py``'s counts priced with the H200's per-call costs).
# The runtime's own costs, measured (sources below): change them here only. Each is the
# mean of two runs of the benchmark's "[host] figures" line, which says how it splits them.
_PACK_S, _UNPACK_S, _WATCH_S, _REPLAY_S = 34e-6, 7e-6, 83e-6, 31e-6
_MACHINE = ("this project's 2-core CPU machine, 2026-11-30, one thread (a slow CPU: an upper "
            "estimate for a GPU host)")
_BENCH = ("`python benchmarks/runtime_overhead.py --steps 50` (gpt2-xl-tiny, traced, fp32, "
          f"side by side with plain eager, 68 saves and 104 watched ops a step) on {_MACHINE}, "
          "mean of two runs")
# Not a measured figure: which stream the copies run on is how the offloads are issued.
STREAM_SOURCE = (
    "default \"copy\": slackswap's runtime issues copies on side streams, which the GPU's "
    "copy engines run while kernels run (runtime/copies.py); \"compute\" is what PyTorch's "
    "activation-offloading pass issues on its synchronous path (prims.device_put in "
    "torch/_functorch/_activation_offloading, torch 2.13), set by slackswap.compile.")
HOST_SOURCES: dict[str, str] = {
    "dispatch_s": (
        "pytorch/pytorch issue #41383 (Large overhead (7 microseconds) for PyTorch "
        "operation, 2020): 1e6 calls of 2*x on a one-element CPU tensor that requires grad "
        "take 6.8 s, ~7 us per op of Python, autograd and dispatcher (a maintainer notes "
        "scalar operands are slow: x*x without grad about 2 us); meta-pytorch/autoparallel "
        "PR #146 (Use better cost model for compute, 2025): a launch overhead fitted on "
        "H100 runs makes every operator cost at least 7 us; facebookresearch/"
        "HolisticTraceAnalysis docs cuda_kernel_launch_stats.rst: the CPU side of a "
        "launch is usually 5-20 us. 7 us taken, paid by forward and backward ops alike "
        "(the C++ autograd engine's backward dispatch is cheaper: an upper estimate)."),
    "pack_s": (
        f"{_BENCH}: (keep-all forward - plain forward) / saves = 31.3 and 36.7 us; it "
        "holds the block's per-step setup too, charged to the packs."),
    "unpack_s": (
        f"{_BENCH}: (keep-all backward - plain backward) / saves = 3.1 and 11.0 us "
        "(unpacks of kept tensors; a moved tensor's unpack does more, not measured apart)."),
    "watch_s": (
        f"{_BENCH}: (all-recompute forward - keep-all forward) / watched ops = 76.3 and "
        "88.8 us: the dispatch mode (an empty TorchDispatchMode adds about 15 us a "
        "dispatch here), calling each op from Python, recording its recipe, and the "
        "costlier packs of moved tensors."),
    "replay_s": (
        f"{_BENCH}: (all-recompute backward - keep-all backward) / replayed ops, less a "
        "plain forward op's mean time (the replayed kernel) = 36.1 and 26.1 us."),
}


class Host(_Strict):
    """Host seconds spent issuing the step (NOTE [host costs]); each is >= 0."""

    dispatch_s: Seconds = _DISPATCH_S  # per op, any phase: eager dispatch and launch
    pack_s: Seconds = _PACK_S  # per tensor autograd saves in forward, under a plan
    watch_s: Seconds = _WATCH_S  # per forward op the runtime watches
    replay_s: Seconds = _REPLAY_S  # per op replayed to recompute, on top of dispatch_s
    unpack_s: Seconds = _UNPACK_S  # per moved saved tensor unpacked in backward
    # NOTE [copy costs]: per offload issued in forward, per reload issued in backward
    offload_s: Seconds = Field(default=0.0, exclude_if=lambda v: v == 0)
    reload_s: Seconds = Field(default=0.0, exclude_if=lambda v: v == 0)


class Node(_Strict):
    """The server a GPU sits in, as far as offloading shares it (NOTE [the node])."""

    gpus: Annotated[int, Field(ge=1)]
    gpus_per_link: Annotated[int, Field(ge=1)]  # GPUs behind one uplink to the CPUs
    host_memory_bytes: Positive  # installed host memory, all sockets
    host_memory_bandwidth: Positive  # DRAM bandwidth, all sockets, bytes/s

    @pydantic.model_validator(mode="after")
    def _links(self) -> Node:
        if self.gpus % self.gpus_per_link:
            raise ValueError("gpus must be a multiple of gpus_per_link")
        return self


# NOTE [the node]
#     Data-parallel ranks (DDP, FSDP2) run one plan in lockstep, so their offloads and
#     reloads happen at once: GPUs behind one PCIe switch share its uplink, and all of
#     them share the host's DRAM bandwidth and memory. :func:`on_node` turns a node
#     preset into the hardware one of ``n`` such ranks sees: each link rate divided among
#     the ranks on that uplink (ranks spread over the uplinks evenly) and capped at its
#     share of DRAM bandwidth; ``ranks`` records ``n``, so the simulator checks that the
#     host memory every rank pins (its offloaded bytes) fits the node's memory.


class Hardware(_Strict):
    """One GPU and its host link, as the cost model and the simulator see it; ``node``,
    when given, the server it sits in, and ``ranks`` how many of its GPUs run the step
    in lockstep (see :func:`on_node`)."""

    schema_version: int = 1
    name: str
    description: str = ""
    kernels: Literal["cuda", "native"] = "cuda"
    # which memory-bound ops are kernels of their own (NOTE [stacks] in core/costmodel.py)
    stack: Literal["eager", "fused"] = "eager"
    compute: Compute
    memory: Memory
    host_link: HostLink
    host: Host = Host()
    node: Node | None = None
    ranks: Annotated[int, Field(ge=1)] = 1
    sources: dict[str, str] = {}

    @pydantic.model_validator(mode="after")
    def _host_sources(self) -> Hardware:
        """Host costs a file leaves out take the defaults, and cite the defaults' sources.
        (After validation, from the fields each table was given: a validator before it
        would hand the fields on as Python objects, which strict validation, NOTE [strict
        types] in ``slackswap.core.jsonio``, reads otherwise than JSON.)"""
        given = self.host.model_fields_set if "host" in self.model_fields_set else set()
        sources = dict(self.sources)
        for name, source in HOST_SOURCES.items():
            if name not in given:
                sources.setdefault(f"host.{name}", f"default (NOTE [host costs]): {source}")
        if "stream" not in self.host_link.model_fields_set:
            sources.setdefault("host_link.stream", STREAM_SOURCE)
        object.__setattr__(self, "sources", sources)  # (frozen: set once, here)
        return self

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (fp32 matmuls run without TF32, as PyTorch's default)."""
        return self.compute.peak_flops.get(dtype, self.compute.peak_flops["fp32"])


def hardware_presets() -> list[str]:
    """Names of the hardware presets shipped with SlackSwap."""
    folder = resources.files("slackswap") / "hardware" / "presets"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


# The largest hardware file read, and the longest chain of ``base`` files.
MAX_HARDWARE_BYTES = 2**20
MAX_BASES = 8


def _parse(text: str, source: str, bases: tuple[str, ...] = (),
           folder: Path | None = None) -> Hardware:
    """A hardware file's text; ``bases``: the files whose ``base`` led here; ``folder``:
    the file's, where a relative ``base`` path is (None: a preset's)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{source}: not valid TOML ({e})") from None
    except RecursionError:
        raise InputError(f"{source}: nested too deeply to be a hardware file") from None
    base = data.pop("base", None)
    if base is not None:  # a node preset: a GPU preset's fields, and its own on top
        if not isinstance(base, str) or not base:
            raise InputError(f"{source}: base must be a preset name or a .toml file's path "
                             f"in quotes, not {base!r}")
        if folder is not None and not _is_preset(base) and not Path(base).is_absolute():
            # beside the file that names it, as a reader of the file expects, not in the
            # working folder, where a file of that name may be anyone's (NOTE [files])
            base = str(folder / base)
        chain = (*bases, source)
        if base in chain or f"preset {base}" in chain or str(Path(base)) in chain:
            raise InputError(f"{source}: base '{base}' leads back to itself "
                             f"({' -> '.join(chain)} -> {base}); name another base")
        if len(chain) > MAX_BASES:
            raise InputError(f"{source}: more than {MAX_BASES} files deep in bases; "
                             "name a preset as base")
        parent = _load(base, chain).model_dump(exclude={"name", "description", "node",
                                                         "ranks"})
        sources = data.get("sources", {})
        if not isinstance(sources, dict):
            raise InputError(f"{source}: field 'sources': must be a table of strings")
        data = {**parent, **data, "sources": {**parent["sources"], **sources}}
    return validate_model(Hardware, data, source)


# NOTE [assumed hardware]
#     A step is priced, and offloads are planned, for one GPU. A user who names none gets
#     DEFAULT_HARDWARE (the paper's A100), said once in a ``HardwareNotice``; ``auto``
#     names the GPU this process sees (``slackswap.profiling.machine``), mapped to a
#     preset by its device name with ``preset_for_gpu``, where a CPU-only process is
#     told which preset it gets. Never silently: the figures differ a lot between GPUs.
DEFAULT_HARDWARE = "a100-80gb"
AUTO = "auto"
# (pattern in torch.cuda.get_device_name(), preset), first match wins: GH200 before H200,
# L40S before L4. A GPU that matches none has no preset: its user writes a hardware file.
_GPU_PRESETS = (
    (r"GH200", "gh200"),
    (r"H200", "h200"),
    (r"H100 PCIe", "h100-pcie"),
    (r"H100 80GB HBM3|H100 SXM", "h100-sxm"),
    (r"A100.*80\s*GB", "a100-80gb"),
    (r"A100.*40\s*GB", "a100-40gb"),
    (r"L40S", "l40s"),
    (r"\bL4\b", "l4"),
    (r"A10G", "a10g"),
    (r"RTX 4090", "rtx-4090"),
    (r"RTX 6000 Ada", "rtx-6000-ada"),
)
_NOTICED: set[str] = set()


def preset_for_gpu(device_name: str) -> str | None:
    """The preset for a GPU by its device name (``torch.cuda.get_device_name()``, e.g.
    ``NVIDIA L40S``); None when no preset describes it."""
    return next((preset for pattern, preset in _GPU_PRESETS
                 if re.search(pattern, device_name)), None)


def notice(message: str) -> None:
    """Say ``message`` (which hardware is assumed) once per process, as a
    :class:`HardwareNotice` warning."""
    if message not in _NOTICED:
        _NOTICED.add(message)
        warnings.warn(message, HardwareNotice, stacklevel=3)


def default_hardware() -> Hardware:
    """The hardware of a step whose user named none (NOTE [assumed hardware]), said."""
    hw = load_hardware(DEFAULT_HARDWARE)
    notice(f"no hardware given: planning for preset {hw.name} ({hw.description}); pass "
           "hardware= (--hardware) a preset, a hardware file, or 'auto' for this "
           "machine's GPU")
    return hw


def load_hardware(spec: str | Path | Hardware,
                  overrides: Mapping[str, Any] | None = None) -> Hardware:
    """A preset by name (see :func:`hardware_presets`), ``NODE/N`` for one of N ranks of
    a node preset (:func:`on_node`), or a TOML file by path; ``overrides`` replace some of
    its figures (:func:`with_overrides`)."""
    if overrides:
        return with_overrides(load_hardware(spec), overrides)
    if isinstance(spec, Hardware):
        return spec
    return _load(spec, ())


def profile_hardware(name: str) -> Hardware:
    """The hardware a profile names: a preset (or ``NODE/N``), never a file (NOTE
    [files]): a file is read only when the user names it."""
    names = hardware_presets()
    node, _, gpus = name.rpartition("/")
    if name in names or (node in names and gpus.isdigit()):
        return _load(name, ())
    shown = name if len(name) <= 60 and name.isprintable() else f"{name[:60]!r}..."
    raise InputError(f"the profile's hardware '{shown}' is not a preset (presets: "
                     f"{', '.join(names)}); a profile names presets only: pass the "
                     "hardware (--hardware, or hardware= in Python)")


def _is_file(spec: str | Path) -> bool:
    try:
        return "\0" not in str(spec) and Path(spec).exists()
    except (OSError, ValueError):
        return False


def _is_preset(spec: str | Path) -> bool:
    """Whether ``spec`` names a preset (or ``NODE/N``): a name given as a string, never a
    ``Path``."""
    if isinstance(spec, Path):
        return False
    names = hardware_presets()
    node, _, gpus = spec.rpartition("/")
    return spec in names or (node in names and gpus.isdigit())


def _load(spec: str | Path, bases: tuple[str, ...]) -> Hardware:
    path = Path(spec)
    # a preset's name is the preset, even where a file of that name is in the working
    # folder: one planted there ("a100-80gb") would replace the figures of every command
    # run in it, the default hardware's included (NOTE [files]); ./a100-80gb names it
    if not _is_preset(spec) and (path.suffix == ".toml" or _is_file(spec)):
        return _parse(read_file(path, "hardware file", MAX_HARDWARE_BYTES), str(path),
                      bases, path.parent)
    names = hardware_presets()
    node, _, gpus = str(spec).rpartition("/")
    if node in names and gpus.isdigit():  # "dgx-a100/8", as on_node names a node's rank
        return on_node(load_hardware(node), int(gpus))
    if str(spec) == AUTO:
        raise InputError("hardware 'auto' is this machine's GPU, which only a step run "
                         "here sees: pass it where a model is profiled or planned "
                         "(slackswap.plan(model, ...), slackswap.profile, the command line)")
    base, plus, _ = str(spec).partition("+")
    if plus and base in names:  # as with_overrides names it: the values are not in the name
        raise InputError(f"hardware '{spec}' is '{base}' with overrides: pass --hardware "
                         f"{base} and the same --set options")
    if str(spec) not in names:
        raise InputError(
            f"unknown hardware '{spec}'; presets: {', '.join(names)} (or a path to a .toml file)"
        )
    folder = resources.files("slackswap") / "hardware" / "presets"
    return _parse((folder / f"{spec}.toml").read_text(encoding="utf-8"), f"preset {spec}",
                  bases)


def on_node(hw: Hardware, gpus: int) -> Hardware:
    """``hw`` as one of ``gpus`` ranks of its node running one plan in lockstep (NOTE [the
    node]); ``gpus=1`` is ``hw`` itself."""
    if gpus == 1:
        return hw
    node = hw.node
    if node is None:
        nodes = [n for n in hardware_presets() if load_hardware(n).node is not None]
        raise InputError(
            f"hardware '{hw.name}' describes one GPU, not a node: for {gpus} GPUs use a "
            f"node preset ({', '.join(nodes)}) or add a [node] table to a hardware file"
        )
    if not 1 <= gpus <= node.gpus:
        raise InputError(f"{hw.name} has {node.gpus} GPUs, not {gpus}")
    links = node.gpus // node.gpus_per_link
    per_link = -(-gpus // links)  # ranks on the busiest uplink
    dram = node.host_memory_bandwidth / gpus  # each rank's share, both directions
    link = hw.host_link
    duplex = min(1 / per_link,
                 dram / (link.duplex_d2h_bandwidth + link.duplex_h2d_bandwidth))
    shared = link.model_copy(update={
        "d2h_bandwidth": min(link.d2h_bandwidth / per_link, dram),
        "h2d_bandwidth": min(link.h2d_bandwidth / per_link, dram),
        "duplex_d2h_bandwidth": link.duplex_d2h_bandwidth * duplex,
        "duplex_h2d_bandwidth": link.duplex_h2d_bandwidth * duplex,
    })
    return hw.model_copy(update={
        "name": f"{hw.name}/{gpus}", "ranks": gpus, "host_link": shared,
        "description": f"{hw.description}, {gpus} of its GPUs running in lockstep"})


# NOTE [hardware overrides]
#     A study of what the result depends on ("with a link that loses nothing in duplex")
#     changes a figure or two of a preset without copying its file. ``with_overrides``
#     takes ``{"table.field": value}`` (``compute.peak_flops.bf16`` reaches into a
#     mapping), validates the result as a file is validated, records each new value in
#     ``sources`` and the description, and renames the hardware ``<name>+<n> override(s)``:
#     results never pass it off as the preset, and ``cached_profile`` hashes its content,
#     so profiles made with and without the overrides never mix.
_OVERRIDABLE = ("compute", "memory", "host_link", "host", "node")
_OVERRIDABLE_TOP = ("stack",)  # fields outside the tables: ``--set stack=fused``


def with_overrides(hw: Hardware, overrides: Mapping[str, Any]) -> Hardware:
    """``hw`` with the figures in ``overrides`` (``{"host_link.duplex_h2d_bandwidth":
    24.8e9}``) replaced, validated like a hardware file (NOTE [hardware overrides])."""
    if not overrides:
        return hw
    data = hw.model_dump()
    for key, value in overrides.items():
        table, *path = key.split(".")
        if key in _OVERRIDABLE_TOP:
            table, path, where = key, [key], data
        else:
            where = data.get(table) if table in _OVERRIDABLE else None
        if not path or not isinstance(where, dict):
            tables = ", ".join(t for t in _OVERRIDABLE if data.get(t) is not None)
            raise InputError(f"unknown hardware field '{key}'; use TABLE.FIELD with TABLE one "
                             f"of {tables} (as in the hardware file), or "
                             f"{', '.join(_OVERRIDABLE_TOP)}")
        for part in path[:-1]:
            where = where.get(part)
            if not isinstance(where, dict):
                raise InputError(f"unknown hardware field '{key}'")
        if path[-1] not in where:
            parent = ".".join([table, *path[:-1]])
            raise InputError(f"unknown hardware field '{key}'; {parent} has "
                             f"{', '.join(where)}")
        where[path[-1]] = value
        data["sources"][key] = (f"overridden: {value!r} in place of {hw.name}'s value "
                                f"({hw.sources.get(key, 'no source')})")
    n = len(overrides)
    data["name"] = f"{hw.name}+{n} override{'s' if n > 1 else ''}"
    data["description"] = (f"{hw.description}; overridden: "
                           + ", ".join(f"{k}={v!r}" for k, v in overrides.items()))
    try:  # strictly, as a file is (NOTE [strict types] in ``slackswap.core.jsonio``)
        return Hardware.model_validate_json(json.dumps(data, default=str), strict=True)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        key = next((k for k in overrides if field == k or field.startswith(k + ".")), field)
        raise InputError(f"hardware override {key}={overrides.get(key)!r}: {err['msg']}") from None


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` as the command line's ``--set`` gives them: each value read as
    a TOML value (``24.8e9``, ``[[0, 1.0]]``, ``"pcie5"``), or as a string when it is none."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise InputError(f"--set {item}: expected KEY=VALUE, e.g. "
                             "host_link.duplex_h2d_bandwidth=24.8e9")
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        out[key.strip()] = value
    return out
