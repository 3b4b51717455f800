#!/usr/bin/env python3
"""Figures from a kvxfer_perf JSON file (kvxfer_perf -J FILE).

    python3 perf/plot_perf.py kvxfer_perf.json -o kvxfer_perf.png
    python3 perf/plot_perf.py --check kvxfer_perf.json      # assertions only, no matplotlib

The PNG has two panels (docs/PERFORMANCE.md, "kvxfer_perf"):
  1. time to ANCHOR_READY (dashed) and to COMPLETE (solid) against the KV
     size, one colour per codec and mode, medians of the timed batches;
  2. the timeline of one transfer (the JSON's "timeline": the last batch of
     Lynx progressive of the largest size): cumulative bytes received by
     traffic class (anchor, residual) against time since the later post, with
     ANCHOR_READY and COMPLETE marked, so that anchors landing first is
     visible.

--check verifies the run instead: every row was checked and has #wrong == 0
and no transfer failed (exit status 1 otherwise).  It needs only the Python
standard library.  Without matplotlib, plotting exits with status 77 (the
ctest skip code).
"""
import argparse
import json
import sys


def check(doc, path):
    rows = doc.get("rows", [])
    problems = []
    if not rows:
        problems.append("no rows")
    for r in rows:
        name = "%s B %s/%s" % (r.get("kv_bytes"), r.get("codec"), r.get("mode"))
        if r.get("wrong") is None:
            problems.append("%s: not checked (run kvxfer_perf with -c 1)" % name)
        elif r["wrong"] != 0:
            problems.append("%s: #wrong = %d" % (name, r["wrong"]))
    summary = doc.get("summary", {})
    if summary.get("failed"):
        problems.append("a transfer failed")
    if not summary.get("ok", False):
        problems.append("summary.ok is false")
    if problems:
        for p in problems:
            print("plot_perf.py: %s: %s" % (path, p), file=sys.stderr)
        return 1
    print("plot_perf.py: %s: %d rows, #wrong = 0 in every row, no failed transfer" %
          (path, len(rows)))
    return 0


def label(row):
    return "%s %s" % (row["codec"], row["mode"])


def plot(doc, out):
    try:
        import matplotlib
    except ImportError:
        print("plot_perf.py: matplotlib is not importable (python3 -m pip install matplotlib)",
              file=sys.stderr)
        return 77
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = doc.get("rows", [])
    opts = doc.get("options", {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))

    # (1) t_anchor and t_complete against the KV size, per codec and mode.
    series = {}
    for r in rows:
        series.setdefault(label(r), []).append(r)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, rs) in enumerate(sorted(series.items())):
        rs = sorted(rs, key=lambda r: r["kv_bytes"])
        x = [r["kv_bytes"] / 2**20 for r in rs]
        tc = [r["t_complete"]["median_us"] / 1e3 for r in rs]
        ta = [r["t_anchor"]["median_us"] / 1e3 for r in rs]
        c = colors[i % len(colors)]
        ax1.plot(x, tc, "-o", color=c, label=name + ": COMPLETE")
        if any(r["mode"] == "prog" for r in rs):
            ax1.plot(x, ta, "--s", color=c, label=name + ": ANCHOR_READY")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    sizes = sorted({r["kv_bytes"] / 2**20 for r in rows})
    if sizes:
        ax1.set_xticks(sizes)
        ax1.set_xticklabels(["%g" % s for s in sizes])
        ax1.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax1.set_xlabel("KV size per request (MiB, %s)" % opts.get("dtype", "bf16"))
    ax1.set_ylabel("time from the later post (ms, median)")
    req = opts.get("requests", 1)
    rate = opts.get("rate_limit")
    ax1.set_title("kvxfer_perf: -R %s, rate %s" % (req, rate if rate else "unlimited"))
    ax1.grid(True, which="both", alpha=0.3)
    if rows:
        ax1.legend(fontsize=8)

    # (2) cumulative bytes received by class for one transfer.
    tl = doc.get("timeline")
    if tl and tl.get("arrivals"):
        arr = sorted(tl["arrivals"], key=lambda a: a["t_us"])
        for cls, color in (("anchor", "tab:red"), ("residual", "tab:blue")):
            t, cum, total = [0.0], [0.0], 0
            for a in arr:
                if a["class"] != cls:
                    continue
                total += a["bytes"]
                t.append(a["t_us"] / 1e3)
                cum.append(total / 2**20)
            if total:
                ax2.step(t, cum, where="post", color=color, label="%s sections (%.1f MiB)" %
                         (cls, total / 2**20))
        ax2.axvline(tl["t_anchor_us"] / 1e3, color="tab:red", ls="--", lw=1,
                    label="ANCHOR_READY (last request)")
        ax2.axvline(tl["t_complete_us"] / 1e3, color="tab:blue", ls="--", lw=1,
                    label="COMPLETE (last request)")
        ax2.set_title("one batch: %s %s, %.0f MiB x %d request(s)" %
                      (tl["codec"], tl["mode"], tl["size_bytes"] / 2**20, tl["requests"]))
        ax2.legend(fontsize=8, loc="upper left")
    else:
        ax2.text(0.5, 0.5, "no timeline in the JSON", ha="center", va="center",
                 transform=ax2.transAxes)
    ax2.set_xlabel("time from the later post (ms)")
    ax2.set_ylabel("bytes received (MiB, cumulative)")
    ax2.grid(True, alpha=0.3)

    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("plot_perf.py: wrote %s" % out)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", help="kvxfer_perf -J output")
    ap.add_argument("-o", "--output", default="kvxfer_perf.png", help="PNG to write")
    ap.add_argument("--check", action="store_true",
                    help="only verify: #wrong == 0 in every row and no failed transfer")
    a = ap.parse_args()
    try:
        with open(a.json) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        print("plot_perf.py: cannot read %s: %s" % (a.json, e), file=sys.stderr)
        return 2
    if doc.get("tool") != "kvxfer_perf":
        print("plot_perf.py: %s is not kvxfer_perf output (tool = %r)" % (a.json, doc.get("tool")),
              file=sys.stderr)
        return 2
    if a.check:
        return check(doc, a.json)
    return plot(doc, a.output)


if __name__ == "__main__":
    sys.exit(main())
