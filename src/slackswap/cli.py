"""The ``slackswap`` command line: parses options, calls the library, prints results."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from slackswap.core.hardware import (
    AUTO,
    Hardware,
    hardware_presets,
    load_hardware,
    on_node,
    parse_overrides,
    profile_hardware,
    with_overrides,
)
from slackswap.core.jsonio import dump_model, json_text, refuse_unwritable
from slackswap.core.profile import StepProfile
from slackswap.core.units import format_bytes
from slackswap.device_budget import OPTIMIZERS, PRECISIONS, device_budget, is_fit
from slackswap.errors import HardwareNotice, InputError, SlackSwapError
from slackswap.planners import STRATEGIES

__all__ = ["main"]

_err = Console(stderr=True)
# NOTE [piped width]: rich lays out for 80 columns when stdout is no terminal, cutting
# tables (and wrapping lines) that a file or a pipe would hold whole; piped output is
# laid out this wide instead, unless $COLUMNS says otherwise.
_PIPED_WIDTH = 400


def _console() -> Console:
    """A console for stdout: the terminal's width, or NOTE [piped width]'s."""
    out = Console()
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(width=_PIPED_WIDTH)
    return out


def _plain(text: object, limit: int = 120) -> str:
    """``text`` as a line of plain text: control characters written as escapes (``\\x1b``),
    cut to about ``limit`` characters (a name from a file may be anything, and long)."""
    line = str(text)
    if len(line) > limit:
        line = line[: limit - 3] + "..."
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)


def _shown(text: object, limit: int = 120) -> str:
    """``text`` from a file or the user, to print through rich: plain (:func:`_plain`)
    and never read as markup."""
    return escape(_plain(text, limit))


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Print a :class:`SlackSwapError`, or a file the system refused, as one line and exit
    2, with no traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with warnings.catch_warnings():
                warnings.showwarning = _one_line_warning
                return fn(*args, **kwargs)
        except SlackSwapError as e:
            click.echo(f"error: {_plain(e, 2000)}", err=True)
        except OSError as e:
            click.echo(f"error: {_plain(e.filename or 'a file')}: {e.strerror or e}", err=True)
        sys.exit(2)

    return wrapper


def _one_line_warning(message: Warning | str, category: type[Warning], *args: Any,
                      **kwargs: Any) -> None:
    """A warning from SlackSwap (a damaged cache entry, say) as one line on stderr."""
    if issubclass(category, HardwareNotice):  # which hardware is assumed: a note
        click.echo(f"note: {_plain(message, 2000)}", err=True)
    elif category.__module__.startswith("slackswap"):
        click.echo(f"warning: {_plain(message, 2000)}", err=True)
    else:
        _show_warning(message, category, *args, **kwargs)


_show_warning = warnings.showwarning


def _check_outputs(outputs: dict[str, str | None], inputs: list[str | None]) -> None:
    """Refuse, before any work, an output that is one of the inputs (``plan p.json -o
    p.json`` would replace the profile) or another output, one that is no file to
    replace (a link, a folder, a FIFO: refused when written, after the work), and a
    plot not named .png."""
    def same(a: str, b: str) -> bool:
        try:
            return os.path.samefile(a, b)
        except (OSError, ValueError):
            return os.path.abspath(a) == os.path.abspath(b)

    named = [(option, path) for option, path in outputs.items() if path]
    for i, (option, path) in enumerate(named):
        refuse_unwritable(path)
        for given in filter(None, inputs):
            if same(path, given):
                raise InputError(f"{option} {_plain(path)} is an input of this command: it "
                                 "would be replaced; name another file")
        for other, second in named[:i]:
            if same(path, second):
                raise InputError(f"{option} and {other} name the same file "
                                 f"{_plain(path)}; name two files")
        if option == "--plot" and Path(path).suffix.lower() not in ("", ".png"):
            raise InputError(f"--plot {_plain(path)}: the plot is a PNG image; name a .png "
                             "file")


@contextlib.contextmanager
def _progress(message: str) -> Iterator[Callable[[str], None]]:
    """A spinner on a terminal, with an updater for its message; silent when piped."""
    if _err.is_terminal:
        with _err.status(message) as status:
            yield lambda text: status.update(f"{message}: {text}")
    else:
        yield lambda text: None


@contextlib.contextmanager
def _progress_bar(message: str, total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar of ``total`` steps on a terminal: each update starts the next step
    and says what it does; silent when piped."""
    if not _err.is_terminal:
        yield lambda text: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=_err, transient=True) as bar:
        task = bar.add_task(message, total=total)
        started = False

        def update(text: str) -> None:
            nonlocal started
            bar.update(task, description=f"{message}: {text}", advance=1 if started else 0)
            started = True

        yield update


