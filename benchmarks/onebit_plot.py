"""An SVG of loss curves written by ``onebit_convergence.py --curves`` (no plotting
library needed): each curve a 10-step running mean.

    python benchmarks/onebit_plot.py OUT.svg f30.json f100.json:' (warm-up 100)' \\
        [--only OneBitAdam ...]

A file argument may end in ``:SUFFIX`` appended to its curves' names; ``--only NAME`` or
``NAME=LABEL`` picks the curves to draw and their legend (default: all, by name).
"""

from __future__ import annotations

import argparse
import json

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f"]
W, H, PAD = 720, 420, 50


def smooth(values: list[float], k: int = 10) -> list[float]:
    return [sum(values[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1))
            for i in range(len(values))]


def load(args: list[str]) -> dict[str, list[float]]:
    curves: dict[str, list[float]] = {}
    for arg in args:
        path, _, suffix = arg.partition(":")
        with open(path) as f:
            data = json.load(f)
        for name, values in data.get("loss", data).items():
            curves[name + suffix] = smooth(values)
    return curves


def svg(curves: dict[str, list[float]], title: str) -> str:
    lo = min(min(c) for c in curves.values())
    hi = max(max(c[5:]) for c in curves.values())
    steps = max(len(c) for c in curves.values())

    def xy(i: int, v: float) -> str:
        x = PAD + (W - 2 * PAD) * i / (steps - 1)
        y = H - PAD - (H - 2 * PAD) * (min(v, hi) - lo) / (hi - lo)
        return f"{x:.1f},{y:.1f}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle">{title}</text>',
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 15}" text-anchor="middle">step (0-{steps - 1})</text>',
           f'<text x="5" y="{PAD}">{hi:.2f}</text><text x="5" y="{H - PAD}">{lo:.2f}</text>']
    for n, (name, values) in enumerate(curves.items()):
        colour = COLOURS[n % len(COLOURS)]
        points = " ".join(xy(i, v) for i, v in enumerate(values))
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
                   f'points="{points}"/>')
        out.append(f'<text x="{W - PAD - 230}" y="{PAD + 15 * n}" fill="{colour}">'
                   f'{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("files", nargs="+")
    parser.add_argument("--only", nargs="*", default=None, help="curve names to keep")
    parser.add_argument("--title", default="loss, 10-step running mean")
    args = parser.parse_args()
    curves = load(args.files)
    if args.only:
        picked = [item.partition("=") for item in args.only]
        curves = {label or name: curves[name] for name, _, label in picked}
    with open(args.out, "w") as f:
        f.write(svg(curves, args.title))


if __name__ == "__main__":
    main()
