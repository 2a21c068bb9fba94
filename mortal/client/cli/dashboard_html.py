"""The dashboard's HTML: pages and the sections its script swaps in on every refresh, curves as inline SVG.

Who calls it: mortal/client/cli/dashboard.py, with the dicts of mortal/client/cli/dashboard_data.py. Pure:
no store, no clock. Everything that came from the store goes through `esc` (html.escape, quotes
too): completions are model text, and events, messages and paths are anyone's. The page loads one
stylesheet and one script from the dashboard itself (no CDN: it works offline), and the server's
Content-Security-Policy allows no other script, inline ones included.
"""

from __future__ import annotations

import html
import math
from typing import Any
from urllib.parse import quote, urlencode

from mortal.client.cli.output import fmt_float

CHART_WIDTH, CHART_HEIGHT = 560, 200
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 56, 12, 22, 28


def esc(value: Any) -> str:
    return html.escape("-" if value is None else str(value), quote=True)


def _num(value: float | None, digits: int = 3) -> str:
    return fmt_float(value, digits)


def run_url(name: str, **query: Any) -> str:
    params = {k: v for k, v in query.items() if v is not None}
    return f"/runs/{quote(name, safe='')}" + (f"?{urlencode(params)}" if params else "")


def page(title: str, body: str, api: str, refresh_seconds: float) -> str:
    """A whole page; its script polls `api` (with sections=1) every `refresh_seconds` and swaps the
    sections."""
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{esc(title)} · mortal</title>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        '<link rel=stylesheet href="/static/dashboard.css"></head>'
        f'<body data-api="{esc(api)}" data-refresh="{refresh_seconds:g}">'
        '<header><a href="/" class=brand>mortal</a> <span class=crumb>' + esc(title) + "</span>"
        "<span id=live class=live>live</span></header>"
        f"<main>{body}</main>"
        '<script src="/static/dashboard.js"></script></body></html>\n'
    )


def _table(headers: list[str], rows: list[list[str]], empty: str, cls: str = "") -> str:
    if not rows:
        return f"<p class=empty>{esc(empty)}</p>"
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


FINISHED = ("Succeeded", "Failed")
READY_EXPECTED = ("Running", "Recovering")  # phases where Ready=False means workers are missing


def condition_class(condition: dict[str, Any], phase: str) -> str:
    """A condition badge's colour: ok (green), bad (red), unknown (grey) or neutral (outlined, not a signal).

    A finished run's conditions are a record of its last moment, as describe lists them, not a state to act
    on: neutral, but on a Failed run a False one stays red (it may say why). Ready=False is expected outside
    Running and Recovering (pending, starting, suspended, finished): neutral."""
    status = condition["status"]
    if phase in FINISHED:
        return (
            "bad" if phase == "Failed" and status == "False" and condition["type"] != "Ready" else "neutral"
        )
    if condition["type"] == "Ready" and status == "False" and phase not in READY_EXPECTED:
        return "neutral"
    return {"True": "ok", "False": "bad"}.get(status, "unknown")


def condition_badges(conditions: list[dict[str, Any]], phase: str) -> str:
    """A badge per condition, coloured by condition_class; the status, reason and message on hover."""
    badges = []
    for c in conditions:
        tip = f"{c['type']}={c['status']}: {c['reason']}" + (f" ({c['message']})" if c.get("message") else "")
        tip += " (as the run ended)" if phase in FINISHED else ""
        badges.append(
            f'<span class="badge {condition_class(c, phase)}" title="{esc(tip)}">{esc(c["type"])}</span>'
        )
    return " ".join(badges) or "-"


def _path(path: str) -> str:
    """A path that may wrap after any '/' (a checkpoint path can be wider than its column)."""
    return "/<wbr>".join(esc(part) for part in path.split("/"))


def _phase(phase: str) -> str:
    return f'<span class="phase {esc(phase.lower())}">{esc(phase)}</span>'


def _step(run: dict[str, Any]) -> str:
    return f"{esc(run['step'])}/{esc(run['maxSteps'])}" if run.get("maxSteps") else esc(run.get("step"))


# -- the runs list ---------------------------------------------------------------------------------
def runs_sections(view: dict[str, Any]) -> dict[str, str]:
    rows = [
        [
            f'<a href="{esc(run_url(r["name"]))}">{esc(r["name"])}</a>',
            _phase(r["phase"]),
            _step(r),
            _num(r["reward"]),
            condition_badges(r["conditions"], r["phase"]),
            esc(r["age"]),
        ]
        for r in view["items"]
    ]
    table = _table(
        ["Name", "Phase", "Step", "Reward", "Conditions", "Age"],
        rows,
        "No runs in this store yet: mortalctl apply -f SPEC.yaml",
        "runs",
    )
    return {"runs": table}