def _gpus_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--gpus", type=click.IntRange(min=1), default=1, show_default=True,
        help="GPUs of a node preset (dgx-a100, dgx-h200) running the step in lockstep: "
             "they share host links and host memory.")(fn)


def _hardware(spec: str | Hardware | None, overrides: dict[str, Any]) -> Hardware:
    """The hardware ``--hardware`` names, ``--set`` applied: a preset, a file, ``auto``
    (this machine's GPU), or when not given the default, said on stderr (NOTE [assumed
    hardware] in ``slackswap.core.hardware``)."""
    if spec is None or spec == AUTO:
        from slackswap.profiling.machine import resolve_hardware  # (imports torch)

        return with_overrides(resolve_hardware(spec), overrides)
    return load_hardware(spec, overrides)


def _loss_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--loss", metavar="MODULE:FUNCTION",
        help="The loss of a package.module:factory MODEL whose output carries none: "
             "FUNCTION(output) returns the scalar loss tensor backward starts from.")(fn)


def _loss_fn(model: str, loss: str | None) -> Callable[[Any], Any] | None:
    """The function ``--loss`` names, for a factory MODEL (a preset computes its own)."""
    if loss is None:
        return None
    if ":" not in model:
        raise InputError(f"--loss applies to a package.module:factory MODEL; preset "
                         f"'{_plain(model)}' computes its own loss")
    from slackswap.models import load_loss

    return load_loss(loss)


def _set_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--set", "overrides", multiple=True, metavar="KEY=VALUE",
        help="Replace one figure of the hardware, as TABLE.FIELD=VALUE in the hardware "
             "file's terms, e.g. host_link.duplex_h2d_bandwidth=24.8e9 (repeatable).")(fn)


@click.group()
@click.version_option(package_name="slackswap")
def main() -> None:
    """Fit training activations in GPU memory: offload within hidden transfer time,
    recompute the rest."""


@main.command()
@click.argument("model")
@click.option("--hardware", default="a100-80gb", show_default=True,
              help="Hardware: a preset (slackswap hardware lists them), a .toml file "
                   "(slackswap hardware --template writes one to fill in), or auto: this "
                   "machine's GPU's preset.")
@click.option("--batch", type=int, help="Batch size (presets only).")
@click.option("--seq", type=int, help="Sequence length (presets only).")
@click.option("--attn", type=click.Choice(["sdpa", "eager"]), help="Attention (presets only).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), help="Presets only.")
@click.option("--mode", type=click.Choice(["analytic", "measured", "traced"]), default="analytic",
              show_default=True, help="Trace with fake tensors, or run and time a real step.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the profile JSON.")
@click.option("--summary", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@_loss_option
@_set_option
@_user_errors
def profile(model: str, hardware: str, batch: int | None, seq: int | None, attn: str | None,
            dtype: str | None, mode: str, output: str | None, as_json: bool,
            loss: str | None, overrides: tuple[str, ...]) -> None:
    """Profile one training step of MODEL: a preset or package.module:factory."""
    from slackswap.models import MODEL_PRESETS, load_workload
    from slackswap.profiling import default_device
    from slackswap.profiling import profile as run_profile

    _check_outputs({"-o": output}, [hardware])
    hw = _hardware(hardware, parse_overrides(overrides))
    if ":" not in model and model not in MODEL_PRESETS:
        load_workload(model)  # raises the error that lists the presets
    loss_fn = _loss_fn(model, loss)
    with _progress(f"profiling {model} ({mode}) for {hw.name}"):
        net, example = load_workload(model, batch=batch, seq=seq, attn=attn, dtype=dtype,
                                     fake=mode == "analytic", device=default_device())
        result = run_profile(net, example, hw, mode=mode, loss_fn=loss_fn, name=model)
    if output is not None:
        dump_model(result, output)
    if as_json:
        click.echo(json_text(result.summary(), "the summary"))
    else:
        _print_profile(result, output)


@main.command()
@click.argument("profile_path", metavar="PROFILE.json", type=click.Path(dir_okay=False))
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False),
              help="Plan JSON; keep-all when omitted.")
