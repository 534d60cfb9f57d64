"""Scout: torchvision and timm models trained a few steps under SlackSwap plans, compared bit
for bit with plain PyTorch from the same state and seeds (loss, every gradient before
clipping, parameters and buffers after each optimizer step).

Needs torchvision and timm (not in the project's test dependencies):

    python benchmarks/scout_vision.py tv_resnet18 timm_vit_tiny --precisions fp32 --json out.json

Each (model, mode) prints PASS, REFUSED (the one-line error) or FAIL (what differed, or the
traceback's last line).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

import slackswap
from slackswap import InputError, Plan
from slackswap.errors import SlackSwapError

STEPS = 3
CLASSES = 5


def _tv(name: str, size: int = 64, **kw: Any) -> Callable[[], tuple]:
    def build() -> tuple:
        import torchvision

        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(num_classes=CLASSES, **kw)
        return model, size
    return build


def _timm(name: str, size: int = 64, **kw: Any) -> Callable[[], tuple]:
    def build() -> tuple:
        import timm

        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **kw)
        return model, size
    return build


def _small_vit() -> tuple:
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(image_size=64, patch_size=16, num_layers=2, num_heads=4,
                             hidden_dim=64, mlp_dim=128, dropout=0.1, attention_dropout=0.1,
                             num_classes=CLASSES), 64


def _timm_ckpt(name: str, size: int = 64, **kw: Any) -> Callable[[], tuple]:
    def build() -> tuple:
        model, size_ = _timm(name, size, **kw)()
        model.set_grad_checkpointing(True)
        return model, size_
    return build


def _unfused(builder: Callable[[], tuple]) -> Callable[[], tuple]:
    """timm's attention written out (softmax, dropout, matmuls) rather than SDPA."""
    def build() -> tuple:
        model, size = builder()
        for m in model.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = False
        return model, size
    return build


def _frozen(builder: Callable[[], tuple], train: tuple[str, ...]) -> Callable[[], tuple]:
    """Fine-tuning: only the parameters under the prefixes ``train`` are trained."""
    def build() -> tuple:
        model, size = builder()
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith(train))
        return model, size
    return build


def _eval(builder: Callable[[], tuple]) -> Callable[[], tuple]:
    """Trained in eval mode: BatchNorm on running statistics, dropout and drop path off."""
    build = functools.partial(builder)
    build.eval_mode = True  # type: ignore[attr-defined]
    return build


def _channels_last(builder: Callable[[], tuple]) -> Callable[[], tuple]:
    def build() -> tuple:
        model, size = builder()
        return model.to(memory_format=torch.channels_last), size
    build.channels_last = True  # type: ignore[attr-defined]
    return build