def runs_page(view: dict[str, Any], refresh_seconds: float) -> str:
    sections = runs_sections(view)
    body = f"<h1>Training runs</h1><section id=runs>{sections['runs']}</section>"
    return page("runs", body, "/api/runs", refresh_seconds)


# -- one run ---------------------------------------------------------------------------------------
def _ticks(low: float, high: float, most: int = 5) -> list[float]:
    """Round values between low and high to label an axis with (at most about `most`)."""
    if high <= low:
        return [low]
    raw = (high - low) / most
    unit = 10 ** math.floor(math.log10(raw))
    step = next(m * unit for m in (1, 2, 2.5, 5, 10) if m * unit >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def chart(name: str, points: list[list[float]]) -> str:
    """One metric's curve over the steps as an SVG line chart (axes, ticks, the newest value in the title)."""
    if not points:
        return (
            f"<figure class=chart><figcaption>{esc(name)}</figcaption>"
            f"<p class=empty>no {esc(name)} recorded yet</p></figure>"
        )
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    else:
        margin = (y1 - y0) * 0.05
        y0, y1 = y0 - margin, y1 + margin
    width, height = CHART_WIDTH - PAD_LEFT - PAD_RIGHT, CHART_HEIGHT - PAD_TOP - PAD_BOTTOM

    def sx(x: float) -> float:
        return PAD_LEFT + (width * (x - x0) / (x1 - x0) if x1 > x0 else width / 2)

    def sy(y: float) -> float:
        return PAD_TOP + height * (1 - (y - y0) / (y1 - y0))

    parts = [
        f'<svg class=plot viewBox="0 0 {CHART_WIDTH} {CHART_HEIGHT}" role=img '
        f'aria-label="{esc(name)} by step">'
    ]
    for y in _ticks(y0, y1):
        parts.append(
            f'<line class=grid x1="{PAD_LEFT}" x2="{CHART_WIDTH - PAD_RIGHT}" '
            f'y1="{sy(y):.1f}" y2="{sy(y):.1f}"/>'
            f'<text class=tick x="{PAD_LEFT - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.4g}</text>'
        )
    for x in _ticks(x0, x1, 8) if x1 > x0 else [x0]:
        if x == int(x):
            parts.append(
                f'<text class=tick x="{sx(x):.1f}" y="{CHART_HEIGHT - 8}" '
                f'text-anchor="middle">{int(x)}</text>'
            )
    parts.append(
        f'<line class=axis x1="{PAD_LEFT}" x2="{PAD_LEFT}" y1="{PAD_TOP}" y2="{PAD_TOP + height}"/>'
        f'<line class=axis x1="{PAD_LEFT}" x2="{CHART_WIDTH - PAD_RIGHT}" y1="{PAD_TOP + height}" '
        f'y2="{PAD_TOP + height}"/>'
    )
    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys, strict=True))
    parts.append(f'<polyline class="series {esc(name)}" fill="none" points="{line}"/>')
    if len(points) == 1:
        parts.append(f'<circle class="series {esc(name)}" cx="{sx(xs[0]):.1f}" cy="{sy(ys[0]):.1f}" r="3"/>')
    parts.append("</svg>")
    caption = f"{esc(name)} <span class=latest>step {int(xs[-1])}: {ys[-1]:.4g}</span>"
    return f"<figure class=chart><figcaption>{caption}</figcaption>{''.join(parts)}</figure>"


def _text(value: str) -> str:
    return f"<pre>{esc(value)}</pre>"  # already cut to what a page shows (dashboard_data.cut)


def completion_cards(title: str, items: list[dict[str, Any]]) -> str:
    if not items:
        return f"<div class=samples><h3>{esc(title)}</h3><p class=empty>none scored</p></div>"
    cards = []
    for c in items:
        rewards = ", ".join(f"{esc(k)} {_num(v)}" for k, v in c["rewards"].items()) or "-"
        advantage = "-" if c["advantage"] is None else f"{c['advantage']:+.3f}"
        cards.append(
            f"<article class=sample><div class=meta><b>reward {_num(c['reward'])}</b>"
            f" · sample {esc(c['sample'])}"
            f" · advantage {esc(advantage)} · weights v{esc(c['weightVersion'])} · {rewards}</div>"
            f"<div class=prompt><span class=label>prompt</span>{_text(c['prompt'])}</div>"
            f"<div class=completion><span class=label>completion</span>{_text(c['completion'])}</div>"
            "</article>"
        )
    return f"<div class=samples><h3>{esc(title)}</h3>{''.join(cards)}</div>"