@click.option("--hardware", help="Hardware: a preset (slackswap hardware lists them), a .toml file "
                   "(slackswap hardware --template writes one to fill in), or auto: this "
                   "machine's GPU's preset. Default: the profile's.")
@click.option("--memory-limit", help="Bytes, a size such as 24GiB, or a fraction of the "
              "keep-all peak such as 0.5.")
@click.option("--trace", type=click.Path(dir_okay=False), help="Write a Perfetto trace JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a memory plot PNG.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@_gpus_option
@_set_option
@_user_errors
def simulate(profile_path: str, plan_path: str | None, hardware: str | None,
             memory_limit: str | None, trace: str | None, plot: str | None,
             as_json: bool, gpus: int, overrides: tuple[str, ...]) -> None:
    """Simulate one training step of a profile under a plan."""
    from slackswap.core.jsonio import load_model
    from slackswap.core.plan import Plan
    from slackswap.sim import simulate as run_simulation
    from slackswap.sim.outputs import write_memory_plot, write_trace

    _check_outputs({"--trace": trace, "--plot": plot}, [profile_path, plan_path, hardware])
    prof = load_model(StepProfile, profile_path)
    plan = load_model(Plan, plan_path) if plan_path else None
    hw = _hardware(hardware or profile_hardware(prof.hardware), parse_overrides(overrides))
    hardware = on_node(hw, gpus)
    result = run_simulation(prof, plan, hardware, memory_limit)
    if trace is not None:
        write_trace(result, trace)
    if plot is not None:
        Path(plot).parent.mkdir(parents=True, exist_ok=True)  # as -o and --trace do
        write_memory_plot(result, plot, keep_all=run_simulation(prof, None, hardware))
    if as_json:
        click.echo(json_text(result.model_dump(mode="json"), "the result"))
    else:
        _print_result(prof, result, trace, plot)
    if not result.feasible:
        sys.exit(1)


def _print_result(prof: StepProfile, result: Any, trace: str | None, plot: str | None) -> None:
    out = _console()
    status = ("feasible" if result.feasible else
              f"[red]INFEASIBLE[/red]: {_shown(result.infeasible_reason, 400)}")
    limit = (format_bytes(result.memory_limit_bytes) if result.memory_limit_bytes
             else "no limit")
    out.print(f"[bold]{_shown(prof.model)}[/bold], plan {_shown(result.strategy)}, {limit}: "
              f"{status}")
    table = Table(show_header=False)
    # an infeasible step stops where an allocation does not fit: the time it reached
    # there is no step time, and no retention follows from it
    step = (f"{result.step_time_s * 1e3:.2f} ms" if result.feasible else
            "none: infeasible, the step stops where an allocation does not fit")
    rows = [
        ("step time", f"{step} (ideal {result.ideal_step_time_s * 1e3:.2f} ms)"),
        ("throughput retained", f"{result.retention:.2%}" if result.feasible else "none"),
        ("peak activation memory", f"{format_bytes(result.peak_bytes)} "
                                   + ("" if result.feasible else "until it stopped ")
                                   + f"(keep-all {format_bytes(result.keep_all_peak_bytes)})"),
        ("weight gradients", f"{format_bytes(result.gradient_bytes)} (model state, "
                             "not in the peak)"),
        ("stalls", ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in result.stall_s.items())),
        ("offloaded / reloaded", f"{format_bytes(result.d2h_bytes)} / "
                                 f"{format_bytes(result.h2d_bytes)}"),
        ("busy", ", ".join(f"{k} {v:.0%}" for k, v in result.busy_fraction.items())),
    ]
    for row in rows:
        table.add_row(*row)
    out.print(table)
    for label, path in (("trace", trace), ("plot", plot)):
        if path:
            out.print(f"{label} written to {_shown(path, 400)}")


