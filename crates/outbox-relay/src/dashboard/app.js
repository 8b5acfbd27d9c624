// The outbox-relay dashboard: polls the admin API every 2 s and draws what it says.
// No framework, no build step: every element is made with textContent (never innerHTML),
// so nothing an event carries can run as markup.
"use strict";

const POLL_MS = 2000;
// The dead letters are a query of their own, made by no other client: asked again when the
// dead count, the filter or the page changes, after a retry or purge, and else this often.
const DEAD_POLL_MS = 30000;
const TOKEN_KEY = "outbox-relay-admin-token";
const $ = (id) => document.getElementById(id);

const state = {
  samples: [],          // history, oldest first
  lastAt: 0,            // the newest sample's `at`
  deadAfter: 0,         // the page of dead letters shown starts after this id
  deadAsked: "",        // what the dead letters shown answered: query and dead count
  deadAskedAt: 0,       // when
  nextAfter: null,      // the next page's `after`, when there is one
  selected: null,       // the sequence id shown in the detail panel
  deadKey: null,        // the dead-letter page shown, as JSON
};

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.round(seconds);
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}

function rate(value) {
  if (value === null || value === undefined) return "–";
  return value >= 100 ? value.toFixed(0) : value.toFixed(1);
}

async function api(path, options) {
  // With a token configured, the relay answers every call only with it.
  const t = token();
  const opts = Object.assign({}, options);
  if (t) opts.headers = Object.assign({}, opts.headers, { Authorization: "Bearer " + t });
  // Relative to the page's <base>: `/` alone, `/outboxes/NAME/` among several outboxes.
  const response = await fetch(path.replace(/^\//, ""), opts);
  let body = null;
  try { body = await response.json(); } catch (_) { body = null; }
  if (!response.ok) {
    const message = (body && body.error) || response.status + " " + response.statusText;
    throw Object.assign(new Error(message), { status: response.status });
  }
  return body;
}

// ---- the token, kept for this browser session only ----

function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

function showTokenState(configured) {
  const t = token();
  $("token-state").textContent = configured === false
    ? "read-only (the relay has no token)"
    : (t ? "token set" : "no token");
}

// The relay answered 401: it shows nothing without the token. Ask once per refusal, not on
// every poll (the focus would jump while the operator types).
let asked = false;
function askForToken() {
  const refused = token() !== "";
  const text = refused
    ? "The relay refused this admin token: enter the right one (top right)."
    : "This relay needs its admin token to show anything: enter it (top right).";
  $("live").textContent = text;
  $("live").classList.add("stale");
  $("token-state").textContent = refused ? "token refused" : "token needed";
  $("token").placeholder = "needed to read and change";
  if (!asked) {
    asked = true;
    message(text, false);
    $("token").focus();
  }
}

$("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const value = $("token").value.trim();
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  $("token").value = "";
  showTokenState();
  asked = false;
  message("", true);
  refresh();
});
$("token-forget").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  showTokenState();
});