MODELS: dict[str, Callable[[], tuple]] = {
    "tv_resnet18": _tv("resnet18"),
    "tv_resnet50": _tv("resnet50"),
    "tv_mobilenet_v3_small": _tv("mobilenet_v3_small", dropout=0.2),
    "tv_efficientnet_b0": _tv("efficientnet_b0", stochastic_depth_prob=0.5),
    "tv_convnext_tiny": _tv("convnext_tiny", stochastic_depth_prob=0.5),
    "tv_vit_small": _small_vit,
    "tv_swin_t": _tv("swin_t"),
    "tv_regnet_y_400mf": _tv("regnet_y_400mf"),
    "tv_densenet121": _tv("densenet121"),
    "tv_densenet121_memeff": _tv("densenet121", memory_efficient=True),
    "tv_squeezenet": _tv("squeezenet1_1"),
    "tv_shufflenet_v2": _tv("shufflenet_v2_x0_5"),
    "tv_inception_v3": _tv("inception_v3", size=96, aux_logits=False, init_weights=True),
    "tv_inception_v3_aux": _tv("inception_v3", size=299, aux_logits=True, init_weights=True),
    "tv_googlenet": _tv("googlenet", aux_logits=True, init_weights=True),
    "tv_resnet18_cl": _channels_last(_tv("resnet18")),
    "tv_mobilenet_v3_small_cl": _channels_last(_tv("mobilenet_v3_small")),
    "timm_resnet18_dp": _timm("resnet18", drop_path_rate=0.3, drop_rate=0.1),
    "timm_vit_tiny": _timm("vit_tiny_patch16_224", img_size=64, drop_path_rate=0.2,
                           drop_rate=0.1, attn_drop_rate=0.1, proj_drop_rate=0.1),
    "timm_deit_tiny": _timm("deit_tiny_distilled_patch16_224", img_size=64,
                            drop_path_rate=0.2),
    "timm_convnext_atto": _timm("convnext_atto", drop_path_rate=0.3),
    "timm_efficientnet_b0": _timm("efficientnet_b0", drop_path_rate=0.3, drop_rate=0.2),
    "timm_mixer_s16": _timm("mixer_s16_224", img_size=64, drop_path_rate=0.2),
    "timm_levit_128s": _timm("levit_128s", img_size=64, drop_path_rate=0.0),
    "timm_coatnet_nano": _timm("coatnet_nano_rw_224", img_size=64, drop_path_rate=0.2),
    "timm_maxvit_nano": _timm("maxvit_nano_rw_256", img_size=64, drop_path_rate=0.2),
    "timm_vit_tiny_unfused": _unfused(_timm("vit_tiny_patch16_224", img_size=64,
                                            drop_path_rate=0.2, attn_drop_rate=0.1)),
    "tv_resnet18_frozen": _frozen(_tv("resnet18"), ("layer3", "layer4", "fc")),
    "timm_vit_tiny_frozen": _frozen(_timm("vit_tiny_patch16_224", img_size=64,
                                          drop_path_rate=0.2), ("blocks.10", "blocks.11",
                                                                "norm", "head")),
    "tv_mobilenet_v3_small_eval": _eval(_tv("mobilenet_v3_small")),
    "timm_convnext_atto_eval": _eval(_timm("convnext_atto", drop_path_rate=0.3)),
    "timm_vit_tiny_ckpt": _timm_ckpt("vit_tiny_patch16_224", img_size=64),
    "timm_convnext_atto_cl": _channels_last(_timm("convnext_atto", drop_path_rate=0.3)),
}


def build(name: str, batch_size: int = 2) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model, size = MODELS[name]()
    model.train(not getattr(MODELS[name], "eval_mode", False))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch_size, 3, size, size, generator=g)
    if getattr(MODELS[name], "channels_last", False):
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, CLASSES, (batch_size + 1,), generator=g)  # one more: auto_shapes
    return model, x, y