@main.command("plan")
@click.argument("source", metavar="PROFILE.json|MODEL")
@click.option("--budget", required=True, help="Fraction of the keep-all peak (0.5), bytes, "
              "a size such as 24GiB, or 'fit': the device's memory less the model states "
              "and the CUDA context.")
@click.option("--strategy", default="slackswap", show_default=True,
              help=f"One of {', '.join(STRATEGIES)}.")
@click.option("--hardware", help="Hardware: a preset (slackswap hardware lists them), a .toml file "
                   "(slackswap hardware --template writes one to fill in), or auto: this "
                   "machine's GPU's preset. Default: the profile's; for a MODEL, "
                   "a100-80gb, said on stderr.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the plan JSON.")
@click.option("--optimizer", type=click.Choice(list(OPTIMIZERS)),
              help="With --budget fit: the optimizer whose states the device holds "
                   "[default: adamw].")
@click.option("--precision", type=click.Choice(list(PRECISIONS)),
              help="With --budget fit: mixed (fp32 master weights and optimizer states, "
                   "16 B/param for AdamW on 16-bit weights) or pure (states in the "
                   "parameters' dtype) [default: mixed].")
@click.option("--probe", is_flag=True,
              help="With --budget fit and a preset MODEL, on a CUDA GPU: run a few real AdamW "
                   "steps under the plan and report the device's memory peak.")
@_loss_option
@_gpus_option
@_set_option
@_user_errors
def plan_command(source: str, budget: str, strategy: str, hardware: str | None,
                 output: str | None, optimizer: str | None, precision: str | None,
                 probe: bool, loss: str | None, gpus: int, overrides: tuple[str, ...]) -> None:
    """Plan keep / offload / recompute for every saved activation under a budget."""
    from slackswap.core.jsonio import load_model
    from slackswap.planners import plan_with_result
    from slackswap.planners.api import plan as make_plan

    given = parse_overrides(overrides)
    # a preset's name is the model, even beside a file of that name (./NAME reads it);
    # the presets (which import torch) are looked at only when there is such a file
    from_file = source.endswith(".json") or (Path(source).is_file()
                                             and not _model_preset(source))
    _check_outputs({"-o": output}, [source if from_file else None, hardware])
    if probe and (from_file or not is_fit(budget) or gpus > 1 or overrides):
        raise InputError("--probe checks a --budget fit plan of a preset MODEL on the GPU "
                         "it runs on (no profile file, --gpus or --set)")
    if probe:
        from slackswap.runtime.probe import require_gpu

        require_gpu()
    if from_file:
        if loss is not None:
            raise InputError("--loss applies when planning a MODEL; a profile was made with "
                             "its loss already")
        prof = load_model(StepProfile, source)
        hw = _hardware(hardware or profile_hardware(prof.hardware), given)
    else:
        from slackswap.models import load_workload
        from slackswap.profiling import profile as run_profile

        hw = _hardware(hardware, given)
        loss_fn = _loss_fn(source, loss)
        with _progress(f"profiling {source}"):
            net, example = load_workload(source)
            prof = run_profile(net, example, hw, loss_fn=loss_fn, name=source)
    node = on_node(hw, gpus)
    budget = _fit_budget(prof, node, budget, optimizer, precision)
    with _progress(f"planning with {strategy}"):
        attempt = plan_with_result(prof, budget, node, strategy)
        if attempt is None or not attempt[1].feasible:
            make_plan(prof, budget, node, strategy)  # raises, naming the smallest budget
        chosen, result = attempt
    if output is not None:
        dump_model(chosen, output)
    _print_plan(prof, chosen, result, output, node.name)
    if probe:
        from slackswap.runtime.probe import probe as run_probe

        with _progress("probing with real steps"):
            found = run_probe(source, hardware, strategy)
        _console().print("\n".join(found.lines()), highlight=False)