def completions_section(name: str, view: dict[str, Any], pinned: bool, shown: int) -> str:
    c = view["completions"]
    if c["step"] is None:
        return "<h2>Completions</h2><p class=empty>no completions recorded yet</p>"
    options = "".join(
        f'<option value="{s}"{" selected" if s == c["step"] and pinned else ""}>{s}</option>'
        for s in reversed(c["steps"])
    )
    latest = "" if pinned else " selected"
    picker = (
        f'<form method=get action="{esc(run_url(name))}" class=picker><label>step '
        f'<select name=step data-autosubmit><option value=""{latest}>latest ({c["steps"][-1]})</option>'
        f'{options}</select></label><input type=hidden name=k value="{shown}">'
        "<noscript><button>show</button></noscript></form>"
    )
    counts = f"{c['samples']} samples" + (f", {c['unscored']} unscored" if c["unscored"] else "")
    return (
        f"<h2>Completions of step {esc(c['step'])} <small>{esc(counts)}</small></h2>{picker}"
        f"<div class=pair>{completion_cards(f'worst {shown}', c['worst'])}"
        f"{completion_cards(f'best {shown}', c['best'])}</div>"
    )


def run_sections(view: dict[str, Any], pinned: bool, shown: int) -> dict[str, str]:
    """Each section of a run's page by its element id (the page, and what a refresh replaces)."""
    r = view["run"]
    name = r["name"]
    summary = [
        ("Phase", _phase(r["phase"])),
        ("Step", _step(r)),
        ("Reward", _num(r["reward"])),
        ("Weights", f"v{esc(r.get('weightVersion'))}"),
        ("Restarts", esc(r.get("restarts"))),
        ("Model", esc(r.get("model"))),
        ("Backend", esc(r.get("backend"))),
        ("Age", esc(r["age"])),
    ]
    message = (
        f"<p class=message>{esc(r.get('message') or r.get('error'))}</p>"
        if r.get("message") or r.get("error")
        else ""
    )
    summary_html = (
        "<dl class=summary>"
        + "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in summary)
        + f"</dl><p class=conditions>{condition_badges(r['conditions'], r['phase'])}</p>{message}"
    )
    curves = "".join(chart(metric, points) for metric, points in view["curves"].items())
    events = _table(
        ["Age", "Type", "Reason", "Message"],
        [
            [
                esc(e["age"]),
                f'<span class="etype {esc(e["type"].lower())}">{esc(e["type"])}</span>',
                esc(e["reason"]),
                esc(e["message"]),
            ]
            for e in view["events"]
        ],
        "no events yet",
        "events",
    )
    workers = _table(
        ["Role", "Replica", "Incarnation", "State", "GPU", "Step", "Weights", "Heartbeat", "Exit", "Age"],
        [
            [
                esc(w["role"]),
                esc(w["replica"]),
                esc(w["incarnation"]),
                f'<span class="wstate {esc(w["state"].lower())}" title="{esc(w["message"] or "")}">'
                f"{esc(w['state'])}</span>",
                esc(w["gpu"]),
                esc(w["step"]),
                esc(w["weightVersion"]),
                esc(w["heartbeat"]),
                esc(w["exitCode"]),
                esc(w["age"]),
            ]
            for w in view["workers"]
        ],
        "no workers yet",
        "workers",
    )
    checkpoints = _table(
        ["Step", "Weights", "Path", "Age"],
        [
            [esc(c["step"]), esc(c["weightVersion"]), f"<code>{_path(c['path'])}</code>", esc(c["age"])]
            for c in view["checkpoints"]
        ],
        "no checkpoints yet",
        "checkpoints",
    )
    return {
        "summary": summary_html,
        "curves": curves,
        "workers": f"<h2>Workers</h2>{workers}",
        "checkpoints": f"<h2>Checkpoints</h2>{checkpoints}",
        "events": f"<h2>Events</h2>{events}",
        "completions": completions_section(name, view, pinned, shown),
    }


def run_page(view: dict[str, Any], api: str, pinned: bool, shown: int, refresh_seconds: float) -> str:
    sections = run_sections(view, pinned, shown)
    body = (
        f"<h1>{esc(view['run']['name'])}</h1>"
        f"<section id=summary>{sections['summary']}</section>"
        f"<section id=curves class=curves>{sections['curves']}</section>"
        f"<div class=columns><section id=workers>{sections['workers']}</section>"
        f"<section id=checkpoints>{sections['checkpoints']}</section></div>"
        f"<section id=completions>{sections['completions']}</section>"
        f"<section id=events>{sections['events']}</section>"
    )
    return page(view["run"]["name"], body, api, refresh_seconds)


def error_page(status: str, message: str) -> str:
    return page(
        status,
        f'<h1>{esc(status)}</h1><p class=message>{esc(message)}</p><p><a href="/">all runs</a></p>',
        "",
        0,
    )
