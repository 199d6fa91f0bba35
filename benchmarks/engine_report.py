"""What bench_engine.py makes of its runs: per-request and per-batch figures, paired ratios, the
README table. No vLLM here: it reads the engines' JSON outputs and the hook timings.
"""
from __future__ import annotations

import statistics
from typing import Any

from engine_hooks import LOAD_HOOKS, SAVE_HOOKS, SCHEDULER_HOOKS


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between the two nearest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def hook_ms(hooks: list[tuple[str, int, int]], window: tuple[int, int], names: set[str]) -> float:
    """Milliseconds spent in `names` hooks that started inside `window` (monotonic ns)."""
    start, end = window
    return sum(b - a for h, a, b in hooks if h in names and start <= a <= end) / 1e6


def batch_figures(result: dict[str, Any], batch: int, hooks: list[tuple[str, int, int]],
                  window: tuple[int, int]) -> dict[str, Any]:
    """One engine's figures for one batch: TTFT per request (vLLM's first_token_latency), the
    batch's wall time, output tokens/s and the connector's hook time per request."""
    outputs = result["batches"][batch]
    wall = result["seconds"]["batches"][batch]
    ttfts = [o["metrics"]["first_token_latency"] for o in outputs if o.get("metrics")]
    n = len(outputs)
    tokens = sum(len(o["token_ids"]) for o in outputs)
    return {
        "requests": n, "wall_s": wall, "ttft_s": ttfts,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "batch_ttft_s": max(ttfts) if ttfts else float("nan"),
        "output_tok_s": tokens / wall if wall else float("nan"),
        "cached_tokens": [o["num_cached_tokens"] for o in outputs],
        "prompt_tokens": [len(o["prompt_token_ids"]) for o in outputs],
        "load_ms_per_req": hook_ms(hooks, window, LOAD_HOOKS) / n,
        "sched_ms_per_req": hook_ms(hooks, window, SCHEDULER_HOOKS) / n,
        "save_ms_per_req": hook_ms(hooks, window, SAVE_HOOKS) / n,
    }


def token_mismatches(outputs: list[dict], reference: list[dict]) -> list[int]:
    """Indices of the requests whose generated tokens differ from the reference run's."""
    return [i for i, (o, r) in enumerate(zip(outputs, reference, strict=True)) if o["token_ids"] != r["token_ids"]]


def median(values: list[float]) -> float:
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


def summarize(reps: list[dict[str, dict]], names: list[str], reference: str) -> dict[str, Any]:
    """reps: [{connector: batch_figures (+ "handoff_vs_recompute_ms")}] -> per connector medians
    over reps and, for each other connector, the median of the per-rep ratios ecd / other."""
    summary: dict[str, Any] = {"connectors": {}, "ratios": {}}
    keys = ("ttft_p50_s", "ttft_p99_s", "batch_ttft_s", "wall_s", "output_tok_s", "load_ms_per_req",
            "sched_ms_per_req", "save_ms_per_req", "saved_vs_recompute_ms")
    for name in names:
        rows = [rep[name] for rep in reps if name in rep]
        if rows:
            summary["connectors"][name] = {k: median([r[k] for r in rows if k in r]) for k in keys}
    if "ecd" in names:
        for other in names:
            if other == "ecd":
                continue
            pairs = [(rep["ecd"], rep[other]) for rep in reps if "ecd" in rep and other in rep]
            summary["ratios"][other] = {
                k: median([a[k] / b[k] for a, b in pairs if b.get(k)])
                for k in ("ttft_p50_s", "ttft_p99_s", "batch_ttft_s", "output_tok_s", "load_ms_per_req")}
            # the spread of the per-rep batch TTFT ratios: a stall of the machine lands in one row
            batch = [a["batch_ttft_s"] / b["batch_ttft_s"] for a, b in pairs if b.get("batch_ttft_s")]
            summary["ratios"][other]["batch_ttft_quartiles"] = (percentile(batch, 25), percentile(batch, 75))
    summary["reference"] = reference
    return summary


def _fmt(value: float, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if value != value else f"{value * scale:.{digits}f}"


def markdown_table(title: str, summary: dict[str, Any]) -> str:
    """The README rows: medians over reps; ratios are medians of per-rep ratios (ecd ÷ row)."""
    lines = [f"**{title}**", "",
             "| connector | TTFT p50 ms | TTFT p99 ms | batch TTFT ms | output tok/s | hand-off ms/req "
             "(worker load) | scheduler hooks ms/req | TTFT saved vs reference ms/req | ecd ÷ row: p50 / batch TTFT "
             "(quartiles of the per-rep batch ratio) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in summary["connectors"].items():
        ratio = summary["ratios"].get(name)
        ratio_text = "–"
        if ratio is not None:
            low, high = ratio["batch_ttft_quartiles"]
            ratio_text = (f"{_fmt(ratio['ttft_p50_s'], 1, 2)} / {_fmt(ratio['batch_ttft_s'], 1, 2)} "
                          f"({_fmt(low, 1, 2)}–{_fmt(high, 1, 2)})")
        lines.append(f"| {name} | {_fmt(row['ttft_p50_s'], 1e3)} | {_fmt(row['ttft_p99_s'], 1e3)} | "
                     f"{_fmt(row['batch_ttft_s'], 1e3)} | {_fmt(row['output_tok_s'])} | "
                     f"{_fmt(row['load_ms_per_req'], 1, 2)} | {_fmt(row['sched_ms_per_req'], 1, 2)} | "
                     f"{_fmt(row.get('saved_vs_recompute_ms', float('nan')), 1, 1)} | {ratio_text} |")
    return "\n".join(lines)