def _model_preset(name: str) -> bool:
    from slackswap.models import MODEL_PRESETS

    return name in MODEL_PRESETS


def _fit_budget(prof: StepProfile, hw: Hardware, budget: str, optimizer: str | None,
                precision: str | None) -> str:
    """``budget``, or for ``fit`` the bytes the device leaves, its breakdown printed."""
    if not is_fit(budget):
        if optimizer or precision:
            raise InputError("--optimizer and --precision size the model states for "
                             "--budget fit; give them with it")
        return budget
    device = device_budget(prof, hw, optimizer or "adamw", precision or "mixed")
    _console().print("\n".join(_shown(line, 400) for line in device.lines()), highlight=False)
    return str(device.budget_bytes)


@main.command()
@click.option("--budget", type=float, default=0.5, show_default=True,
              help="Budget as a fraction of each workload's keep-all peak.")
@click.option("--hardware", default="a100-80gb", show_default=True)
@click.option("--workloads", default="bert-large,gpt2-xl,llama-7b", show_default=True,
              help="Comma-separated presets.")
@click.option("--out", default="slackswap-results", show_default=True,
              type=click.Path(file_okay=False), help="Results folder.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Also write the results JSON here.")
@click.option("--sweep", is_flag=True,
              help="Also plan every budget from 10 to 100% and plot retention against it "
                   "(several minutes more).")
@click.option("--reference", type=click.Choice(["keep-all", "outside-loss"]),
              default="keep-all", show_default=True,
              help="The peak the budget is a fraction of: the keep-all activation peak, or "
                   "its peak over the ops outside the loss and its backward.")
@_gpus_option
@_set_option
@_user_errors
def reproduce(budget: float, hardware: str, workloads: str, out: str,
              json_path: str | None, sweep: bool, reference: str, gpus: int,
              overrides: tuple[str, ...]) -> None:
    """Reproduce the paper's table: every strategy on the reference workloads."""
    from slackswap.core.jsonio import atomic_write_text
    from slackswap.models import MODEL_PRESETS
    from slackswap.reproduce import SWEEP, steps
    from slackswap.reproduce import reproduce as run

    _check_outputs({"--json": json_path}, [hardware])
    names = tuple(w.strip() for w in workloads.split(",") if w.strip())
    if unknown := [n for n in names if n not in MODEL_PRESETS]:
        raise InputError(f"unknown workload '{unknown[0]}'; presets: {', '.join(MODEL_PRESETS)}")
    budgets = SWEEP if sweep else ()
    with _progress_bar("reproducing", steps(names, budgets, gpus)) as update:
        results = run(out, budget, hardware, names, budgets, progress=update, gpus=gpus,
                      overrides=parse_overrides(overrides), reference=reference)
    if json_path is not None:
        atomic_write_text(json_path, json_text(results, json_path, indent=2))
    _print_reproduce(results, out)


@main.command("fit")
@click.argument("model")
@click.option("--hardware", default="a100-80gb", show_default=True,
              help="Hardware: a preset (slackswap hardware lists them), a .toml file "
                   "(slackswap hardware --template writes one to fill in), or auto: this "
                   "machine's GPU's preset. The device whose memory is fitted.")
@click.option("--optimizer", type=click.Choice(list(OPTIMIZERS)), default="adamw",
              show_default=True, help="The optimizer whose states the device holds.")
@click.option("--precision", type=click.Choice(list(PRECISIONS)), default="mixed",
              show_default=True, help="mixed (fp32 master weights and optimizer states) or "
                                      "pure (states in the parameters' dtype).")
@click.option("--seq", type=click.IntRange(min=1),
              help="Sequence length of the batches searched [default: the preset's].")
