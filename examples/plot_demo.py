#!/usr/bin/env python3
"""Figure from a disagg_demo JSON file (disagg_demo -J FILE): our Figure 11.

    ./build/examples/disagg_demo -J demo.json
    python3 examples/plot_demo.py demo.json -o demo.png
    python3 examples/plot_demo.py --check demo.json    # verdicts only, no matplotlib

Two panels against the link rate (log scale), one colour per mode (BF16, INT8,
INT4 monolithic; Lynx progressive + speculative), at the main prompt of the
run (config.prompt_len: its length in tokens, or with a GGUF model's text
prompts, config.text_prompts, the set: 0 chat, 1 long text; --prompt_len to
pick another):
  1. TTFT: the first output token emitted, ms from kvxfer_send;
  2. time to 64 final tokens (TT64T; TT32T when the run made fewer than 64).
Measured medians are solid lines with markers; the predictions of
kvxfer_spec_ttft_model (Lynx Eq. 16-20, docs/SPEC.md) are dashed lines of the
same colour.

--check only verifies the run: every output identical to plain decoding on
the received KV and every stage in order (exit status 1 otherwise); it needs
only the Python standard library.  Without matplotlib, plotting exits with
status 77 (the ctest skip code).
"""
import argparse
import json
import sys

MODES = [("bf16", "BF16 monolithic"), ("int8", "INT8 monolithic"),
         ("int4", "INT4 monolithic"), ("lynx", "Lynx progressive + speculative")]


def check(doc, path):
    verdict = doc.get("verdict", {})
    problems = []
    if not doc.get("runs"):
        problems.append("no runs")
    if verdict.get("not_identical", 1) != 0:
        problems.append("%s run(s) differ from decoding on the received KV" %
                        verdict.get("not_identical"))
    if verdict.get("stage_errors", 1) != 0:
        problems.append("%s run(s) with stages out of order" % verdict.get("stage_errors"))
    if problems:
        for p in problems:
            print("plot_demo.py: %s: %s" % (path, p), file=sys.stderr)
        return 1
    print("plot_demo.py: %s: %d runs, every output identical, every stage in order" %
          (path, len(doc["runs"])))
    return 0


def series(rows, mode, key):
    pts = sorted((r["rate_mbit"], r.get(key)) for r in rows if r["mode"] == mode)
    return [p[0] for p in pts if p[1] is not None], [p[1] for p in pts if p[1] is not None]


def plot(doc, out, prompt_len):
    try:
        import matplotlib
    except ImportError:
        print("plot_demo.py: matplotlib is not importable (python3 -m pip install matplotlib)",
              file=sys.stderr)
        return 77
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)

    cfg = doc.get("config", {})
    length = prompt_len if prompt_len is not None else cfg.get("prompt_len")
    rows = [r for r in doc.get("summary", []) if r["prompt_len"] == length]
    if not rows:
        have = sorted({r["prompt_len"] for r in doc.get("summary", [])})
        print("plot_demo.py: no summary rows for prompt_len %s (the run has %s)" % (length, have),
              file=sys.stderr)
        return 1
    text = cfg.get("text_prompts", False)
    prompt = ({0: "chat prompts", 1: "long text"}.get(length, "prompt set %s" % length) if text
              else "prompt %s tokens" % length)
    model = doc.get("model", "?").rsplit("/", 1)[-1]
    for ext in (".gguf", ".bin"):
        model = model[:-len(ext)] if model.endswith(ext) else model
    many = cfg.get("tokens", 64) >= 64
    late, late_pred, late_name = (("tt64_ms", "pred_tt64_ms", "time to 64 tokens (TT64T)")
                                  if many else
                                  ("tt32_ms", "pred_tt32_ms", "time to 32 tokens (TT32T)"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    colours = ["tab:gray", "tab:blue", "tab:green", "tab:red"]
    for ax, (key, pred, title) in zip(axes, [("ttft_ms", "pred_ttft_ms", "TTFT"),
                                             (late, late_pred, late_name)]):
        for (mode, name), c in zip(MODES, colours):
            x, y = series(rows, mode, key)
            px, py = series(rows, mode, pred)
            ax.plot(x, y, "o-", color=c, label=name + " (measured)")
            ax.plot(px, py, "--", color=c, alpha=0.8, label=name + " (ttft_model)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        rates = sorted({r["rate_mbit"] for r in rows})
        ax.set_xticks(rates)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("link rate (Mbit/s)")
        ax.set_ylabel("ms from kvxfer_send")
        ax.set_title("%s, %s, %s" % (title, model, prompt))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    cal = doc.get("calibration", {})
    fig.suptitle("disagg_demo: median of %s run(s); TPOT %.3f ms, per-token acceptance %.3f" %
                 (cfg.get("reps", "?"), cal.get("tpot_ms", float("nan")),
                  cal.get("accept_rate", float("nan"))), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print("plot_demo.py: wrote %s" % out)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json_file")
    ap.add_argument("-o", "--output", default="disagg_demo.png")
    ap.add_argument("--prompt_len", type=int, default=None,
                    help="prompt length (text prompts: set) to plot (default: the run's main one)")
    ap.add_argument("--check", action="store_true", help="verify the verdicts only")
    a = ap.parse_args()
    with open(a.json_file) as f:
        doc = json.load(f)
    if a.check:
        return check(doc, a.json_file)
    return plot(doc, a.output, a.prompt_len)


if __name__ == "__main__":
    sys.exit(main())