// ---- charts: SVG drawn here ----

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  // Quarters of these are round numbers: the grid has four steps.
  for (const m of [1, 2, 4, 8, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function label(v) {
  if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (v >= 1e4) return (v / 1e3).toFixed(0) + "k";
  return Number.isInteger(v) ? String(v) : String(Number(v.toFixed(2)));
}

// series: [{name, color, points: [[atMs, value]]}] over the last hour up to `now`.
function drawChart(node, series, now, opts) {
  const w = node.clientWidth || 400, h = node.clientHeight || 150;
  const left = 40, right = 8, top = 16, bottom = 18;
  node.setAttribute("viewBox", `0 0 ${w} ${h}`);
  node.replaceChildren();
  // The last hour, or less while the relay has not been up that long (5 minutes at least).
  const first = Math.min(...series.flatMap((s) => s.points.map((p) => p[0])), now);
  const span = Math.min(3600e3, Math.max(300e3, now - first)), from = now - span;
  const minutes = Math.round(span / 60000);
  const top_ = Math.max(0, ...series.flatMap((s) => s.points.map((p) => p[1])));
  const max = niceMax(opts && opts.whole ? Math.max(4, top_) : top_);
  const x = (t) => left + ((t - from) / span) * (w - left - right);
  const y = (v) => top + (1 - v / max) * (h - top - bottom);
  for (let i = 0; i <= 4; i++) {
    const v = (max * i) / 4;
    node.append(svg("line", { x1: left, x2: w - right, y1: y(v), y2: y(v), class: i ? "grid" : "axis" }));
    const t = svg("text", { x: left - 4, y: y(v) + 3, "text-anchor": "end" });
    t.textContent = label(v);
    node.append(t);
  }
  for (const [m, anchor] of [[minutes, "start"], [minutes / 2, "middle"], [0, "end"]]) {
    const t = svg("text", { x: x(now - m * 60000), y: h - 4, "text-anchor": anchor });
    t.textContent = m ? `−${Number(m.toFixed(1))} min` : "now";
    node.append(t);
  }
  if (!series.some((s) => s.points.some((p) => p[0] >= from))) {
    const t = svg("text", { x: (left + w - right) / 2, y: h / 2, "text-anchor": "middle" });
    t.textContent = "no samples yet (one every 5 s)";
    node.append(t);
  }
  let lx = left + 4;
  for (const s of series) {
    const pts = s.points.filter((p) => p[0] >= from);
    if (pts.length) {
      const d = pts.map((p, i) => (i ? "L" : "M") + x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join("");
      node.append(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.8 }));
    }
    node.append(svg("rect", { x: lx, y: 3, width: 10, height: 3, fill: s.color }));
    const t = svg("text", { x: lx + 13, y: 9 });
    t.textContent = s.name;
    node.append(t);
    lx += 20 + s.name.length * 6;
  }
}

function drawCharts() {
  const s = state.samples;
  const now = s.length ? s[s.length - 1].at : Date.now();
  const series = (key) => s.map((p) => [p.at, p[key]]);
  drawChart($("chart-backlog"), [
    { name: "pending", color: "#1f5fbf", points: series("pending") },
    { name: "retrying", color: "#c47a00", points: series("retrying") },
    { name: "dead", color: "#b3261e", points: series("dead") },
  ], now, { whole: true });
  drawChart($("chart-lag"), [{ name: "oldest pending (s)", color: "#6b3fa0", points: series("oldest_age_seconds") }], now);
  const perSecond = (key) => {
    const out = [];
    for (let i = 1; i < s.length; i++) {
      const dt = (s[i].at - s[i - 1].at) / 1000;
      if (dt > 0) out.push([s[i].at, Math.max(0, s[i][key] - s[i - 1][key]) / dt]);
    }
    return out;
  };
  drawChart($("chart-rate"), [
    { name: "published", color: "#1e7d3c", points: perSecond("published") },
    { name: "retried", color: "#c47a00", points: perSecond("retried") },
    { name: "dead-lettered", color: "#b3261e", points: perSecond("dead_lettered") },
  ], now);
}

// ---- status ----

function cell(text, cls) { return el("td", cls ? { class: cls } : {}, text); }

function renderStatus(st) {
  $("identity").textContent = `v${st.version} (${st.commit}) · node ${st.node} · ${st.outbox}`;
  $("fig-pending").textContent = st.backlog.pending;
  $("fig-retrying").textContent = st.backlog.retrying;
  $("fig-dead").textContent = st.backlog.dead;
  $("fig-dead").classList.toggle("nonzero", st.backlog.dead > 0);
  $("fig-oldest").textContent = age(st.backlog.oldest_pending_age_seconds);
  $("fig-rate").textContent = rate(st.rates.published_per_second);
  const r = st.rates;
  const errors = r.retried_per_second === null ? null
    : r.retried_per_second + r.dead_lettered_per_second + r.store_errors_per_second;
  $("fig-errors").textContent = rate(errors);
  $("fig-published").textContent = st.totals.published;
  // The relay reads these from the database at most once per interval, for every viewer.
  $("as-of").textContent = `Backlog, destinations, nodes and partitions as of ${new Date(st.backlog.as_of).toLocaleTimeString()} (read at most every ${st.backlog.refresh_seconds} s)`;
  showTokenState(st.admin.token_configured);

  const rows = st.destinations.map((d) => el("tr", { "data-destination": d.destination },
    cell(d.destination), cell(d.pending, "num"), cell(d.retrying, "num"), cell(d.dead, "num"),
    cell(age(d.oldest_pending_age_seconds), "num")));
  // The relay lists the busiest destinations; the others are summed in one row.
  const rest = st.destinations_left_out;
  if (rest) {
    rows.push(el("tr", { class: "left-out" },
      cell(`${rest.destinations} more destinations`), cell(rest.pending, "num"),
      cell(rest.retrying, "num"), cell(rest.dead, "num"), cell("", "num")));
  }
  $("destinations").tBodies[0].replaceChildren(...(rows.length ? rows
    : [el("tr", {}, el("td", { colspan: 5, class: "empty" }, "no pending events or dead letters"))]));

  const select = $("dead-destination");
  const chosen = select.value;
  const names = st.destinations.filter((d) => d.dead > 0).map((d) => d.destination);
  if (chosen && !names.includes(chosen)) names.push(chosen);
  const options = ["", ...names];
  if ([...select.options].map((o) => o.value).join("\n") !== options.join("\n")) {
    select.replaceChildren(...options.map((n) => el("option", { value: n }, n || "all")));
    select.value = chosen;
  }

  const nodes = st.nodes.map((n) => el("tr", { "data-node": n.id },
    cell(n.id + (n.this_node ? " (this page's relay)" : "")),
    cell(age(n.heartbeat_due_in_seconds), "num"),
    cell(st.partitions ? n.partitions.length : "–", "num")));
  $("nodes").tBodies[0].replaceChildren(...(nodes.length ? nodes
    : [el("tr", {}, el("td", { colspan: 3, class: "empty" }, "no live nodes"))]));

  const grid = $("partitions");
  if (st.partitions) {
    // Blues and greens first: red is for unowned partitions.
    const colours = new Map(st.nodes.map((n, i) => [n.id, `hsl(${(210 + i * 67) % 300} 55% 50%)`]));
    grid.replaceChildren(...st.partitions.leases.map((p) => {
      const span = el("span", {
        title: `partition ${p.partition}: ${p.owner ? p.owner + ", epoch " + p.epoch : "unowned"}`,
        class: p.owner ? "" : "unowned",
      });
      if (p.owner) span.style.background = colours.get(p.owner) || "#889";
      return span;
    }));
    $("partitions-note").textContent = `${st.partitions.count} partitions, ${st.partitions.unowned.length} unowned`;
  } else {
    grid.replaceChildren();
    $("partitions-note").textContent = "this store has no partition leases (a single active relay)";
  }
}

// ---- dead letters ----

function message(text, ok) {
  const m = $("message");
  m.textContent = text;
  m.className = "message " + (ok ? "ok" : "bad");
}

async function mutate(path, body) {
  const t = token();
  if (!t) {
    message("Enter the admin token first (top right): retry and purge need it.", false);
    $("token").focus();
    return;
  }
  try {
    const r = await api(path, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    message(r.message, true);
  } catch (e) {
    message(e.message, false);
  }
  state.deadAskedAt = 0;
  await refresh();
}

function deadQuery() {
  const q = new URLSearchParams({ limit: "50" });
  if ($("dead-destination").value) q.set("destination", $("dead-destination").value);
  if ($("dead-type").value.trim()) q.set("type", $("dead-type").value.trim());
  if (state.deadAfter) q.set("after", String(state.deadAfter));
  return q;
}

const UUID_ROWS = "This table's rows have UUID ids, which cannot be chosen one by one here: "
  + "retry or purge them by destination (the buttons above), or with SQL";

function renderDead(page) {
  // Rebuilt only when it changed, so a focused button keeps the focus between polls.
  const key = JSON.stringify(page);
  if (key === state.deadKey) return;
  state.deadKey = key;
  state.nextAfter = page.next_after;
  $("dead-next").disabled = page.next_after === null;
  const rows = page.dead_letters.map((d) => {
    // A table whose rows have UUID ids (open-outbox, a custom mapping) lists them with
    // sequence id 0: no row can be chosen by it, so its buttons say what can be done.
    const chosen = d.sequence_id > 0;
    const off = chosen ? {} : { disabled: "", title: UUID_ROWS };
    return el("tr", {
      "data-id": d.sequence_id, class: chosen && d.sequence_id === state.selected ? "selected" : "",
    },
      chosen ? cell(d.sequence_id, "num") : el("td", { class: "num", title: UUID_ROWS }, "–"),
      cell(d.destination), cell(d.event_type), cell(d.attempts, "num"),
      el("td", { class: "error", title: d.last_error }, d.last_error),
      el("td", { class: "when", title: d.dead_at }, d.dead_at.slice(5, 19).replace("T", " ")),
      el("td", { class: "actions" },
        el("button", { type: "button", "data-action": "view", ...off, onclick: () => showEvent(d.sequence_id) }, "View"),
        el("button", { type: "button", class: "act", "data-action": "retry", ...off, onclick: () => mutate("/api/v1/dead-letters/retry", { ids: [d.sequence_id] }) }, "Retry"),
        el("button", { type: "button", class: "danger", "data-action": "purge", ...off, onclick: () => {
          if (confirm(`Delete dead letter ${d.sequence_id} for good?`)) mutate("/api/v1/dead-letters/purge", { ids: [d.sequence_id] });
        } }, "Purge")));
  });
  $("dead-letters").tBodies[0].replaceChildren(...(rows.length ? rows
    : [el("tr", {}, el("td", { colspan: 7, class: "empty" }, "no dead letters"))]));
}

async function showEvent(id) {
  state.selected = id;
  const detail = $("detail");
  try {
    const e = await api(`/api/v1/events/${id}`);
    const pretty = (v) => (typeof v === "string" ? v : JSON.stringify(v, null, 2));
    detail.replaceChildren(
      el("h3", {}, `Event ${e.sequence_id} (${e.state})`),
      el("dl", {},
        el("dt", {}, "event id"), el("dd", {}, e.event_id),
        el("dt", {}, "destination"), el("dd", {}, e.destination),
        el("dt", {}, "type"), el("dd", {}, e.event_type),
        el("dt", {}, "ordering key"), el("dd", {}, e.ordering_key ?? "–"),
        el("dt", {}, "attempts"), el("dd", {}, e.attempts),
        el("dt", {}, "created"), el("dd", {}, e.created_at ?? "–"),
        el("dt", {}, "dead since"), el("dd", {}, e.dead_at ?? "–")),
      el("strong", {}, "Last error"), el("pre", { id: "detail-error" }, e.last_error ?? "–"),
      el("strong", {}, "Payload"), el("pre", { id: "detail-payload" }, pretty(e.payload)),
      el("strong", {}, "Headers"), el("pre", {}, pretty(e.headers)));
  } catch (err) {
    detail.replaceChildren(el("p", { class: "message bad" }, `Event ${id}: ${err.message}`));
  }
  for (const tr of $("dead-letters").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.id === String(id));
  detail.focus();
}

$("dead-filter").addEventListener("submit", (e) => { e.preventDefault(); state.deadAfter = 0; refresh(); });
$("dead-first").addEventListener("click", () => { state.deadAfter = 0; refresh(); });
$("dead-next").addEventListener("click", () => {
  if (state.nextAfter !== null) { state.deadAfter = state.nextAfter; refresh(); }
});
// The bulk API selects by destination only: with a type filter, "all shown" would have
// been every type (a purge of every dead letter while one type was shown).
function bulkFollowsFilter() {
  const typed = $("dead-type").value.trim() !== "";
  for (const id of ["dead-retry-all", "dead-purge-all"]) {
    $(id).disabled = typed;
    $(id).title = typed ? "Clear the type filter: bulk actions select by destination only" : "";
  }
}
$("dead-type").addEventListener("input", bulkFollowsFilter);
function bulk(path, verb) {
  if ($("dead-type").value.trim() !== "") return;
  const destination = $("dead-destination").value;
  const body = destination ? { destination } : { all: true };
  // Quoted and cut: a writer chose the name, and could dress a purge up as something else.
  const shown = destination.length > 80 ? `${destination.slice(0, 80)}…` : destination;
  const what = destination ? `every dead letter of ${JSON.stringify(shown)}` : "every dead letter";
  if (confirm(`${verb} ${what}?`)) mutate(path, body);
}
$("dead-retry-all").addEventListener("click", () => bulk("/api/v1/dead-letters/retry", "Retry"));
$("dead-purge-all").addEventListener("click", () => bulk("/api/v1/dead-letters/purge", "Delete for good"));

// ---- polling ----

let busy = false;
async function refresh() {
  if (busy) return;
  busy = true;
  try {
    const [st, hist] = await Promise.all([
      api("/api/v1/status"),
      api(`/api/v1/history?after=${state.lastAt}`),
    ]);
    const query = deadQuery().toString();
    const asked = `${query} ${st.backlog ? st.backlog.dead : ""}`;
    const deadDue = asked !== state.deadAsked || Date.now() - state.deadAskedAt >= DEAD_POLL_MS;
    const dead = deadDue
      ? await api(`/api/v1/dead-letters?${query}`).catch((e) => ({ error: e }))
      : null;
    if (dead && !dead.error) {
      state.deadAsked = asked;
      state.deadAskedAt = Date.now();
    }
    renderStatus(st);
    if (hist.samples.length) {
      state.samples.push(...hist.samples);
      state.lastAt = hist.samples[hist.samples.length - 1].at;
      const from = state.lastAt - hist.span_seconds * 1000;
      state.samples = state.samples.filter((s) => s.at >= from);
    }
    drawCharts();
    if (dead && dead.error) message(dead.error.message, false);
    else if (dead) renderDead(dead);
    $("live").textContent = "live · updated " + new Date().toLocaleTimeString();
    $("live").classList.remove("stale");
    document.body.dataset.updated = String(Date.now());
  } catch (e) {
    if (e.status === 401) {
      askForToken();
    } else {
      $("live").textContent = "cannot reach the relay: " + e.message;
      $("live").classList.add("stale");
    }
  } finally {
    busy = false;
  }
}

showTokenState();
refresh();
setInterval(refresh, POLL_MS);
window.addEventListener("resize", drawCharts);
