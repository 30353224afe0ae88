"""Write docs/img/overview.svg, the picture in the README and on the docs home page.

Plain SVG written by hand (no plotting dependency, reviewable as text). What it shows is
the user's path through the commands and where each of the four systems plugs in; keep it
in step with docs/concepts/seams.md. Run: ``python docs/render_diagram.py``.
"""

from __future__ import annotations

from pathlib import Path

OUT = Path(__file__).resolve().parent / "img" / "overview.svg"

# (x, y, w, h, title, subtitle, fill): one box per step of the path.
BOXES = [
    (10, 40, 150, 60, "model", "zoo / HF checkpoint", "#e8eaf6"),
    (190, 40, 150, 60, "profile", "routing trace + compute", "#e8eaf6"),
    (370, 40, 150, 60, "predict", "expert popularity", "#e8eaf6"),
    (550, 40, 170, 60, "plan", "memory, replicas, method", "#e8eaf6"),
    (550, 160, 170, 60, "deploy", "local | ray | aws", "#e8eaf6"),
    (300, 160, 220, 60, "engine + serve", "OpenAI API, /metrics, bill", "#e8eaf6"),
    (10, 160, 260, 60, "simulate / compare", "same plan, meter, metrics", "#e8eaf6"),
]
# (x1, y1, x2, y2): arrows between the boxes.
ARROWS = [(160, 70, 190, 70), (340, 70, 370, 70), (520, 70, 550, 70), (635, 100, 635, 160),
          (550, 190, 520, 190)]
# Polylines (points): the plan also feeds the simulator and `compare`.
PATHS = [[(575, 100), (575, 140), (140, 140), (140, 160)]]
# (x, y, text): which paper decides what, under the box it plugs into.
NOTES = [
    (190, 125, "ODS/BO: Bayes predictor, ODS + BO planner, 3 scatter-gather methods"),
    (645, 125, "Remoe: main + remote"),
    (300, 245, "BrownoutServe: united experts, SALC"),
    (550, 245, "sMoE: learned autoscaler"),
]


def render() -> str:
    """The SVG document as text."""
    parts = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="770" height="270" '
        'font-family="Helvetica, Arial, sans-serif">',
        '<defs><marker id="a" markerWidth="10" markerHeight="8" refX="9" refY="4" '
        'orient="auto"><path d="M0,0 L10,4 L0,8 z" fill="#3949ab"/></marker></defs>',
        '<rect width="770" height="270" fill="white"/>',
        '<text x="10" y="22" font-size="15" font-weight="bold">moefleet: '
        "cheapest billed cost at a latency SLO</text>",
    ]
    for x, y, w, h, title, sub, fill in BOXES:
        parts.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="{fill}" '
                     'stroke="#3949ab"/>')
        parts.append(f'<text x="{x + w / 2}" y="{y + 26}" font-size="14" font-weight="bold" '
                     f'text-anchor="middle">{title}</text>')
        parts.append(f'<text x="{x + w / 2}" y="{y + 45}" font-size="11" '
                     f'text-anchor="middle" fill="#333">{sub}</text>')
    for x1, y1, x2, y2 in ARROWS:
        parts.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#3949ab" '
                     'stroke-width="2" marker-end="url(#a)"/>')
    for pts in PATHS:
        d = " ".join(f"{x},{y}" for x, y in pts)
        parts.append(f'<polyline points="{d}" fill="none" stroke="#3949ab" stroke-width="2" '
                     'marker-end="url(#a)"/>')
    for x, y, text in NOTES:
        parts.append(f'<text x="{x}" y="{y}" font-size="11" fill="#b71c1c">{text}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
