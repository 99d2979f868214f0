"""The token page: saved steps' records (token_records.step_tokens) -> one self-contained HTML page (inline CSS and
JS, no network), where each token is coloured by log rho = log pi_prox - log pi_behav, hovering or focusing it shows
its numbers, and a selector marks what an objective does to it. Pure: records in, a string out.

The records travel as JSON inside <script type="application/json">, ASCII-only and with <, > and & escaped, so no
token (`</script>`, a lone surrogate from bytes that are not UTF-8) can end the markup; the script writes every
piece with textContent, never as HTML.
"""
import html
import json
import math
import re

# What each objective does at R = 1 (the words only: the marks themselves come from loss.py, token_records.py)
OBJECTIVE_NOTES = {
    "ppo": "Eq. 1: the ratio R against pi_prox, no correction for the sampler; at R = 1 it marks nothing.",
    "naive": "Eq. 3: the sampler as the old policy. At R = 1 its ratio is R_hat = pi_prox / pi_behav = rho, so "
             "PPO's clip acts where rho leaves [1 - eps_low, 1 + eps_high] on the side of the advantage's sign: "
             "'clipped' (no gradient).",
    "decoupled": "Eq. 4: weight rho, clip around pi_prox; at R = 1 it marks nothing (the weight is rho itself).",
    "tis": "Eq. 5 (FlashRL): weight min(rho, C): 'truncated' where rho > C.",
    "acr": "Eq. 9 (QuRL): TIS's weight min(rho, C), and where rho > C the upper clip bound widens to "
           "(1 + eps_high) / r = (1 + eps_high) rho / C: 'truncated' and 'widened', the tokens whose gradient ACR "
           "keeps (rescues) once R passes 1 + eps_high, where TIS clips it.",
    "icepop": "IcePop token mask: weight rho inside [1/C, C], 0 outside: 'masked' (no gradient).",
    "seq-tis": "sequence TIS: every token weighted min(prod_t rho_t, C): the whole response 'truncated' (capped) "
               "where prod_t rho_t > C.",
    "geo-tis": "geometric-mean TIS: weight min(exp(mean_t log rho_t), C): the whole response 'truncated' where that "
               "mean passes C.",
    "seq-mask": "sequence mask (TRL's default): weight prod_t rho_t, and the whole response 'masked' (dropped) where "
                "prod_t rho_t leaves [1/C, C].",
}
MARK_WORDS = {"truncated": "weight truncated (capped at C)", "masked": "masked: weight 0, no gradient",
              "widened": "upper clip bound widened to (1 + eps) / r", "clipped": "clipped at R = 1: no gradient"}


