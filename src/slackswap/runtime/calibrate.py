"""``slackswap calibrate``: the host link and the host's costs of the machine it runs on,
measured, and a hardware file that carries them.

NOTE [calibration]
    Measuring and writing are apart: :func:`measure` needs a CUDA GPU and returns a
    :class:`Calibration` (plain numbers); :func:`calibrated_hardware` puts those numbers
    into a base hardware (a preset, a file, or ``auto``'s pick), replacing only the
    fields measured, each with a ``[sources]`` line naming the device, the date and the
    torch version; :func:`write_hardware` writes the file (atomically, never through a
    link, an existing file only when forced). What is measured:

    - the host link as the runtime drives it: pinned host buffers, copies on the D2H and
      H2D side streams of :class:`~slackswap.runtime.streams.Link`, each direction alone
      and both at once (``host_link.{d2h,h2d,duplex_d2h,duplex_h2d}_bandwidth``);
    - ``host.dispatch_s``: the host time of one small eager op that autograd records,
      as NOTE [host costs] prices each op of the step;
    - the host cost of each device call the runtime makes (:func:`device_call_costs`),
      which ``benchmarks/host_work.py --costs`` prices the runtime's copies with (its
      ``[host] offload_s, reload_s`` line); they are no field of a hardware file.

    The runtime's own per-item costs (``pack_s``, ``unpack_s``, ``watch_s``,
    ``replay_s``, ``offload_s``, ``reload_s``) need a model's step: they stay the
    base's (``benchmarks/runtime_overhead.py --device cuda`` and ``host_work.py``).
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slackswap.core.hardware import Hardware
from slackswap.core.hwtemplate import hardware_toml
from slackswap.core.jsonio import atomic_write_text, json_text
from slackswap.errors import InputError
from slackswap.runtime.streams import Link, bytes_of

__all__ = ["Calibration", "measure", "link_rates", "device_call_costs", "dispatch_cost",
           "calibrated_hardware", "write_hardware", "write_costs", "refuse_existing",
           "require_gpu", "LINK_FIELDS"]

# the hardware fields a calibration measures, by its attribute names
LINK_FIELDS = ("d2h_bandwidth", "h2d_bandwidth", "duplex_d2h_bandwidth",
               "duplex_h2d_bandwidth")


@dataclass(frozen=True)
class Calibration:
    """What :func:`measure` found: link rates in bytes/s, ``dispatch_s`` in seconds,
    ``call_costs_us`` the runtime's device calls' host costs in microseconds."""

    device: str
    torch_version: str
    date: str  # ISO 8601, the day measured
    d2h_bandwidth: float
    h2d_bandwidth: float
    duplex_d2h_bandwidth: float
    duplex_h2d_bandwidth: float
    dispatch_s: float
    copy_bytes: int = 256 << 20
    repeats: int = 8
    call_costs_us: dict[str, float] = field(default_factory=dict)

    def costs_record(self) -> dict[str, object]:
        """The per-call costs as ``benchmarks/host_work.py --costs`` reads them."""
        return {"machine": self.device, "torch": self.torch_version, "date": self.date,
                "source": "slackswap calibrate (1 MiB copies)",
                "costs_us": dict(self.call_costs_us)}


def require_gpu() -> str:
    """This process's CUDA device's name; an :class:`InputError` without one."""
    if not torch.cuda.is_available():
        raise InputError("calibrate measures a CUDA GPU and this machine has none (or "
                         "torch was built without CUDA); run it on the GPU machine")
    return torch.cuda.get_device_name()


def link_rates(nbytes: int, repeats: int, d2h: bool, h2d: bool,
               compute: bool = False) -> tuple[float, float]:
    """Bytes/s of each direction (0 where it is off): ``repeats`` copies of ``nbytes``
    between pinned host buffers and the device, on the runtime's side streams (a
    :class:`~slackswap.runtime.streams.Link`); ``compute``: a bf16 matmul runs on the
    compute stream meanwhile."""
    device = torch.device("cuda", torch.cuda.current_device())
    link = Link(device)
    src_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) if compute else None
    torch.cuda.synchronize()
    marks = {}
    for name, on, stream in (("d2h", d2h, link.d2h), ("h2d", h2d, link.h2d)):
        if not on:
            continue
        with link.issuing_on(stream):
            start, end = link.event(timing=True), link.event(timing=True)
            start.record(stream)
            for _ in range(repeats):
                if name == "d2h":
                    host_out.copy_(src_dev, non_blocking=True)
                else:
                    dst_dev.copy_(host_in, non_blocking=True)
            end.record(stream)
            marks[name] = (start, end)
    if a is not None:
        for _ in range(20):
            a @ a
    torch.cuda.synchronize()
    out = {name: nbytes * repeats / (start.elapsed_time(end) / 1e3)
           for name, (start, end) in marks.items()}
    return out.get("d2h", 0.0), out.get("h2d", 0.0)


def _per_call_us(call: Callable[[], object], repeats: int) -> float:
    """Host microseconds of one ``call``, in a loop of ``repeats`` after a warm-up."""
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(repeats):
        call()
    seconds = time.perf_counter() - begin
    torch.cuda.synchronize()
    return 1e6 * seconds / repeats


def device_call_costs(repeats: int = 2000) -> dict[str, float]:
    """Host microseconds of each device call the runtime makes (the names
    ``benchmarks/host_work.py`` counts them by), timed on this CUDA GPU."""
    device = torch.device("cuda", torch.cuda.current_device())
    link = Link(device)
    small = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    event = link.event()
    event.record(link.compute)
    torch.cuda.synchronize()

    def switch() -> None:
        with link.issuing_on(link.d2h):
            pass

    calls = {
        "current_stream": lambda: torch.cuda.current_stream(device),
        "stream_switch": switch,
        "new_event": link.event,
        "event_record": lambda: event.record(link.compute),
        "event_query": event.query,
        # a finished copy's event, as a pooled host buffer's last copy is by then
        # (NOTE [links kept across steps] in benchmarks/host_work.py)
        "event_synchronize": event.synchronize,
        "wait_event": lambda: link.compute.wait_event(event),
        "copy": lambda: link.copy(host, small),  # a tensor's copy
        "byte_view": lambda: bytes_of(small),  # NOTE [a tensor's copy, not its storage's]
        "copy_storage": lambda: host.untyped_storage().copy_(small.untyped_storage(),
                                                             non_blocking=True),
        "device_empty": lambda: link.empty(small.shape, small.dtype),
    }
    return {key: round(_per_call_us(call, repeats), 2) for key, call in calls.items()}


def dispatch_cost(repeats: int = 2000, rounds: int = 5) -> float:
    """Host seconds of one small eager op that autograd records on this GPU (``2 * x``
    on a one-element tensor that requires grad, NOTE [host costs]'s source's op): the
    median of ``rounds`` loops."""
    x = torch.ones(1, device="cuda", requires_grad=True)
    return 1e-6 * statistics.median(_per_call_us(lambda: 2 * x, repeats)
                                    for _ in range(rounds))


def measure(copy_bytes: int = 256 << 20, repeats: int = 8,
            progress: Callable[[str], None] | None = None) -> Calibration:
    """The host link and the host's costs of this machine's CUDA GPU (NOTE
    [calibration]); an :class:`InputError` without one."""
    device = require_gpu()
    say = progress or (lambda _text: None)
    say("warming up the link")
    link_rates(copy_bytes, 2, True, True)
    say("device to host")
    d2h, _ = link_rates(copy_bytes, repeats, True, False)
    say("host to device")
    _, h2d = link_rates(copy_bytes, repeats, False, True)
    say("both directions at once")
    duplex_d2h, duplex_h2d = link_rates(copy_bytes, repeats, True, True)
    say("the host's costs")
    dispatch_s = dispatch_cost()
    costs = device_call_costs()
    return Calibration(device=device, torch_version=torch.__version__,
                       date=datetime.date.today().isoformat(), d2h_bandwidth=d2h,
                       h2d_bandwidth=h2d, duplex_d2h_bandwidth=duplex_d2h,
                       duplex_h2d_bandwidth=duplex_h2d, dispatch_s=dispatch_s,
                       copy_bytes=copy_bytes, repeats=repeats, call_costs_us=costs)


def calibrated_hardware(base: Hardware, cal: Calibration, name: str | None = None) -> Hardware:
    """``base`` with the fields ``cal`` measured replaced, each citing the measurement in
    ``sources``; named ``name`` (default ``<base>-calibrated``)."""
    where = (f"measured by `slackswap calibrate` on {cal.device}, {cal.date}, torch "
             f"{cal.torch_version}")
    copies = (f"pinned host buffers, {cal.copy_bytes >> 20} MiB copies x {cal.repeats} on "
              "the runtime's side streams")
    what = {"d2h_bandwidth": "device to host alone",
            "h2d_bandwidth": "host to device alone",
            "duplex_d2h_bandwidth": "device to host while host to device runs",
            "duplex_h2d_bandwidth": "host to device while device to host runs"}
    link = {f: getattr(cal, f) for f in LINK_FIELDS}
    sources = dict(base.sources)
    for f, value in link.items():
        sources[f"host_link.{f}"] = f"{where} ({copies}): {what[f]} {value / 1e9:.1f} GB/s."
    sources["host.dispatch_s"] = (
        f"{where}: host time of one eager op autograd records (2 * x on a one-element "
        f"CUDA tensor that requires grad), median of 5 loops of 2000: "
        f"{cal.dispatch_s * 1e6:.1f} us.")
    data = base.model_dump()
    data["host_link"].update(link)
    data["host"]["dispatch_s"] = cal.dispatch_s
    data["sources"] = sources
    data["name"] = name or f"{base.name}-calibrated"
    data["description"] = (f"{base.description}; host link and dispatch cost {where}")
    data.pop("ranks", None)
    return Hardware.model_validate(data)


def write_hardware(hw: Hardware, path: str | os.PathLike[str], force: bool = False) -> None:
    """Write ``hw`` as a hardware file at ``path`` (atomically, never through a link,
    NOTE [files]); an existing file only with ``force``."""
    refuse_existing(path, force)
    atomic_write_text(path, hardware_toml(hw))


def write_costs(cal: Calibration, path: str | os.PathLike[str], force: bool = False) -> None:
    """Write ``cal``'s per-call host costs as JSON at ``path`` (as :func:`write_hardware`
    writes), in the form ``benchmarks/host_work.py --costs`` reads."""
    refuse_existing(path, force)
    atomic_write_text(path, json_text(cal.costs_record(), os.fspath(path), indent=2) + "\n")


def refuse_existing(path: str | os.PathLike[str], force: bool) -> None:
    """An :class:`InputError` when ``path`` exists and ``force`` is not given (checked
    before measuring, so no measurement is thrown away)."""
    if not force and os.path.lexists(path):
        raise InputError(f"{Path(path)} exists; pass --force to replace it, or name "
                         "another file")