def make_loss(y_all: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    def loss_fn(out: Any) -> torch.Tensor:
        first = out if isinstance(out, torch.Tensor) else out[0]
        y = y_all[: first.shape[0]]
        if isinstance(out, torch.Tensor):
            return F.cross_entropy(out.float(), y)
        if hasattr(out, "logits"):  # inception_v3 InceptionOutputs(logits, aux_logits)
            main = F.cross_entropy(out.logits.float(), y)
            aux = getattr(out, "aux_logits", None)
            return main if aux is None else main + 0.4 * F.cross_entropy(aux.float(), y)
        if hasattr(out, "aux_logits2"):  # GoogLeNetOutputs
            return (F.cross_entropy(out.logits.float(), y)
                    + 0.3 * F.cross_entropy(out.aux_logits1.float(), y)
                    + 0.3 * F.cross_entropy(out.aux_logits2.float(), y))
        if isinstance(out, tuple):  # deit distilled in train: (cls, dist)
            return sum(F.cross_entropy(o.float(), y) for o in out) / len(out)
        raise TypeError(type(out))
    return loss_fn


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def after_step(model: Any, rec: dict[str, Any]) -> dict[str, Any]:
    """``rec`` with the parameters, buffers and torch's RNG state after an optimizer step."""
    for n, p in model.named_parameters():
        rec[f"param {n}"] = p.detach().clone()
    for n, b in model.named_buffers():
        rec[f"buffer {n}"] = b.detach().clone()
    rec["rng"] = torch.get_rng_state()
    return rec


def count_stats(info: dict[str, int], cm: Any) -> None:
    """Add what a SlackSwap block or attachment did this step (if ``cm`` is one) to ``info``."""
    stats = getattr(cm, "stats", None)
    if stats is not None:
        info["verified"] += getattr(stats, "verified", 0)
        info["off_path"] += bool(getattr(stats, "off_path", False))
        info["offloaded"] += getattr(stats, "offloaded_bytes", 0)
        info["recomputed"] += getattr(stats, "recomputed_ops", 0) or 0


def train(model: torch.nn.Module, x: torch.Tensor, loss_fn: Callable, *, bf16: bool,
          opt: str, block: Callable[[int], Any] | None = None,
          outside: bool = False) -> tuple[list[dict[str, torch.Tensor]], dict]:
    """STEPS steps; ``block(step)`` is the context the forward (and the loss, unless
    ``outside``) runs in. Returns per-step records and the runtime stats seen."""
    optimizer = _optimizer(model, opt)
    records = []
    info: dict[str, Any] = {"verified": 0, "off_path": 0, "offloaded": 0, "recomputed": 0}
    xs = x if isinstance(x, list) else [x]
    for step in range(STEPS):
        x = xs[step % len(xs)]
        torch.manual_seed(100 + step)
        cm = block(step) if block is not None else contextlib.nullcontext()
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with amp:
            with cm:
                out = model(x)
                loss = None if outside else loss_fn(out)
            if outside:
                loss = loss_fn(out)
        del out
        loss.backward()
        rec = {"loss": loss.detach().clone()}
        del loss
        for n, p in model.named_parameters():
            rec[f"grad {n}"] = None if p.grad is None else p.grad.clone()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records.append(after_step(model, rec))
        count_stats(info, cm)
        del cm
    del optimizer
    return records, info


def compare(got: list[dict], want: list[dict]) -> str | None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.keys() != w.keys():
            return f"step {step}: keys differ {sorted(g.keys() ^ w.keys())[:4]}"
        bad = []
        for k in w:
            a, b = g[k], w[k]
            if a is None or b is None:
                if a is not b:
                    bad.append(f"{k}: None mismatch")
                continue
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                d = ((a.double() - b.double()).abs().max().item()
                     if a.shape == b.shape and a.is_floating_point() else "?")
                bad.append(f"{k}: max|diff| {d}")
        if bad:
            return f"step {step}: {len(bad)} differ: " + "; ".join(bad[:4])
    return None


def _uniform(profile: slackswap.StepProfile, decision: str) -> Plan:
    names = [t.name for t in profile.saved_activations if t.producer is not None]
    if decision == "recompute":
        ok = profile.recomputable
        decisions = {n: ("recompute" if n in ok else "keep") for n in names}
    elif decision == "mixed":
        decisions = {n: ("keep", "offload", "recompute")[i % 3] for i, n in enumerate(names)}
        decisions = {n: ("keep" if d == "recompute" and n not in profile.recomputable else d)
                     for n, d in decisions.items()}
    else:
        decisions = {n: decision for n in names}
    return Plan(fingerprint=profile.fingerprint, strategy="x", decisions=decisions)


def plans_for(profile: slackswap.StepProfile, modes: list[str]) -> dict[str, Plan | str]:
    out: dict[str, Plan | str] = {}
    for mode in modes:
        try:
            if "@" in mode or mode in ("recompute-only", "offload-only"):  # strategy@budget
                strategy, _, budget = mode.partition("@")
                try:
                    out[mode] = slackswap.plan(profile, float(budget or 0.5), strategy=strategy)
                except InputError:  # out of reach: the smallest budget known to fit
                    from slackswap.planners import smallest_feasible_budget
                    least = smallest_feasible_budget(profile)
                    out[mode] = slackswap.plan(profile, least, strategy=strategy)
            else:
                out[mode] = _uniform(profile, mode.split("-")[1])
        except SlackSwapError as e:
            out[mode] = f"no plan: {str(e).splitlines()[0][:200]}"
    return out


PLAN_MODES = ["slackswap@0.7", "slackswap@0.5", "slackswap@0.3", "recompute-only",
              "offload-only", "all-offload", "all-recompute", "all-mixed"]


def _run_one(label: str, fn: Callable[[], tuple[list, dict]], want: list[dict],
             live0: int, results: dict) -> None:
    t0 = time.time()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, info = fn()
        diff = info.get("own_reference", compare(got, want)) if "own_reference" in info \
            else compare(got, want)
        del got
        live = _live_tensors() - live0
        status = "FAIL" if diff else "PASS"
        detail = diff or f"verified={info['verified']} off_path={info['off_path']} " \
                         f"offloaded={info['offloaded']} recomputed={info['recomputed']}"
        if not diff and live:
            detail += f" live_tensors_delta={live}"
    except InputError as e:
        status, detail = "REFUSED", str(e).splitlines()[0][:300]
    except Exception as e:  # noqa: BLE001
        status = "FAIL"
        detail = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        tb = traceback.format_exc().splitlines()
        detail += " | " + " / ".join(tb[-6:-1])[:600]
    results[label] = {"status": status, "detail": detail, "s": round(time.time() - t0, 1)}
    print(f"  {label:<22} {status:<8} {time.time() - t0:5.1f}s {detail}", flush=True)


def scout(name: str, precisions: list[str], modes: list[str], extra: list[str]) -> dict:
    results: dict[str, Any] = {}
    try:
        pristine, x, y = build(name)
    except Exception as e:  # noqa: BLE001
        print(f"{name}: build failed: {e}")
        return {"build": {"status": "SKIP", "detail": str(e)[:200]}}
    loss_fn = make_loss(y)
    opt = "adamw" if any(k in name for k in ("vit", "deit", "swin", "convnext", "mixer",
                                              "levit", "coat", "maxvit")) else "sgd"
    print(f"{name} ({sum(p.numel() for p in pristine.parameters())} params, {opt})", flush=True)
    for prec in precisions:
        bf16 = prec == "bf16"
        t0 = time.time()
        try:
            want, _ = train(copy.deepcopy(pristine), x, loss_fn, bf16=bf16, opt=opt)
            again, _ = train(copy.deepcopy(pristine), x, loss_fn, bf16=bf16, opt=opt)
            if (d := compare(again, want)) is not None:
                print(f"  {prec}: plain PyTorch not deterministic: {d}")
                results[f"{prec} reference"] = {"status": "SKIP", "detail": d}
                continue
        except Exception as e:  # noqa: BLE001
            print(f"  {prec}: plain PyTorch failed: {type(e).__name__}: {e}"[:300])
            results[f"{prec} reference"] = {"status": "SKIP", "detail": str(e)[:200]}
            continue
        print(f"  {prec}: reference {time.time() - t0:.1f}s", flush=True)
        live0 = _live_tensors()
        try:
            amp = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                   else contextlib.nullcontext())
            t0 = time.time()
            with amp, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                profile = slackswap.profile(copy.deepcopy(pristine), x, mode="traced",
                                            loss_fn=loss_fn)
            print(f"  {prec}: profiled {len(profile.ops)} ops, "
                  f"{len(profile.saved_activations)} saved, {time.time() - t0:.1f}s", flush=True)
            plans = plans_for(profile, modes)
        except InputError as e:
            results[f"{prec} profile"] = {"status": "REFUSED", "detail": str(e)[:300]}
            print(f"  {prec} profile REFUSED {str(e).splitlines()[0][:300]}", flush=True)
            plans, profile = {}, None
        except Exception as e:  # noqa: BLE001
            results[f"{prec} profile"] = {"status": "FAIL", "detail": repr(e)[:300]}
            print(f"  {prec} profile FAIL {traceback.format_exc()[-1500:]}", flush=True)
            plans, profile = {}, None
        for mode in list(plans):
            label, box = f"{prec} {mode}", [plans.pop(mode)]
            if isinstance(box[0], str):
                results[label] = {"status": "NOPLAN", "detail": box[0]}
                print(f"  {label:<22} NOPLAN   {box[0]}", flush=True)
                continue

            def fn2(box: list = box, bf16: bool = bf16, profile: Any = profile
                    ) -> tuple[list, dict]:
                # the plan goes with the step: its host-buffer pool lives as long as it does
                plan, model = box.pop(), copy.deepcopy(pristine)
                return train(model, x, loss_fn, bf16=bf16, opt=opt,
                             block=lambda _s: slackswap.apply(model, plan, profile=profile,
                                                              verify=True))
            _run_one(label, fn2, want, live0, results)
        for kind in extra:
            _run_one(f"{prec} {kind}", lambda kind=kind, bf16=bf16: _extra(
                         kind, pristine, x, loss_fn, bf16, opt), want, live0, results)
    return results


