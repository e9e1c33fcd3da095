"""Targets, PASS/MISS verdicts, table and plot of the host-overhead benchmark (issue 11).

Targets per decode step: host time <= 300 us + 2 us x batch (stretch: 100 us + 0.5 us x batch);
eager kernel launches per target decoder layer <= 12; with CUDA graphs, the host launches
nothing per step but the graph replays.
"""

from __future__ import annotations

from pathlib import Path

import benchlib


def host_target_us(batch: int, stretch: bool = False) -> float:
    """The issue's per-step host budget for ``batch`` sequences."""
    return 100.0 + 0.5 * batch if stretch else 300.0 + 2.0 * batch


def verdicts(row: dict) -> dict[str, str]:
    """PASS / MISS per target for one result row (a missing figure gives ``-``)."""
    out = {}
    host = row.get("host_us")
    out["host"] = "-" if host is None else (
        "PASS" if host <= host_target_us(row["batch"]) else "MISS")
    out["stretch"] = "-" if host is None else (
        "PASS" if host <= host_target_us(row["batch"], True) else "MISS")
    per_layer = row.get("launches_per_layer")
    if row.get("graphs") and row.get("graph_replays"):
        # host->device copies into the graphs' static inputs are allowed; kernels are not
        kernels = row["launches"] - row.get("copies", 0)
        out["launches"] = "PASS" if kernels == 0 else "MISS"
    else:
        out["launches"] = "-" if per_layer is None else ("PASS" if per_layer <= 12 else "MISS")
    return out


def print_table(rows: list[dict]) -> None:
    fmt = benchlib.fmt
    head = (f"{'backend':7} {'graphs':6} {'B':>4} {'k':>2} {'draft':5} {'host us':>9} "
            f"{'target':>7} {'ok':4} {'stretch':>7} {'ok':4} {'wall us':>9} {'launch':>7} "
            f"{'/layer':>6} {'ok':4} {'replay':>6} {'syncs':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        b = r["batch"]
        print(f"{r['backend']:7} {r['graphs']!s:6} {b:>4} {r['k']:>2} {r['draft']:5} "
              f"{fmt(r.get('host_us'), '9.0f')} {host_target_us(b):7.0f} "
              f"{r['host_verdict']:4} {host_target_us(b, True):7.0f} {r['stretch_verdict']:4} "
              f"{fmt(r.get('wall_us'), '9.0f')} {fmt(r.get('launches'), '7.0f')} "
              f"{fmt(r.get('launches_per_layer'), '6.1f')} {r['launches_verdict']:4} "
              f"{fmt(r.get('graph_replays'), '6.0f')} {fmt(r.get('syncs'), '5.0f')}")
        if "error" in r:
            print(f"  error: {r['error']}")


def plot(rows: list[dict], out_dir: Path) -> None:
    plt = benchlib.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    keys = sorted({(r["backend"], str(r["graphs"]), r["k"], r["draft"]) for r in rows})
    for key in keys:
        sel = [r for r in rows if (r["backend"], str(r["graphs"]), r["k"], r["draft"]) == key
               and r.get("host_us") is not None]
        if sel:
            ax.plot([r["batch"] for r in sel], [r["host_us"] for r in sel], "o-",
                    label=f"{key[0]} graphs={key[1]} k={key[2]} {key[3]}")
    batches = sorted({r["batch"] for r in rows})
    ax.plot(batches, [host_target_us(b) for b in batches], "k--", label="target")
    ax.plot(batches, [host_target_us(b, True) for b in batches], "k:", label="stretch")
    ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="host µs per decode step")
    ax.legend(fontsize=6)
    benchlib.save_figure(fig, out_dir, "host_overhead")
