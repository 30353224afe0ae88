"""``moefleet report DIR``: one self-contained HTML file from a compare run's folder.

Everything is inline (plots as base64 data URIs, the stylesheet, a few lines of script
that sort the table by a clicked column), so the file can be mailed or archived alone.
Every value is HTML-escaped. The table has one ``<tr data-policy=...>`` per row of
``results.json`` in the same order, its cells the same figures (3 significant digits):
the test reads it back against the JSON.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from moefleet.compare.output import RESULTS
from moefleet.errors import MoefleetError
from moefleet.report.tables import sig3

COLUMNS = (("policy", "policy"), ("family", "family"), ("platform", "platform"),
           ("cost_per_1m_usd", "USD / 1M output tokens"), ("ttft_p50_s", "TTFT P50 (s)"),
           ("ttft_p95_s", "TTFT P95 (s)"), ("tpot_p50_s", "TPOT P50 (s)"),
           ("tpot_p95_s", "TPOT P95 (s)"), ("slo_attainment", "SLO attainment"),
           ("cold_starts", "cold starts"), ("gpu_s", "GPU-seconds"),
           ("accuracy_cost", "accuracy cost"), ("fidelity", "fidelity"))

SCRIPT = """
document.querySelectorAll('th[data-col]').forEach(function (th) {
  th.addEventListener('click', function () {
    var tbody = document.querySelector('#rows tbody');
    var i = Array.prototype.indexOf.call(th.parentNode.children, th);
    var asc = th.dataset.asc !== '1';
    th.dataset.asc = asc ? '1' : '0';
    var rows = Array.prototype.slice.call(tbody.rows);
    rows.sort(function (a, b) {
      var x = a.cells[i].dataset.v, y = b.cells[i].dataset.v;
      var nx = parseFloat(x), ny = parseFloat(y);
      var c = (isNaN(nx) || isNaN(ny)) ? String(x).localeCompare(String(y)) : nx - ny;
      return asc ? c : -c;
    });
    rows.forEach(function (r) { tbody.appendChild(r); });
  });
});
"""

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:3px 6px}
th{background:#eef;cursor:pointer}td.n{text-align:right}tr.absent td{color:#888}
code{background:#f4f4f4;padding:1px 3px}img{max-width:100%}
"""


def cell_text(row: dict[str, Any], key: str) -> str:
    """What the table shows for ``key`` of a row (shared with the test)."""
    if row.get("absent") and key not in ("policy", "family", "platform"):
        return "absent" if key == "cost_per_1m_usd" else "-"
    v = row.get(key)
    if key == "slo_attainment" and v is not None:
        return f"{100 * v:.1f}%"
    if isinstance(v, int | float) and not isinstance(v, bool):
        return sig3(v)
    return "-" if v is None else str(v)


def _img(path: Path, alt: str) -> str:
    if not path.is_file():
        return f"<p>({html.escape(alt)}: not found)</p>"
    mime = "image/svg+xml" if path.suffix == ".svg" else "image/png"
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:{mime};base64,{data}">'


def render(data: dict[str, Any], folder: Path) -> str:
    e = html.escape
    head = "".join(f'<th data-col="{k}">{e(t)}</th>' for k, t in COLUMNS)
    body = []
    for r in data["rows"]:
        cells = []
        for k, _ in COLUMNS:
            v = r.get(k)
            sort = "" if r.get("absent") and k not in ("policy", "family", "platform") \
                else ("" if v is None else v)
            cls = ' class="n"' if isinstance(v, int | float) else ""
            cells.append(f'<td{cls} data-v="{e(str(sort))}">{e(cell_text(r, k))}</td>')
        klass = ' class="absent"' if r.get("absent") else ""
        body.append(f'<tr{klass} data-policy="{e(r["policy"])}" '
                    f'data-platform="{e(r["platform"])}">{"".join(cells)}</tr>')
    notes = "".join(
        f"<li><b>{e(r['policy'])}</b> ({e(r['platform'])}): "
        + (f"absent: {e(r['absent'])}" if r.get("absent") else e("; ".join(r["notes"])))
        + f"<br>reproduce: <code>{e(r['command'])}</code></li>" for r in data["rows"])
    inputs = e(json.dumps(data["inputs"], indent=1))
    scen = e(json.dumps([{k: v for k, v in s.items() if k != "traffic_detail"}
                         for s in data["scenarios"]], indent=1))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>moefleet compare: {e(data['inputs']['model'])}</title>
<style>{STYLE}</style></head><body>
<h1>moefleet compare: {e(data['inputs']['model'])} / {e(data['inputs']['traffic'])}</h1>
<p><b>Recommendation:</b> {e(data['recommendation'])}</p>
<p>Command: <code>{e(data['inputs'].get('command') or '')}</code></p>
<table id="rows"><thead><tr>{head}</tr></thead><tbody>
{chr(10).join(body)}
</tbody></table>
<p>Click a column header to sort. A policy meets the SLO when at least 90% of its requests
are within both the TTFT and the TPOT SLO.</p>
<h2>Cost vs P95 TPOT</h2>{_img(folder / 'pareto.svg', 'Pareto plot')}
<h2>Arrivals</h2>{_img(folder / 'arrivals.png', 'arrivals plot')}
<h2>Rows: notes and how to reproduce</h2><ul>{notes}</ul>
<h2>Inputs</h2><pre>{inputs}</pre><h2>Scenarios</h2><pre>{scen}</pre>
<script>{SCRIPT}</script></body></html>
"""


def write_report(folder: Path, out: Path | None = None) -> Path:
    from moefleet.io import write_text_atomic

    if not folder.is_dir():
        raise MoefleetError(f"{folder} is not a folder", "pass the -o folder of a compare run")
    res = folder / RESULTS
    if not res.is_file():
        raise MoefleetError(f"{folder} has no {RESULTS}",
                            "run moefleet compare ... -o FOLDER first")
    try:
        data = json.loads(res.read_text())
        _ = data["rows"], data["inputs"], data["recommendation"]
    except (ValueError, KeyError, TypeError) as err:
        raise MoefleetError(f"{res} is not a compare results file ({err})",
                            "re-run moefleet compare -o FOLDER") from None
    target = out or folder / "report.html"
    if target.is_dir():
        raise MoefleetError(f"-o {target} is a folder", "give a file path for the report")
    write_text_atomic(target, render(data, folder))
    return target
