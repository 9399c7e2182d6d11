"""The device check's report: the goals it is measured against (issue #47: `GOALS`), device_check.json and .md."""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from pathlib import Path

OPS = {"<=": operator.le, ">=": operator.ge}


@dataclasses.dataclass(frozen=True)
class Check:
    """One measured value against its target: `value op target` (value None: not measured)."""

    label: str
    value: float | None
    op: str  # "<=" | ">="
    target: float
    percent: bool = False
    note: str = ""  # said after the value

    @property
    def met(self) -> bool | None:
        return None if self.value is None else OPS[self.op](self.value, self.target)

    def text(self) -> str:
        if self.value is None:
            return f"{self.label}: —"
        value = f"{100 * self.value:.1f} %" if self.percent else f"{self.value:.3f}"
        return f"{self.label}: {value}" + (f" ({self.note})" if self.note else "")


def verdict(checks: list[Check]) -> str:
    """"missed" if any measured value misses its target, "met" if every one meets it, else "not measured"."""
    if any(c.met is False for c in checks):
        return "missed"
    return "met" if checks and all(c.met for c in checks) else "not measured"


def _train_entry(sections: dict, seq: int, model: str) -> dict | None:
    return next((r for r in (sections.get("train_step") or {}).get("results", [])
                 if r["seq_len"] == seq and r["model"] == model and "ratio" in r), None)  # (compile-only: no ratio)


def _attention_checks(sections: dict, plan) -> list[Check]:
    """Per T, the fastest DIFF candidate's per-round ratio to the standard op (named, with "auto"'s choice)."""
    s = sections.get("attention") or {}
    cells = {c["seq"]: c for c in s.get("cells", []) if c["status"] == "ok" and "standard" in c}
    checks = []
    for seq in plan.attention_seqs:
        cell = cells.get(seq)
        if cell is None:
            checks.append(Check(f"T = {seq}", None, "<=", 1.25))
            continue
        best = min(s["candidates"], key=lambda k: cell[k]["ratio"]["median"])
        auto = "" if best == s["auto"] else f"; \"auto\"'s {s['auto']}: {cell[s['auto']]['ratio']['median']:.3f}"
        checks.append(Check(f"T = {seq}", cell[best]["ratio"]["median"], "<=", 1.25, note=best + auto))
    return checks


def _own_standard_checks(sections: dict, plan) -> list[Check]:
    """Per T and fused kernel, its own one-map op's per-round ratio to the standard op ("auto"'s, cuDNN on a GPU)."""
    s = sections.get("attention") or {}
    cells = {c["seq"]: c for c in s.get("cells", []) if c["status"] == "ok" and "standard" in c}
    return [Check(f"T = {seq}, `{n}`", cells[seq][f"{n} standard"]["ratio"]["median"] if seq in cells else None,
                  "<=", 1.10) for seq in plan.attention_seqs for n in s.get("own_standard", [])]


def _ratio_checks(sections: dict, plan, model: str, target: float) -> list[Check]:
    entries = [(seq, _train_entry(sections, seq, model)) for seq in plan.train_seqs]
    return [Check(f"T = {seq}", entry and entry["ratio"]["median"], "<=", target) for seq, entry in entries]


def _mfu_checks(sections: dict, plan) -> list[Check]:
    seq = plan.train_seqs[0]
    entry = _train_entry(sections, seq, "diff")
    models = entry["models"] if entry else {}
    return [Check(f"{label}, T = {seq}", (models.get(arch) or {}).get("mfu"), ">=", target, percent=True)
            for label, arch, target in (("Transformer", "transformer", 0.45), ("DIFF", "diff", 0.42))]


GOALS = (
    ("attention", "DIFF attention fwd+bwd / standard cuDNN flash (2h heads), 3B head shape", "≤ 1.25 at every T",
     _attention_checks),
    ("own_standard", "A fused kernel's standard op (one map) / standard cuDNN flash", "≤ 1.10 at every T",
     _own_standard_checks),
    ("train_step", "1.4B train step, DIFF / Transformer", "≤ 1.10 at 2K and 4K",
     lambda sections, plan: _ratio_checks(sections, plan, "diff", 1.10)),
    ("mfu", "MFU, 1.4B train step at 2K", "Transformer ≥ 45 %, DIFF ≥ 42 %", _mfu_checks),
    ("diff_v2", "1.4B train step, DIFF V2 / Transformer (the same 2h query heads)", "≤ 1.05 at 2K and 4K",
     lambda sections, plan: _ratio_checks(sections, plan, "diff_v2", 1.05)),
)


