#!/usr/bin/env python3
"""Chart for docs/benchmarks.md, drawn from the harness's results.jsonl.

Usage: plot.py results.jsonl chart.png

Three panels: throughput against iperf3 streams (upload solid, download
dashed), engine CPU seconds per GB against streams (upload), and engine RSS
against idle connections held. Only measured points are drawn; failed runs
and scenarios this build cannot run are left out.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot.py results.jsonl chart.png")
    recs = load(sys.argv[1])
    meta = next((r for r in recs if r["kind"] == "meta"), {})
    order = [r["id"] for r in recs if r["kind"] == "scenario" and r["available"]]
    runs = [r for r in recs if r["kind"] == "throughput" and r.get("error") is None
            and r.get("gbit_per_s") is not None]
    scale = [r for r in recs if r["kind"] == "scale" and r.get("rss_kib", 0) > 0]

    colors = {sid: f"C{i}" for i, sid in enumerate(order)}
    fig, (ax_t, ax_c, ax_m) = plt.subplots(1, 3, figsize=(16, 6.8))

    for sid in order:
        for direction, style in (("upload", "-"), ("download", "--")):
            pts = sorted((r["streams"], r["gbit_per_s"]) for r in runs
                         if r["scenario"] == sid and r["direction"] == direction)
            if pts:
                xs, ys = zip(*pts)
                ax_t.plot(xs, ys, style, marker="o", color=colors[sid],
                          label=f"{sid} {direction}")
        pts = sorted((r["streams"], r["cpu_s_per_gb"]) for r in runs
                     if r["scenario"] == sid and r["direction"] == "upload"
                     and r.get("cpu_s_per_gb") is not None)
        if pts:
            xs, ys = zip(*pts)
            ax_c.plot(xs, ys, "-", marker="o", color=colors[sid], label=sid)

    for ax in (ax_t, ax_c):
        ax.set_xscale("log", base=2)
        streams = sorted({r["streams"] for r in runs})
        if streams:
            ax.set_xticks(streams)
            ax.set_xticklabels([str(s) for s in streams])
        ax.set_xlabel("iperf3 parallel streams")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    ax_t.set_ylabel("Gbit/s (receiver)")
    ax_t.set_title("Throughput (solid: upload, dashed: download)")
    # Below the panel: with a dozen lines a legend inside hides the data.
    ax_t.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax_c.set_ylabel("engine CPU seconds per GB")
    ax_c.set_title("Engine CPU per GB moved (upload)")
    if ax_c.lines:
        ax_c.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)

    for sid in sorted({r["scenario"] for r in scale}):
        pts = sorted((r["connections"], r["rss_kib"] / 1024) for r in scale
                     if r["scenario"] == sid)
        idle = next(r["idle_rss_kib"] / 1024 for r in scale if r["scenario"] == sid)
        xs, ys = zip(*([(0, idle)] + pts))
        ax_m.plot(xs, ys, "-", marker="o", color=colors.get(sid, "C9"), label=sid)
        for x, y in pts:
            per = next(r["per_conn_bytes"] for r in scale
                       if r["scenario"] == sid and r["connections"] == x)
            ax_m.annotate(f"{per:.0f} B/conn", (x, y), textcoords="offset points",
                          xytext=(-10, 8), fontsize=7)
    ax_m.set_xlabel("idle TCP connections through the engine")
    ax_m.set_ylabel("engine RSS (MiB)")
    ax_m.set_title("Engine memory with idle connections")
    ax_m.grid(True, alpha=0.3)
    ax_m.set_ylim(bottom=0)
    if ax_m.lines:
        ax_m.legend(fontsize=7)
    else:
        ax_m.text(0.5, 0.5, "not measured", ha="center", transform=ax_m.transAxes)

    machine = f"{meta.get('cpu_model', '?')}, {meta.get('cores', '?')} cores, " \
              f"kernel {meta.get('kernel', '?')}, {meta.get('date', '?')}"
    fig.suptitle(f"kerntun netns benchmarks: {machine}", fontsize=10)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