@click.option("--batch", type=click.IntRange(min=1),
              help="Search the longest sequence (a multiple of 64) at this batch instead.")
@click.option("--min-retention", type=click.FloatRange(0, 1), default=0.97, show_default=True,
              help="Throughput to keep, as a fraction of the step with unlimited memory.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@click.option("--plot", type=click.Path(dir_okay=False),
              help="Write a PNG of tokens/s against the batch (or sequence length).")
@_set_option
@_user_errors
def fit_command(model: str, hardware: str, optimizer: str, precision: str, seq: int | None,
                batch: int | None, min_retention: float, as_json: bool, plot: str | None,
                overrides: tuple[str, ...]) -> None:
    """The largest micro-batch of preset MODEL (or, given --batch, the longest sequence)
    that trains at --min-retention of ideal in the device's memory, with SlackSwap, block
    checkpointing and keep-all."""
    from slackswap.fit import fit, write_fit_plot

    _check_outputs({"--plot": plot}, [hardware])
    hw = _hardware(hardware, parse_overrides(overrides))
    with _progress(f"fitting {model} on {hw.name}") as update:
        result = fit(model, hw, batch=batch, seq=seq, optimizer=optimizer,
                     precision=precision, min_retention=min_retention, progress=update)
    if plot is not None:
        write_fit_plot(result, plot)
    if as_json:
        click.echo(json_text(result.to_json(), "the result"))
    else:
        _print_fit(result, plot)
    if result.largest["slackswap"] is None:
        sys.exit(1)


@main.command()
@click.option("-o", "--output", required=True,
              help="The hardware file to write (TOML); pass it later as --hardware FILE.")
@click.option("--base", default=AUTO, show_default=True,
              help="The hardware whose other figures the file keeps: a preset, a .toml "
                   "file, or auto (this machine's GPU's preset).")
@click.option("--name", help="The hardware's name in the file [default: BASE-calibrated].")
@click.option("--costs", help="Also write the runtime's per-device-call host costs (JSON), "
                              "as benchmarks/host_work.py --costs reads them.")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@_user_errors
def calibrate(output: str, base: str, name: str | None, costs: str | None,
              force: bool) -> None:
    """Measure this machine's host link and host costs, and write a hardware file.

    On a CUDA GPU: copies with pinned buffers on the runtime's side streams, each direction
    alone and both at once, and the host time of an eager op; every other figure is
    BASE's. Takes about a minute."""
    from slackswap.runtime import calibrate as cal  # (imports torch)

    _check_outputs({"-o": output, "--costs": costs}, [base])
    for path in filter(None, (output, costs)):
        cal.refuse_existing(path, force)
    cal.require_gpu()
    hw = _hardware(base, {})
    with _progress("measuring") as update:
        found = cal.measure(progress=update)
    calibrated = cal.calibrated_hardware(hw, found, name)
    cal.write_hardware(calibrated, output, force=True)
    if costs:
        cal.write_costs(found, costs, force=True)
    click.echo(f"{found.device} (torch {found.torch_version}), measured:")
    link = calibrated.host_link
    for label, value in (("device to host", link.d2h_bandwidth),
                         ("host to device", link.h2d_bandwidth),
                         ("both at once, device to host", link.duplex_d2h_bandwidth),
                         ("both at once, host to device", link.duplex_h2d_bandwidth)):
        click.echo(f"  {label:30s} {value / 1e9:6.1f} GB/s")
    click.echo(f"  {'eager dispatch per op':30s} {found.dispatch_s * 1e6:6.1f} us")
    click.echo(f"wrote {_plain(output)} ({calibrated.name}; other figures from {hw.name}): "
               f"pass it as --hardware {_plain(output)}")


@main.command("hardware")
@click.option("--template", is_flag=True,
              help="Print a commented hardware file to fill in for your own GPU (save it, "
                   "then pass it as --hardware FILE).")