def goals(sections: dict, plan) -> list[dict]:
    """Each goal's checks (value, target, met) on the sections measured so far, and its verdict."""
    rows = []
    for key, title, goal, checks_of in GOALS:
        checks = checks_of(sections, plan)
        rows.append(dict(key=key, title=title, goal=goal, verdict=verdict(checks),
                         checks=[dataclasses.asdict(c) | dict(met=c.met) for c in checks]))
    return rows


def jsonable(x):
    """NaN and infinities as null (JSON has neither)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    return x


def write_report(out: Path, report: dict) -> None:
    """device_check.json and .md in `out`, each written beside, then renamed: a killed run leaves a complete pair."""
    for name, text in (("device_check.json", json.dumps(jsonable(report), indent=2)),
                       ("device_check.md", markdown(jsonable(report)))):
        part = out / f".{name}.part"
        part.write_text(text + "\n")
        part.replace(out / name)


def _f(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _ratio(r: dict) -> str:
    return f"**{r['median']:.3f}** ({r['p10']:.3f}–{r['p90']:.3f})"


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 1024**3:.2f}"


def markdown(report: dict) -> str:
    meta, sec = report["meta"], report["sections"]
    dev = meta["device"]
    lines = [f"## Device check: {dev['kind']}", ""]
    if meta["smoke"]:
        lines += ["**SMOKE RUN** (`--smoke`: tiny shapes" + ("" if meta["compile_only"] else
                  ", GPU kernels as a CPU runs their code; a test of the script, not a measurement") + ").", ""]
    if meta["compile_only"]:
        lines += [f"**COMPILE ONLY** for {dev['target']} on a host without it: compile times and memory, nothing "
                  "run.", ""]
    cc = f", compute capability {dev['compute_capability']}" if dev.get("compute_capability") else ""
    cut = [n for n, s in sec.items() if s["status"] in ("cut", "running")]
    result = ("passed" if report["passed"] else "FAILED") + (f"; cut short: {', '.join(cut)}" if cut else "")
    budget = "unlimited" if meta["budget_s"] is None else f"{meta['budget_s']:.0f} s"
    lines += [f"Command: `{meta['command']}` ({meta['started']}, {meta.get('wall_s', 0):.0f} s in all, budget "
              f"{budget}). Device: {dev['kind']} ({dev['platform']} × {dev['count']}{cc}), host CPU {dev['cpu']}. "
              "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ". "
              f"Result: **{result}**.", ""]
    lines += _goals_table(report["goals"]) + _time_table(sec)
    for name, render in (("attention", _attention), ("train_step", _train_step), ("conformance", _conformance),
                         ("training_run", _training_run)):
        if name in sec:
            lines += render(sec[name])
    return "\n".join(lines)


def _goals_table(rows: list[dict]) -> list[str]:
    lines = ["### Goals", "", "| goal | measured | target | verdict |", "|---|---|---|---|"]
    for g in rows:
        measured = "; ".join(Check(**{k: v for k, v in c.items() if k != "met"}).text() for c in g["checks"])
        mark = {"met": "met", "missed": "**missed**", "not measured": "not measured"}[g["verdict"]]
        lines.append(f"| {g['title']} | {measured} | {g['goal']} | {mark} |")
    return lines + [""]


def _time_table(sec: dict) -> list[str]:
    lines = ["### Time", "", "| section | status | budget s | seconds | of which compiling |", "|---|---|---|---|---|"]
    for name, s in sec.items():
        lines.append(f"| {name} | {s['status']} | {_f(s.get('budget_s'), '.0f')} | {_f(s.get('seconds'), '.1f')} "
                     f"| {_f(s.get('compile_s'), '.1f')} |")
    return lines + [""]


_STATUS_LINES = {"skipped": "Skipped: {reason}.", "error": "Error: `{error}`.",
                 "running": "Incomplete: the run ended inside this section; below is what it had measured."}


def _head(title: str, s: dict) -> list[str]:
    lines = [f"### {title}", ""]
    if s["status"] in _STATUS_LINES:
        lines += [_STATUS_LINES[s["status"]].format(**s), ""]
    if cut := s.get("cut"):
        lines += [f"Cut short by the time budget: {cut['done']} of {cut['of']} units done; the next ({cut['next']}) "
                  f"needed ~{cut['needed_s']:.0f} s, {cut['left_s']:.0f} s were left.", ""]
    return lines


def entry_summary(entry: dict) -> str:
    """A conformance entry's result in a few words: its errors, its compile time (compile only), or its error."""
    if entry["status"] == "error":
        return entry["error"]
    if "errors" not in entry:
        return f"compiled in {entry['compile_s']:.1f} s"
    return f"out {entry['errors']['out']:.2e}, worst gradient {entry['worst_grad']} {entry['max_grad_error']:.2e}"


