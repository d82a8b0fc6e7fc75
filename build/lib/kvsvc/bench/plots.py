"""PNG charts of a benchmark run (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 1 << 20

PATHS = (("kvsvc_transfer_gbps", "kvsvc Transfer (end to end)"), ("kvsvc_wire_gbps", "kvsvc READs on the wire"),
         ("raw_nixl_gbps", "raw NIXL, same descriptors"), ("memcpy_gbps", "memcpy"))


def draw(res: dict[str, Any], out_dir: str) -> list[Path]:
    """bandwidth.png (GB/s vs request size, per path and block pattern) and latency.png
    (Transfer and wire percentiles vs requests in flight); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    patterns = sorted({p["pattern"] for p in res["sizes"]})
    fig, axes = plt.subplots(1, len(patterns), figsize=(6 * len(patterns), 4.5), squeeze=False)
    for ax, pattern in zip(axes[0], patterns, strict=True):
        rows = sorted((p for p in res["sizes"] if p["pattern"] == pattern), key=lambda p: p["bytes"])
        sizes = [p["bytes"] / MIB for p in rows]
        for key, label in PATHS:
            ys = [p.get(key) for p in rows]
            if all(y is not None for y in ys):
                ax.plot(sizes, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # memcpy and a 1-block Transfer are two orders of magnitude apart
        ax.set_xlabel("request size (MiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"bandwidth, {pattern} blocks")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "bandwidth.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    rows = sorted(res["concurrency"], key=lambda c: c["in_flight"])
    conc = [c for c in rows if c.get("api", "stream") == "stream"]
    others = [(api, [c for c in rows if c.get("api") == api]) for api in ("grpc-stream", "unary")]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    xs = [c["in_flight"] for c in conc]
    for key, label, style in (("transfer_p50_ms", "Transfer p50", "-o"), ("transfer_p99_ms", "Transfer p99", "--o"),
                              ("wire_p50_ms", "wire p50", "-s"), ("wire_p99_ms", "wire p99", "--s")):
        ax.plot(xs, [c[key] for c in conc], style, label=label)
    for (api, other), style in zip(others, (":v", ":^"), strict=True):
        if other:
            ax.plot([c["in_flight"] for c in other], [c["transfer_p50_ms"] for c in other], style,
                    label=f"Transfer p50, {'the stream over gRPC' if api == 'grpc-stream' else 'unary calls'}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("1-block requests in flight")
    ax.set_ylabel("ms")
    ax.set_title("latency vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    for c in conc:
        ax.annotate(f"{c['transfers_per_s']:.0f}/s", (c["in_flight"], c["transfer_p50_ms"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -10))
    fig.tight_layout()
    written.append(out / "latency.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