def hardware_list(template: bool) -> None:
    """List the hardware presets, or print a hardware file to fill in."""
    if template:
        from slackswap.core.hwtemplate import HARDWARE_TEMPLATE

        click.echo(HARDWARE_TEMPLATE, nl=False)
        return
    for name in hardware_presets():
        hw = load_hardware(name)
        click.echo(f"{name:12s} {hw.description}")


def _print_profile(p: StepProfile, output: str | None) -> None:
    out = _console()
    s = p.summary()
    out.print(f"[bold]{_shown(p.model)}[/bold] on {_shown(p.hardware)} ({p.mode}, {p.kernels} "
              "kernels): "
              f"{s['num_saved_tensors']} saved activations, "
              f"{format_bytes(s['saved_bytes_total'])}; "
              f"forward {s['forward_time_s'] * 1e3:.1f} ms, "
              f"backward {s['backward_time_s'] * 1e3:.1f} ms")
    layers = Table(title="Saved activation bytes by layer")
    layers.add_column("layers")
    layers.add_column("bytes each", justify="right")
    per = s["saved_bytes_per_layer"]
    start = 0
    for i in range(1, len(per) + 1):  # runs of equal layers share a row
        if i == len(per) or per[i] != per[start]:
            label = str(start) if i - 1 == start else f"{start}-{i - 1}"
            layers.add_row(label, format_bytes(per[start]))
            start = i
    outside = p.saved_bytes_by("layer").get("(outside blocks)", 0)
    layers.add_row("outside blocks (total)", format_bytes(outside))
    out.print(layers)
    kinds = Table(title="Saved activation bytes by op kind")
    kinds.add_column("op kind")
    kinds.add_column("bytes", justify="right")
    kinds.add_column("share", justify="right")
    by_kind = sorted(p.saved_bytes_by("kind").items(), key=lambda kv: -kv[1])
    for kind, nbytes in by_kind:
        share = nbytes / s["saved_bytes_total"] if s["saved_bytes_total"] else 0.0
        kinds.add_row(_shown(kind), format_bytes(nbytes), f"{share:.1%}")
    out.print(kinds)
    if output:
        out.print(f"profile written to {_shown(output, 400)}")


def _print_plan(prof: StepProfile, chosen: Any, result: Any, output: str | None,
                hardware: str) -> None:
    from slackswap.planners.summary import checkpoint_bytes, decision_bytes

    out = _console()
    totals = decision_bytes(prof, chosen, by="total")["total"]
    out.print(f"[bold]{_shown(prof.model)}[/bold], {_shown(chosen.strategy)}, budget "
              f"{format_bytes(chosen.budget_bytes or 0)} on {_shown(hardware)}: predicted "
              f"retention {result.retention:.2%} (simulated), peak "
              f"{format_bytes(result.peak_bytes)} "
              f"(keep-all {format_bytes(result.keep_all_peak_bytes)})")
    out.print("  ".join(f"{d} {format_bytes(b)}" for d, b in totals.items()))
    checkpoints = checkpoint_bytes(prof, chosen)
    if any(checkpoints.values()):
        out.print("checkpoints (not saved by autograd, read by rebuilds): " + "  ".join(
            f"{d} {format_bytes(b)}" for d, b in checkpoints.items()))
    for by, title in (("kind", "op kind"), ("layer", "layer")):
        table = Table(title=f"Saved activation bytes by {title}")
        for col in (title, "keep", "offload", "recompute"):
            table.add_column(col, justify="left" if col == title else "right")
        groups = decision_bytes(prof, chosen, by=by)
        keys = sorted(groups, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else k))
        for key in keys:
            row = groups[key]
            table.add_row(_shown(key), *(format_bytes(row[d])
                                         for d in ("keep", "offload", "recompute")))
        out.print(table)
    if output:
        out.print(f"plan written to {_shown(output, 400)}")