def finite(value):
    """The value with every NaN or infinity (a hand-edited or damaged record) as None: JSON that JavaScript reads."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def script_json(value) -> str:
    """JSON that is safe inside a <script> element: ASCII, and no <, > or & that HTML could read."""
    text = json.dumps(finite(value), ensure_ascii=True, allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(records: list[dict], notes: list[str], title: str) -> str:
    """The whole page for these records (each a saved step), saying each note (what was skipped) at the top."""
    notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    parts = {"TITLE": html.escape(title), "NOTES": f'<ul id="notes">{notes_html}</ul>' if notes else "",
             "DATA": script_json({"steps": records, "objectives": OBJECTIVE_NOTES, "marks": MARK_WORDS})}
    return re.sub(r"%(TITLE|NOTES|DATA)%", lambda m: parts[m.group(1)], PAGE)


PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>%TITLE%</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1150px; padding: 12px 18px 60px; color: #222; }
h1 { font-size: 19px; margin: 4px 0 6px; }
#notes { background: #fff4d6; border: 1px solid #e0c060; padding: 6px 6px 6px 26px; margin: 6px 0; }
.controls { display: flex; flex-wrap: wrap; gap: 8px 22px; align-items: center; margin: 8px 0; position: sticky; top: 0;
  background: #fff; padding: 6px 0; border-bottom: 1px solid #ddd; z-index: 2; }
select { font-size: 14px; }
.bar { display: inline-block; width: 220px; height: 12px; vertical-align: middle;
  background: linear-gradient(to right, rgb(69,117,180), #fff, rgb(215,48,39)); border: 1px solid #999; }
.muted { color: #666; }
#about { margin: 4px 0; }
#markkey span.key { display: inline-block; margin-right: 14px; }
.card { border: 1px solid #ccc; border-radius: 4px; margin: 10px 0; padding: 6px 10px; }
.card h2 { font-size: 14px; margin: 0 0 2px; font-weight: 600; }
.question { color: #555; margin-bottom: 4px; white-space: pre-wrap; }
.tokens { font: 13px/1.6 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; word-break: break-all; }
.tok { display: inline-block; padding: 0 1px; margin: 1px 1px 0 0; border-radius: 2px; white-space: pre;
  line-height: 1.5; cursor: default; }
.tok:focus, .tok:hover { outline: 2px solid #000; }
.m-truncated { border-bottom: 3px solid #111; }
.m-masked { text-decoration: line-through 2px; opacity: 0.55; }
.m-widened { box-shadow: inset 0 0 0 2px #1a9850; }
.m-clipped { box-shadow: inset 0 0 0 2px #7b3294; }
.key .tok { padding: 0 4px; }
#info { position: absolute; display: none; background: #fffffb; border: 1px solid #555; padding: 6px 8px; z-index: 5;
  font: 12px/1.4 ui-monospace, Menlo, Consolas, monospace; box-shadow: 2px 2px 6px rgba(0,0,0,0.25); max-width: 520px; }
#info table { border-collapse: collapse; }
#info td { padding: 0 8px 0 0; white-space: nowrap; }
#info tr.sel { background: #e8eef8; font-weight: bold; }
</style></head>
<body>
<h1>%TITLE%</h1>
<div class="muted">rho = pi_prox / pi_behav: the full-precision learner's probability of the sampled token over the
quantized sampler's. Each objective is shown at R = 1 (pi_theta = pi_prox: the first minibatch's view).</div>
%NOTES%
<noscript><p>This page draws its tokens with JavaScript.</p></noscript>
<div class="controls">
  <label>step <select id="step"></select></label>
  <label>objective <select id="objective"></select></label>
  <span>rho <span id="lo"></span> <span class="bar"></span> <span id="hi"></span></span>
  <span id="settings" class="muted"></span>
</div>
<div id="about"></div>
<div id="markkey"></div>
<div id="responses"></div>
<div id="info" role="status"></div>
<script type="application/json" id="token-data">%DATA%</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("token-data").textContent);
const MARKS = Object.keys(DATA.marks);
const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e; };
const at = (v, i) => Array.isArray(v) ? v[i] : v;
const num = (x) => (typeof x === "number" && isFinite(x)) ? x : null;
function fmt(x) { x = num(x); if (x === null) return "n/a"; const a = Math.abs(x);
  return (a !== 0 && (a < 1e-3 || a >= 1e5)) ? x.toExponential(3) : String(Number(x.toPrecision(5))); }
function visible(piece) {  // whitespace and control characters stay visible
  if (typeof piece !== "string") piece = String(piece);
  if (piece === "") return "\u2205";
  return piece.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/\r/g, "\u240d")
    .replace(/[\u0000-\u001f\u007f-\u009f]/g, (c) => "\\x" + c.charCodeAt(0).toString(16).padStart(2, "0"));
}
function marked(obj, mark, i) { const m = obj && obj[mark];
  return m === "all" || (Array.isArray(m) && m.includes(i)); }
function cap(step) { const c = num(step.settings && step.settings.tis_cap); return c && c > 1 ? c : 2; }
function colour(logRho, scale) {  // diverging: blue below 1, red above, full colour at 1/C and C
  const t = Math.max(-1, Math.min(1, (num(logRho) || 0) / scale)), a = Math.abs(t);
  const end = t > 0 ? [215, 48, 39] : [69, 117, 180];
  const c = end.map((v) => Math.round(255 + (v - 255) * a));
  return { bg: `rgb(${c[0]},${c[1]},${c[2]})`, fg: a > 0.6 ? "#fff" : "#111" };
}
const steps = Array.isArray(DATA.steps) ? DATA.steps : [];
const objectives = [...new Set(steps.flatMap((s) => (s.responses || []).flatMap((r) => Object.keys(r.objectives || {}))))];
steps.forEach((s, i) => $("step").append(new Option(String(s.label || ("step " + s.step)), i)));
objectives.forEach((o) => $("objective").append(new Option(o, o)));
const hash = new URLSearchParams(location.hash.slice(1));
if (steps.length) {
  const wanted = steps.findIndex((s) => String(s.step) === hash.get("step"));
  $("step").value = wanted >= 0 ? wanted : steps.length - 1;
  const own = hash.get("objective") || (steps[$("step").value].settings || {}).objective;
  if (objectives.includes(own)) $("objective").value = own;
} else {
  $("responses").append(el("p", "", "No saved tokens to show" + (document.getElementById("notes") ? " (see above)." : ".")));
}
let current = null;
function draw() {
  const step = steps[$("step").value], objective = $("objective").value;
  if (!step) return;
  current = step; $("info").style.display = "none";
  const C = cap(step), scale = Math.log(C), set = step.settings || {};
  $("lo").textContent = "\u2264 " + fmt(1 / C); $("hi").textContent = "\u2265 " + fmt(C);
  const given = (v) => v !== null && v !== undefined;
  $("settings").textContent = [given(set.objective) ? "run's objective " + set.objective : null, "C = " + fmt(C),
    given(set.clip_low) ? "eps " + fmt(set.clip_low) + " / " + fmt(set.clip_high) : null,
    given(set.quant) ? "rollout " + set.quant + (given(set.quant_group) ? " g" + set.quant_group : "") : null,
    given(set.model) ? "model " + set.model : null, (step.responses || []).length + " responses shown" +
    (given(step.responses_in_step) ? " of " + step.responses_in_step : "")].filter(Boolean).join(" \u00b7 ");
  $("about").textContent = objective + ": " + (DATA.objectives[objective] || "");
  const counts = Object.fromEntries(MARKS.map((m) => [m, 0]));
  const box = $("responses"); box.replaceChildren();
  (step.responses || []).forEach((r, k) => {
    const card = el("div", "card"), obj = (r.objectives || {})[objective] || {};
    const n = r.ids.length, adv = Array.isArray(r.advantage) ? "per token" : fmt(r.advantage);
    const whole = MARKS.filter((m) => obj[m] === "all");
    const group = Array.isArray(r.group_rewards) ? ` (its group's: ${r.group_rewards.map(fmt).join(", ")})` : "";
    card.append(el("h2", "", `response ${k + 1} (row ${r.row}, ${r.why}) \u00b7 reward ${fmt(r.reward)}${group} \u00b7 ` +
      `advantage ${adv} \u00b7 ${n} tokens \u00b7 sum log rho ${fmt(r.seq_log_ratio)} (prod rho ` +
      `${fmt(Math.exp(num(r.seq_log_ratio) || 0))})` + (whole.length ? ` \u00b7 ${objective}: whole response ` +
      whole.join(", ") : "")));
    card.append(el("div", "question", String(r.question || "")));
    const line = el("div", "tokens");
    for (let i = 0; i < n; i++) {
      const logRho = (num(r.prox[i]) !== null && num(r.behav[i]) !== null) ? r.prox[i] - r.behav[i] : null;
      const c = colour(logRho, scale), piece = typeof r.pieces[i] === "string" ? r.pieces[i] : String(r.pieces[i]);
      const tok = el("span", "tok", visible(piece));
      tok.tabIndex = 0; tok.dataset.r = k; tok.dataset.i = i;
      tok.style.background = c.bg; tok.style.color = c.fg;
      for (const m of MARKS) if (marked(obj, m, i)) { tok.classList.add("m-" + m); counts[m]++; }
      line.append(tok);
      if (piece.includes("\n")) line.append(el("br"));
    }
    card.append(line); box.append(card);
  });
  const key = $("markkey"); key.replaceChildren();
  for (const m of MARKS) { const s = el("span", "key"); const t = el("span", "tok m-" + m, "tok");
    s.append(t, " " + DATA.marks[m] + ": " + counts[m]); key.append(s); }
  history.replaceState(null, "", "#step=" + encodeURIComponent(step.step) + "&objective=" + encodeURIComponent(objective));
}
function info(tok) {
  const r = current.responses[+tok.dataset.r], i = +tok.dataset.i, box = $("info");
  const b = num(r.behav[i]), p = num(r.prox[i]), lr = (b !== null && p !== null) ? p - b : null;
  const rows = [["token", `${i + 1} of ${r.ids.length}: "${visible(r.pieces[i])}" (id ${r.ids[i]})`],
    ["log pi_behav", fmt(b) + "  (quantized sampler)"], ["log pi_prox", fmt(p) + "  (full-precision learner)"],
    ["log rho", fmt(lr)], ["rho", null], ["advantage", fmt(at(r.advantage, i))]];
  const t = el("table");
  for (const [k, v] of rows) { const tr = el("tr"); tr.append(el("td", "", k));
    const td = el("td", "", v === null ? "" : v); td.colSpan = 3;
    if (k === "rho") { const s = el("span", "", lr === null ? "n/a" : fmt(Math.exp(lr))); s.id = "info-rho"; td.append(s); }
    tr.append(td); t.append(tr); }
  const head = el("tr"); ["objective", "weight", "clip range of R", "marks"].forEach((h) => head.append(el("td", "", h)));
  head.style.borderTop = "1px solid #999"; t.append(head);
  for (const [name, obj] of Object.entries(r.objectives || {})) {
    const tr = el("tr", name === $("objective").value ? "sel" : "");
    [name, fmt(at(obj.weight, i)), `[${fmt(at(obj.low, i))}, ${fmt(at(obj.high, i))}]`,
     MARKS.filter((m) => marked(obj, m, i)).join(", ") || "-"].forEach((v) => tr.append(el("td", "", v)));
    t.append(tr);
  }
  box.replaceChildren(t); box.style.display = "block";
  const rect = tok.getBoundingClientRect();
  const right = window.scrollX + document.documentElement.clientWidth - box.offsetWidth - 4;
  const left = Math.max(4, Math.min(window.scrollX + rect.left, right));
  box.style.left = left + "px"; box.style.top = (window.scrollY + rect.bottom + 6) + "px";
}
for (const type of ["mouseover", "focusin"]) $("responses").addEventListener(type, (e) => {
  if (e.target.classList && e.target.classList.contains("tok")) info(e.target); });
$("step").addEventListener("change", draw);
$("objective").addEventListener("change", draw);
draw();
document.body.dataset.ready = "1";
</script>
</body></html>
"""