def _extra(kind: str, pristine: torch.nn.Module, x: torch.Tensor, loss_fn: Callable,
           bf16: bool, opt: str) -> tuple[list, dict]:
    model = copy.deepcopy(pristine)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    if kind == "oneshot":  # slackswap.plan(model, batch) on the model then trained
        with amp:
            plan = slackswap.plan(model, x, budget=0.7, loss_fn=loss_fn)
        return train(model, x, loss_fn, bf16=bf16, opt=opt,
                     block=lambda _s: slackswap.apply(model, plan, verify=True))
    if kind == "attach":
        attached = slackswap.attach(model, budget=0.7, loss_fn=loss_fn)
        try:
            got, info = train(model, x, loss_fn, bf16=bf16, opt=opt, outside=True)
            stats = attached.stats  # the last step's
            info.update(offloaded=stats.offloaded_bytes, recomputed=stats.recomputed_ops)
            return got, info
        finally:
            attached.detach()
    if kind == "auto_shapes":  # batches of two shapes in turn, against their own reference
        g = torch.Generator().manual_seed(2)
        xs = [x, torch.randn(x.shape[0] + 1, *x.shape[1:], generator=g).contiguous(
            memory_format=torch.channels_last if x.is_contiguous(
                memory_format=torch.channels_last) else torch.contiguous_format)]
        want, _ = train(copy.deepcopy(pristine), xs, loss_fn, bf16=bf16, opt=opt)
        step = slackswap.auto(model, budget=0.7, loss_fn=loss_fn)
        got, info = train(model, xs, loss_fn, bf16=bf16, opt=opt,
                          block=lambda s: step(xs[s % 2]))
        info["own_reference"] = compare(got, want)
        return got, info
    if kind == "auto":
        step = slackswap.auto(model, budget=0.7, loss_fn=loss_fn)
        return train(model, x, loss_fn, bf16=bf16, opt=opt, block=lambda _s: step(x),
                     outside=True)
    raise ValueError(kind)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--modes", default=",".join(PLAN_MODES))
    ap.add_argument("--extra", default="oneshot")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    everything = {}
    for name in args.models:
        everything[name] = scout(name, args.precisions.split(","),
                                 [m for m in args.modes.split(",") if m],
                                 [e for e in args.extra.split(",") if e])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(everything, f, indent=1)
    print(json.dumps({n: {k: v["status"] for k, v in r.items()} for n, r in everything.items()},
                     indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