def _print_reproduce(results: dict[str, Any], out_dir: str) -> None:
    from slackswap.planners import STRATEGIES
    from slackswap.reproduce import bound_cell, written_files

    out = _console()
    workloads = results["workloads"]
    table = Table(title=f"Throughput retained at {results['budget_fraction']:.0%} budget, "
                        f"{_shown(results['hardware'])} (simulated)")
    table.add_column("strategy")
    for w in workloads:
        table.add_column(w["name"], justify="right")
    table.add_row("paper*", *(f"{w['paper_retention']:.1%}" if w["paper_retention"] else "-"
                              for w in workloads))
    for s in STRATEGIES:
        entries = [w["strategies"][s] for w in workloads]
        cells = [f"{e['retention']:.1%}" if e["feasible"] else "infeasible" for e in entries]
        table.add_row(f"[bold]{s}[/bold]" if s == "slackswap" else s, *cells)
    table.add_row("bound", *(bound_cell(w) for w in workloads))
    if results.get("gpus", 1) > 1:
        table.add_row("slackswap, planned for 1 GPU", *(
            f"{w['single_gpu_plan']['retention']:.1%}" if w["single_gpu_plan"]["feasible"]
            else "infeasible" for w in workloads))
    out.print(table)
    out.print("* the paper's own simulation (A100, PCIe 4.0, 50% budget)")
    out.print(f"results written to {_shown(out_dir, 400)}/ "
              f"({', '.join(written_files(results))})")


def _print_fit(result: Any, plot: str | None) -> None:
    from slackswap.fit import FIT_STRATEGIES

    out = _console()
    out.print("\n".join(_shown(line, 400) for line in result.device.lines()),
              highlight=False)
    dim = "micro-batch" if result.search == "batch" else "sequence length"
    fixed = f"seq {result.fixed}" if result.search == "batch" else f"batch {result.fixed}"
    target = f"{result.min_retention:.1%}"
    table = Table(title=f"{_shown(result.model)} on {_shown(result.hardware)}, {fixed}: "
                        "simulated tokens/s "
                        f"(retention); * meets {target}")
    table.add_column(dim, justify="right")
    table.add_column("keep-all peak", justify="right")
    for strategy in FIT_STRATEGIES:
        table.add_column(strategy, justify="right")
    for p in result.points:
        cells = [_fit_cell(p.outcomes.get(s), result.min_retention) for s in FIT_STRATEGIES]
        table.add_row(str(result.size_of(p)), format_bytes(p.keep_all_peak_bytes), *cells)
    out.print(table)
    if any(s not in p.outcomes for p in result.points for s in FIT_STRATEGIES):
        out.print("-: not planned there (the search did not need it)", highlight=False)
    out.print(f"Largest {dim} at {target} of ideal or more:", highlight=False)
    for strategy in FIT_STRATEGIES:
        p = result.chosen(strategy)
        if p is None:
            first = result.points[0].outcomes[strategy]
            why = _shown(first.reason, 400) if first.reason else (
                f"retains {first.retention:.1%}")
            out.print(f"  {strategy:<18} none: at {dim} {result.size_of(result.points[0])}"
                      f" {why}", highlight=False)
            continue
        o = p.outcomes[strategy]
        size = result.largest[strategy]
        at_least = "at least " if size == result.cap else ""
        out.print(f"  {strategy:<18} {at_least}{size}: {o.retention:.1%} of ideal, "
                  f"{o.tokens_per_s:,.0f} tokens/s, peak {format_bytes(o.peak_bytes)}",
                  highlight=False)
    if (fastest := result.fastest()) is not None:
        strategy, p = fastest
        o = p.outcomes[strategy]
        out.print(f"Most tokens/s at {target} or more (of the shapes tried): {strategy} at "
                  f"{dim} {result.size_of(p)}, {o.tokens_per_s:,.0f} tokens/s", highlight=False)
    if plot:
        out.print(f"plot written to {_shown(plot, 400)}")


def _fit_cell(outcome: Any, target: float) -> str:
    """A strategy at a shape: tokens/s and retention, starred when it meets ``target``."""
    if outcome is None:
        return "-"
    if not outcome.feasible:
        return "does not fit"
    star = "*" if outcome.meets(target) else " "
    return f"{outcome.tokens_per_s:,.0f} ({outcome.retention:.1%}){star}"