def _attention(s: dict) -> list[str]:
    lines = _head("Attention: DIFF candidates vs standard, forward+backward, causal bf16", s)
    if "cells" not in s:
        return lines
    cands, std = s["candidates"], s["standard"]
    own = [f"{n} standard" for n in s.get("own_standard", [])]  # a fused kernel's one-map op, against the standard
    keys = [*cands, "standard", *own]
    lines += [f"{s['config']}: DIFF {s['diff_heads']} heads of d = {s['head_dim']} (V {s['v_head_dim']}) on each "
              f"candidate ({', '.join(f'`{c}`' for c in cands)}; \"auto\" uses `{s['auto']}`) vs standard attention "
              f"with {s['standard_heads']} heads of {s['head_dim']} on `{std}`" + "".join(f" and on `{n}`" for n in
              s.get("own_standard", [])) + f", B = {s['batch']}. Up to {s['reps']} "
              f"interleaved rounds after {s['warmup']} warm-up; times are medians, ratios the median of the per-round "
              "ratios (p10–p90). TFLOP/s: algorithmic counts (DIFF 32, standard 28 units of h·N²·d, halved for "
              "causal). Compile: seconds per program (AOT, once per shape).", ""]
    cols = ([f"DIFF `{c}` ms" for c in cands] + [f"standard `{std}` ms"] + [f"`{k}` ms" for k in own]
            + [f"`{k}` / standard" for k in [*cands, *own]]
            + ["TFLOP/s " + ", ".join([*cands, std, *own]), "rounds", "compile s"])
    lines += ["| T | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for c in s["cells"]:
        compile_s = ", ".join(f"{c['compile_s'][k]:.1f}" for k in c.get("compile_s", {}))
        if c["status"] != "ok":
            lines.append(f"| {c['seq']} | {c['status']}: `{c['error']}` |" + " |" * (len(cols) - 1))
        elif "standard" not in c:  # compile only
            lines.append(f"| {c['seq']} |" + " |" * (len(cols) - 1) + f" {compile_s} |")
        else:
            vals = ([f"{c[k]['ms']:.3f}" for k in keys] + [_ratio(c[k]["ratio"]) for k in [*cands, *own]]
                    + [", ".join(f"{c[k]['tflops']:.1f}" for k in keys), str(c["rounds"]), compile_s])
            lines.append(f"| {c['seq']} | " + " | ".join(vals) + " |")
    if s.get("tile_conformance"):  # each Mosaic GPU tile set against the float32 reference before it is timed
        lines += ["", "Mosaic GPU tile sets against the float32 reference (bf16, packed documents; the other head "
                  "class checked, not timed): " + "; ".join(f"`{name}` {e['status']} ({entry_summary(e)})"
                                                            for name, e in s["tile_conformance"].items()) + "."]
    return lines + [""]


def _train_step(s: dict) -> list[str]:
    lines = _head("Train step: DIFF and DIFF V2 vs Transformer", s)
    if "results" not in s:
        return lines
    peak = "unknown (MFU n/a)" if s["peak_flops"] is None else f"{s['peak_flops'] / 1e12:.0f} TFLOP/s"
    ok = [r for r in s["results"] if r["status"] in ("ok", "failed")]
    lines += [f"{s['config']}: each model against the Transformer with 2h heads of d (the same spec with "
              f"arch=transformer; DIFF V2's h heads of d are 2h query heads), AdamW step included, batch "
              f"{s['batch']}."]
    if any("compiled" in r for r in ok):  # compile only
        lines[-1] += (" Both steps of a pair compiled; the pair's memory: either step's plus the other model's state "
                      "(both are held while they alternate).")
        lines += ["", "| T × batch | pair | compile s | kernels | step memory GiB | pair memory GiB, of | fits |",
                  "|---|---|---|---|---|---|---|"]
        for r in ok:
            c = r["compiled"]
            lines.append(f"| {r['seq_len']} × {r['batch']} | {r['model']} + {s['baseline']} | "
                         + ", ".join(f"{v['compile_s']:.1f}" for v in c.values()) + " | "
                         + ", ".join(f"{op}: {k}" for v in c.values() for op, k in v["kernels"].items()) + " | "
                         + ", ".join(_gib(v["total_bytes"]) for v in c.values())
                         + f" | {_gib(r['pair_bytes'])} of {_gib(r['capacity_bytes'])} | "
                         f"{'yes' if r['pair_fits'] else 'NO'} |")
    else:
        lines[-1] += (f" Each pair in up to {s['steps']} interleaved rounds after {s['warmup']} warm-up. Peak per "
                      f"device: {peak}. MFU = algorithmic training FLOPs (`diffjax.flops`) × tokens/s / peak.")
        lines += ["", "| T × batch | pair | model | params | median step s | tokens/s | TFLOP/s | MFU | compile s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in ok:
            for name, m in r["models"].items():
                mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
                lines.append(f"| {r['seq_len']} × {r['batch']} | {r['model']} | {name} | {m['params']:,} | "
                             f"{m['median_s']:.4f} | {m['tokens_per_s']:,.0f} | {m['tflops_per_s']:.1f} | {mfu} | "
                             f"{m['compile_s']:.1f} |")
        ratios = [f"{r['model']} / {s['baseline']} at T = {r['seq_len']}: {_ratio(r['ratio'])} over {r['rounds']} "
                  f"rounds (FLOP ratio {r['flop_ratio']:.3f})" for r in ok]
        lines += ["", "Step time, median of per-round ratios: " + "; ".join(ratios) + "."]
    for r in s["results"]:
        if r["status"] not in ("ok", "failed"):
            lines += ["", f"T = {r['seq_len']}, {r['model']}: {r['status']}: `{r['error']}`."]
        if "trace" in r or "trace_error" in r:  # --trace: view with `xprof --logdir DIR` (pip install xprof)
            lines += ["", f"T = {r['seq_len']}, {r['model']} + {s['baseline']}, XProf trace: "
                      + (f"`{r['trace']}`." if "trace" in r else f"not taken: `{r['trace_error']}`.")]
    return lines + [""]


def _conformance(s: dict) -> list[str]:
    lines = _head("Kernel conformance (against the float32 XLA reference)", s)
    if "results" not in s:
        return lines
    lines += ["Norm-relative errors ‖x − ref‖/‖ref‖ of the output and of the worst gradient (q1, q2, k1, k2, v, λ; "
              "q, k, v for the standard op); every case causal. Case: B × T, H query heads / K kv heads, head dim d.",
              "", "| kernel | op | case | B × T, H/K, d | dtype | out | worst gradient | tolerance out / grads "
              "| result |", "|---|---|---|---|---|---|---|---|---|"]
    for r in s["results"]:
        c = r["case"]
        shape = f"{c['b']} × {c['t']}, {c['h']}/{c['k']}, {c['d']}" + (", segments" if c["segments"] else "")
        kernel = r["impl"] + (f" ({r['emulated']})" if r.get("emulated") else "")
        head = f"| {kernel} | {r['op']} | {c['name']} | {shape} | {r['dtype']} |"
        if "errors" in r:
            tol = f"{r['tolerance']['forward']:.0e} / {r['tolerance']['gradients']:.0e}"
            lines.append(f"{head} {_f(r['errors']['out'], '.1e')} | {r['worst_grad']} {_f(r['max_grad_error'], '.1e')} "
                         f"| {tol} | {r['status']} |")
        elif "compile_s" in r:
            lines.append(f"{head} | | | compiled in {r['compile_s']:.1f} s |")
        else:
            lines.append(f"{head} | | | {r['status']}: `{r.get('error')}` |")
    lines += [""] + [f"Skipped: {k['reason']}." for k in s["skipped"]]
    return lines + [""]


def _training_run(s: dict) -> list[str]:
    lines = _head("Training run", s)
    if "model" not in s:
        return lines
    m = s["model"]
    lines += [f"`{s['config']}` with {', '.join(s['overrides'])}: {m['arch']}, d_model {m['d_model']}, "
              f"{m['n_layers']} layers, {m['dtype']}, attention `{m['attention_kernel']}`.", ""]
    if "losses" in s:
        lines += ["| steps | loss, mean of first steps | loss, mean of last steps | went down | val loss | tokens/s "
                  "| seconds |", "|---|---|---|---|---|---|---|",
                  f"| {s['steps']} | {s['first_loss']:.4f} (first {s['window']}) | {s['last_loss']:.4f} (last "
                  f"{s['window']}) | {'yes' if s['loss_went_down'] else 'NO'} | {_f(s['val_loss'], '.4f')} | "
                  f"{_f(s['tokens_per_s'], ',.0f')} | {s['seconds']:.1f} |", ""]
    elif "fits" in s:
        lines += [f"Compiled in {s['compile_s']:.1f} s: kernels {s['kernels']}, {_gib(s['total_bytes'])} GiB of "
                  f"{_gib(s['capacity_bytes'])}: {'fits' if s['fits'] else 'does NOT fit'}.", ""]
    return lines
