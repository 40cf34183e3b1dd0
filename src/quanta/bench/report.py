"""Render a bench report: a text table for the terminal and a PNG (roofline chart + per-op bars)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt_spread(report: dict[str, Any], key: str, unit: str = "", digits: int = 1) -> str:
    s = report.get(f"{key}_spread")
    if s is None:
        return f"{report[key]:.{digits}f}{unit}"
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def _bandwidth(report: dict[str, Any]) -> str:
    """The read bandwidth's median, with its range where it was sampled more than once and moved."""
    s = report.get("bandwidth_gb_s_spread")
    return _fmt_spread(report, "bandwidth_gb_s") if s and s["min"] < s["max"] else f"{report['bandwidth_gb_s']:.1f}"


def format_table(report: dict[str, Any]) -> str:
    """The human-readable summary: one column per engine, ratios last."""
    engines = [("quanta", report)]
    if "baseline" in report:
        engines.append((report["baseline"]["engine"], report["baseline"]))
    rows = [
        ("prefill tok/s", lambda r: _fmt_spread(r, "prefill_tok_s")),
        ("TTFT ms", lambda r: _fmt_spread(r, "ttft_ms")),
        ("decode tok/s", lambda r: _fmt_spread(r, "decode_tok_s")),
        ("decode ms/token", lambda r: f"{r['decode_ms_per_token']:.2f}"),
    ]
    if report.get("depth"):
        rows.append((f"decode tok/s @ depth {report['depth']}", lambda r: _fmt_spread(r, "depth_decode_tok_s")))
    rows += [
        ("achieved GB/s", lambda r: f"{r['achieved_gb_s']:.1f}"),
        ("% of roofline", lambda r: f"{r['roofline_pct']:.1f}%"),
    ]
    if "cold_start_s" in report:
        rows.append(("cold start → first token s", lambda r: f"{r.get('cold_start_s', float('nan')):.2f}"))
        rows.append(("peak RSS MB", lambda r: f"{r.get('peak_rss_bytes', 0) / 1e6:.0f}"))
    if "cold_start_empty_cache_s" in report:  # quanta's alone: llama.cpp compiles nothing at start
        rows.append(("… with an empty kernel cache s", lambda r: f"{r['cold_start_empty_cache_s']:.2f}"
                     if "cold_start_empty_cache_s" in r else "—"))
    where = f"{report['device']} ({report['device_name']})" if "device_name" in report else report["device"]
    if report["device"] == "cpu" or "baseline" in report:  # the GPU runs no CPU threads; llama.cpp does
        where += f" · {report['threads']} threads"
    head = (f"model {report['model']} · {where} · "
            f"p={report['prompt_tokens']} n={report['decode_tokens']} · {report['repeats']} repeats · median (min–max)\n"
            f"bytes read per token {report['bytes_per_token'] / 1e6:.1f} MB · "
            f"measured read bandwidth {_bandwidth(report)} GB/s · "
            f"roofline {report['bandwidth_gb_s'] * 1e9 / report['bytes_per_token']:.0f} tok/s")
    width = max(len(r[0]) for r in rows) + 2
    cols = [max(24, len(name) + 2) for name, _ in engines]
    lines = [head, "", " " * width + "".join(f"{name:<{c}}" for (name, _), c in zip(engines, cols))]
    for label, fn in rows:
        lines.append(f"{label:<{width}}" + "".join(f"{fn(r):<{c}}" for (_, r), c in zip(engines, cols)))
    if "baseline" in report:
        ratios = [f"decode {report['decode_ratio']:.2f}×", f"prefill {report['prefill_ratio']:.2f}×"]
        if "depth_decode_ratio" in report:
            ratios.append(f"decode@depth {report['depth_decode_ratio']:.2f}×")
        if "cold_start_ratio" in report:
            ratios.append(f"cold start {report['cold_start_ratio']:.2f}× (lower is better)")
        lines += ["", "quanta vs llama.cpp: " + ", ".join(ratios)]
    for phase, ops in report.get("breakdown", {}).items():
        unit = "ms/token" if phase == "decode" else "ms/prompt"
        total = sum(ops.values()) or 1.0
        lines += ["", f"{phase} breakdown ({unit}; {report.get('breakdown_of', 'ops')}):"]
        lines += [f"  {op:<28}{ms:9.3f}  {100 * ms / total:5.1f}%" for op, ms in ops.items()]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Roofline chart (decode tok/s of each engine against the bandwidth ceiling) and per-op decode bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    engines = [("quanta", report)] + ([("llama.cpp", report["baseline"])] if "baseline" in report else [])
    roof = report["bandwidth_gb_s"] * 1e9 / report["bytes_per_token"]
    names = [n for n, _ in engines]
    ax1.bar(names, [r["decode_tok_s"] for _, r in engines], color=["tab:blue", "tab:orange"][: len(engines)])
    ax1.axhline(roof, color="k", linestyle="--", label=f"roofline {roof:.0f} tok/s")
    for i, (_, r) in enumerate(engines):
        ax1.text(i, r["decode_tok_s"], f"{r['decode_tok_s']:.0f} ({r['roofline_pct']:.0f}%)", ha="center",
                 va="bottom")
    ax1.set_ylabel("decode tok/s")
    ax1.set_title("decode vs memory roofline")
    ax1.legend()
    ops = report.get("breakdown", {}).get("decode", {})
    if ops:
        ax2.barh(list(ops)[::-1], list(ops.values())[::-1])
        ax2.set_xlabel("ms per token")
        ax2.set_title(f"quanta decode time ({report.get('breakdown_of', 'ops')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
