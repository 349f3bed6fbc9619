"""What a `kvpush bench serve` run leaves: table.md, its plots (per placement, TTFT and
TPOT by configuration, where the mean TTFT goes, TTFT's CDF; matplotlib, from the
`bench` extra) and its exit status."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpush.bench.progress import Progress
from kvpush.bench.report import Report
from kvpush.bench.serve import (
    CONFIGS,
    REST,
    REST_FROM_PREFILL,
    TIME_GOES,
    UPSTREAM,
    Bench,
    Cell,
    Settings,
    cell_count,
    markdown,
    where_time_goes,
)


def _pyplot() -> Any:
    """matplotlib's pyplot drawing to files, or None (said) where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvpush bench serve: no matplotlib, no plots (pip install matplotlib)",
              file=sys.stderr)  # fmt: skip
        return None
    return plt


def plots(cells: list[Cell], out: Path) -> list[Path]:
    """Per placement: TTFT and TPOT p50 by configuration (against request rate, or as
    bars when the run had one rate), where the mean TTFT goes, and TTFT's CDF."""
    plt = _pyplot()
    if plt is None:
        return []
    written = []
    for placement in sorted({c.placement for c in cells}):
        mine = [c for c in cells if c.placement == placement]
        for metric, label in (("ttft_p50_ms", "TTFT p50 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)")):
            figure = _by_rate(plt, mine, metric, label)
            written.append(_save(plt, figure, out / f"{metric.split('_')[0]}-{placement}.png"))
        figure = _per_cell(plt, mine, _where_bars, "mean TTFT (ms)")
        written.append(_save(plt, figure, out / f"where-{placement}.png"))
        figure = _per_cell(plt, mine, _cdf_lines, "share of requests")
        written.append(_save(plt, figure, out / f"ttft-cdf-{placement}.png"))
    return written


def ttft_cdf(cells: list[Cell], path: Path, where: str) -> list[Path]:
    """Every request's TTFT as a CDF per configuration, a panel per (length, rate);
    `where` names the cells' deployment in the titles (a fleet's shape and placement)."""
    plt = _pyplot()
    if plt is None:
        return []
    return [_save(plt, _per_cell(plt, cells, _cdf_lines, "share of requests", where), path)]


def _configs(cells: list[Cell]) -> list[str]:
    """The cells' configurations: serve's in its order, then others (a fleet's) as met."""
    met = list(dict.fromkeys(c.config for c in cells))
    return [c for c in CONFIGS if c in met] + [c for c in met if c not in CONFIGS]


def _color(config: str, cells: list[Cell]) -> str:
    """One colour per configuration in every plot of a run."""
    if config in CONFIGS:
        return f"C{CONFIGS.index(config)}"
    others = [c for c in _configs(cells) if c not in CONFIGS]
    return f"C{len(CONFIGS) + others.index(config)}"


def _by_rate(plt: Any, cells: list[Cell], metric: str, label: str) -> Any:
    """A panel per prompt length: a line per configuration against request rate, or,
    with one rate, a bar per configuration (one point a line says nothing)."""
    lengths = sorted({c.prompt_len for c in cells})
    rates = sorted({c.rate for c in cells})
    figure, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for axis, length in zip(axes[0], lengths, strict=True):
        here = [c for c in cells if c.prompt_len == length and getattr(c, metric) is not None]
        if len(rates) == 1:
            names = _configs(here)
            values = [next(getattr(c, metric) for c in here if c.config == n) for n in names]
            bars = axis.bar(names, values, color=[_color(n, here) for n in names])
            axis.bar_label(bars, fmt="%.0f")
            axis.set_title(f"{length}-token prompts, {rates[0]:g}/s, {cells[0].placement}")
        else:
            for config in _configs(here):
                points = sorted((c.rate, getattr(c, metric)) for c in here if c.config == config)
                axis.plot(*zip(*points, strict=True), marker="o", label=config,
                          color=_color(config, here))  # fmt: skip
            axis.set_title(f"{length}-token prompts, {cells[0].placement}")
            axis.set_xlabel("requests per second")
            axis.set_yscale("log")
            axis.legend()
        axis.set_ylabel(label)
    return figure


def _per_cell(plt: Any, cells: list[Cell], draw: Callable[[Any, list[Cell]], None],
              label: str, where: str = "") -> Any:  # fmt: skip
    """A panel per (prompt length, rate), drawn by `draw` from that cell's configurations;
    titled with `where` (by default the cells' placement)."""
    lengths = sorted({c.prompt_len for c in cells})
    rates = sorted({c.rate for c in cells})
    figure, axes = plt.subplots(
        len(rates), len(lengths), figsize=(6 * len(lengths), 4 * len(rates)), squeeze=False
    )
    for row, rate in enumerate(rates):
        for column, length in enumerate(lengths):
            axis = axes[row][column]
            draw(axis, [c for c in cells if c.prompt_len == length and c.rate == rate])
            axis.set_title(f"{length}-token prompts, {rate:g}/s, {where or cells[0].placement}")
            axis.set_ylabel(label)
    return figure


def _where_bars(axis: Any, cells: list[Cell]) -> None:
    """A stacked bar per configuration: its mean TTFT, part by part."""
    labels = [label for label, _ in TIME_GOES] + [REST, REST_FROM_PREFILL]
    names = _configs(cells)
    splits = {n: where_time_goes(next(c for c in cells if c.config == n)) for n in names}
    bottoms = [0.0] * len(names)
    for i, label in enumerate(labels):
        heights = [splits[n].get(label, 0.0) for n in names]
        if any(heights):
            axis.bar(names, heights, bottom=bottoms, label=label, color=f"C{i}")
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    whole = [sum(ms for part, ms in splits[n].items() if part not in labels) for n in names]
    if any(whole):  # configurations without spans: their TTFT is one part
        axis.bar(names, whole, bottom=bottoms, label="(no spans)", color="0.6")
    tops = [b + w for b, w in zip(bottoms, whole, strict=True)]
    axis.set_ylim(0, max(tops, default=0.0) * 1.08 or 1.0)  # the tallest bar's top in view
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _cdf_lines(axis: Any, cells: list[Cell]) -> None:
    """Each configuration's TTFTs as a cumulative distribution."""
    for config in _configs(cells):
        ttfts = next(c for c in cells if c.config == config).ttfts_ms
        if ttfts:
            # From 0 at the fastest request: each request is a rise of 1/n.
            shares = [i / len(ttfts) for i in range(len(ttfts) + 1)]
            axis.step([ttfts[0], *ttfts], shares, where="post", label=config,
                      color=_color(config, cells))  # fmt: skip
    axis.set_ylim(0, 1.02)
    axis.set_xlabel("TTFT (ms)")
    axis.set_xscale("log")
    axis.legend()


def _save(plt: Any, figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100, bbox_inches="tight")  # legends beside the panels too
    plt.close(figure)
    return path


def main(settings: Settings, out: Path, as_json: bool) -> int:
    report = Report(as_json, Progress("kvpush bench serve", "cell", cell_count(settings)))
    cells = Bench(settings, out, report).run()
    table = markdown(cells)
    (out / "table.md").write_text(table)
    written = plots(cells, out)
    report.finish(lambda _: print(table))
    print(f"kvpush bench serve: results in {out} ({len(written)} plots)", file=sys.stderr)
    # Upstream's failures are measured and reported, not ours to fail on.
    failed = sum(c.failures + c.mismatches for c in cells if c.config not in UPSTREAM)
    return 1 if failed else 0
