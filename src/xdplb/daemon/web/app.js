// xdplb status page: polls GET /api/v1/status and GET /api/v1/history (only the intervals
// newer than it has: ?since=) every second and updates the page in place.
//
// Plain JavaScript, no framework and no build step: the daemon serves this file as is.
// Every value from the daemon goes into the page through textContent or an attribute,
// never innerHTML, so backend names cannot inject markup.
//
// Hooks for tests and scripts (stable: tests/e2e/test_status_page.py relies on them):
//   body[data-updated]        successful polls so far ("0" before the first)
//   body[data-connection]     "connecting" | "live" | "disconnected"
//   [data-field=connection]   the same, as text; [data-field=error] the last failure
//   [data-field=instance|attached|uptime|conn_table|rebuilds|health_checks]  summary
//   [data-field=reload_error]  banner, hidden unless the last reload was refused; the
//         reason in [data-field=reload_error_text]
//   [data-vip="<vip name>"]   one card per VIP (name as in Status, "198.18.100.1:80/tcp")
//     [data-field=table|encap|hash]                  table kind and size, encapsulation
//     [data-field=all_down]                          warning banner (hidden unless all_down)
//     [data-field=rate_packets|rate_bits|rate_new_flows]  per second between the last two
//         polls; data-value holds the number ("" until two polls have been seen)
//     svg[data-field=vip_spark]  the VIP's packets/s over the daemon's history (below)
//     [data-field=share_bar] > [data-segment="<backend address>"]  one segment per backend,
//         width = its table share; data-value = the share (0..1)
//     [data-field=legend] > [data-legend="<backend address>"]
//     tr[data-backend="<backend address>"]  one row per backend, cells:
//         [data-field=address|health|admin|weight|effective_weight|established|share]
//         (health's title holds the check's detail; share's data-value the fraction)
//         [data-field=health_for]  how long the health state has lasted ("12s",
//             data-value = seconds; "" if never checked)
//         svg[data-field=spark]  sparkline of the backend's packets/s (over all its VIPs)
//             in the daemon's history: data-points = values drawn (intervals with a
//             rate), data-max = the top of its scale; [data-field=pps] the last rate
//         button[data-action="drain"|"enable"]  POSTs .../backends/<address>/<action>
//   [data-field=drops|events] > li[data-drop|data-event="<name>"]  non-zero counters,
//         data-value = the count
//   [data-field=acl] > tr[data-acl="<scope>"]  ACL hits per scope ("global", a VIP's
//         name), cells [data-field=allow|deny|default], data-value = the count
"use strict";

const API = "/api/v1";
const POLL_MS = 1000;
const POLL_TIMEOUT_MS = 2500;
const TOKEN_KEY = "xdplb.token";
const PALETTE = [
  "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
  "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
];

// ---- the bearer token -------------------------------------------------------------------
// Opened as /?token=...: keep the token for this tab only and take it out of the address
// bar at once, so it does not end up in the history, bookmarks or screenshots.
function takeToken() {
  let token = null;
  try {
    const url = new URL(window.location.href);
    const given = url.searchParams.get("token");
    if (given !== null) {
      url.searchParams.delete("token");
      window.history.replaceState(null, "", url.pathname + url.search + url.hash);
      window.sessionStorage.setItem(TOKEN_KEY, given);
    }
    token = window.sessionStorage.getItem(TOKEN_KEY);
  } catch (err) {
    // sessionStorage can be unavailable (opaque origins): the token then lives in memory.
  }
  return token;
}

const TOKEN = takeToken();

function headers() {
  const h = { Accept: "application/json" };
  if (TOKEN) h.Authorization = `Bearer ${TOKEN}`;
  return h;
}

// ---- small DOM helpers ------------------------------------------------------------------
function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function field(root, name) {
  return root.querySelector(`[data-field="${name}"]`);
}

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

function setAttr(node, name, value) {
  if (node.getAttribute(name) !== value) node.setAttribute(name, value);
}

// CSS.escape: VIP names and addresses contain ":", "[" and "/".
function byKey(root, attr, key) {
  return root.querySelector(`[${attr}="${CSS.escape(key)}"]`);
}

// Put `nodes` in this order under `parent` and remove the other keyed children, moving a
// node only when it is out of place (moving restarts its CSS transitions).
function reconcile(parent, nodes) {
  const keep = new Set(nodes);
  for (const child of [...parent.children]) if (!keep.has(child)) child.remove();
  nodes.forEach((node, i) => {
    if (parent.children[i] !== node) parent.insertBefore(node, parent.children[i] || null);
  });
}

// ---- formatting -------------------------------------------------------------------------
function si(value, unit) {
  const steps = [[1e9, "G"], [1e6, "M"], [1e3, "k"]];
  for (const [size, prefix] of steps) {
    if (Math.abs(value) >= size) return `${(value / size).toFixed(1)} ${prefix}${unit}`;
  }
  return `${value < 10 ? value.toFixed(1) : value.toFixed(0)} ${unit}`;
}

function duration(seconds) {
  const s = Math.floor(seconds);
  const d = Math.floor(s / 86400);
  const h = Math.floor((s % 86400) / 3600);
  const m = Math.floor((s % 3600) / 60);
  if (d > 0) return `${d}d ${h}h ${m}m`;
  if (h > 0) return `${h}h ${m}m`;
  if (m > 0) return `${m}m ${s % 60}s`;
  return `${s}s`;
}

function percent(fraction) {
  return `${(fraction * 100).toFixed(1)} %`;
}

function count(n) {
  return n === null || n === undefined ? "–" : n.toLocaleString("en-US");
}

// ---- the daemon's history of rates ------------------------------------------------------
// The intervals the page has seen, oldest first, as long as the daemon keeps (length):
// times[i] ends interval i; every series has one value (or null) per interval.
const SERIES = ["packets", "bytes", "new_flows"];
const history = { length: 60, interval: 1, times: [], vips: new Map(), backends: new Map() };

function mergeHistory(h) {
  history.length = h.length;
  history.interval = h.interval;
  const n = h.times.length;
  if (n === 0) return;
  const before = history.times.length;
  history.times.push(...h.times);
  for (const kind of ["vips", "backends"]) {
    const store = history[kind];
    for (const [key, s] of Object.entries(h[kind])) {
      if (!store.has(key)) {
        store.set(key, Object.fromEntries(SERIES.map((f) => [f, new Array(before).fill(null)])));
      }
      const mine = store.get(key);
      for (const f of SERIES) mine[f].push(...s[f]);
    }
    for (const [key, mine] of store) {
      if (!(key in h[kind])) for (const f of SERIES) mine[f].push(...new Array(n).fill(null));
    }
  }
  const drop = history.times.length - history.length;
  if (drop <= 0) return;
  history.times.splice(0, drop);
  for (const kind of ["vips", "backends"]) {
    for (const [key, mine] of history[kind]) {
      for (const f of SERIES) mine[f].splice(0, drop);
      if (mine.packets.every((v) => v === null)) history[kind].delete(key);
    }
  }
}

function lastRate(values) {
  for (let i = values.length - 1; i >= 0; i -= 1) if (values[i] !== null) return values[i];
  return null;
}

const SVG_NS = "http://www.w3.org/2000/svg";
const SPARK_W = 120;
const SPARK_H = 22;

function newSpark(name) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("data-field", name);
  svg.setAttribute("width", String(SPARK_W));
  svg.setAttribute("height", String(SPARK_H));
  svg.setAttribute("viewBox", `0 0 ${SPARK_W} ${SPARK_H}`);
  const base = document.createElementNS(SVG_NS, "line");
  base.setAttribute("class", "base");
  for (const [k, v] of [["x1", 0], ["x2", SPARK_W], ["y1", SPARK_H - 1], ["y2", SPARK_H - 1]]) {
    base.setAttribute(k, String(v));
  }
  for (const [tag, cls] of [["path", "area"], ["path", "line"], ["circle", "last"]]) {
    const node = document.createElementNS(SVG_NS, tag);
    node.setAttribute("class", cls);
    svg.append(node);
  }
  // After the drawing: drawSpark takes the first three children in this order.
  svg.append(document.createElementNS(SVG_NS, "title"), base);
  return svg;
}

// Inline SVG: newest interval at the right edge, one slot per interval the daemon keeps,
// the scale from 0 to the largest value; a gap where an interval has no rate.
function drawSpark(svg, values, what) {
  const slots = Math.max(history.length - 1, 1);
  const offset = history.length - values.length;
  const max = Math.max(0, ...values.filter((v) => v !== null));
  const x = (i) => (((i + offset) / slots) * (SPARK_W - 3)).toFixed(1);
  const y = (v) => (SPARK_H - 2 - (max > 0 ? (v / max) * (SPARK_H - 4) : 0)).toFixed(1);
  let line = "";
  let area = "";
  let run = [];
  let points = 0;
  const flush = () => {
    if (run.length > 0) {
      line += run.map(([i, v], k) => `${k === 0 ? "M" : "L"}${x(i)} ${y(v)}`).join(" ") + " ";
      const first = run[0][0];
      const last = run[run.length - 1][0];
      area += `M${x(first)} ${SPARK_H - 1} ${run.map(([i, v]) => `L${x(i)} ${y(v)}`).join(" ")} `;
      area += `L${x(last)} ${SPARK_H - 1} Z `;
    }
    run = [];
  };
  values.forEach((v, i) => {
    if (v === null) flush();
    else {
      run.push([i, v]);
      points += 1;
    }
  });
  flush();
  const [areaPath, linePath, dot, title] = svg.children;
  setAttr(linePath, "d", line.trim());
  setAttr(areaPath, "d", area.trim());
  const lastIndex = values.length - 1;
  const last = lastIndex >= 0 ? values[lastIndex] : null;
  dot.style.display = last === null ? "none" : "";
  if (last !== null) {
    setAttr(dot, "cx", x(lastIndex));
    setAttr(dot, "cy", y(last));
    setAttr(dot, "r", "1.8");
  }
  setAttr(svg, "data-points", String(points));
  setAttr(svg, "data-max", String(max));
  const span = duration(history.length * history.interval);
  setText(title, `${what}: packets/s over the last ${span}, peak ${si(max, "pkt/s")}`);
}

// ---- VIP cards --------------------------------------------------------------------------
// Per VIP: the counters of the previous poll (for rates) and a colour per backend that
// stays with the backend while others come and go.
const vipState = new Map();

function vipMemo(name) {
  let memo = vipState.get(name);
  if (!memo) {
    memo = { prev: null, colours: new Map() };
    vipState.set(name, memo);
  }
  return memo;
}

function colourOf(memo, address) {
  if (!memo.colours.has(address)) {
    const used = new Set(memo.colours.values());
    let i = 0;
    while (used.has(i % PALETTE.length) && i < PALETTE.length) i += 1;
    memo.colours.set(address, i % PALETTE.length);
  }
  return PALETTE[memo.colours.get(address)];
}

function newCard(name) {
  const rate = (f, unit) =>
    el("span", { class: "rate" }, [
      el("b", { "data-field": f, "data-value": "", text: "–" }),
      el("small", { text: unit }),
    ]);
  const headRow = el("tr", {}, [
    el("th", { text: "backend" }),
    el("th", { text: "health" }),
    el("th", { text: "admin" }),
    el("th", { class: "num", text: "weight" }),
    el("th", { class: "num", text: "effective" }),
    el("th", { class: "num", text: "established" }),
    el("th", { class: "num", text: "share" }),
    el("th", { class: "traffic", text: "pkt/s, last minute" }),
    el("th", {}),
  ]);
  return el("article", { class: "vip", "data-vip": name }, [
    el("div", { class: "vip-head" }, [
      el("h2", { "data-field": "name", text: name }),
      el("span", { class: "tag", "data-field": "table" }),
      el("span", { class: "tag", "data-field": "encap" }),
      el("span", { class: "tag", "data-field": "hash" }),
      el("div", { class: "rates" }, [
        newSpark("vip_spark"),
        rate("rate_packets", "pkt/s"),
        rate("rate_bits", "bit/s"),
        rate("rate_new_flows", "new conn/s"),
      ]),
    ]),
    el("div", { class: "banner", "data-field": "all_down", hidden: "" }, [
      "Every backend is down: the VIP keeps its last table rather than dropping traffic.",
    ]),
    el("div", { class: "share" }, [
      el("div", { class: "sharebar", "data-field": "share_bar" }),
      el("ul", { class: "legend", "data-field": "legend" }),
    ]),
    el("table", { class: "backends" }, [el("thead", {}, [headRow]), el("tbody")]),
  ]);
}

function newRow(vip, address) {
  const button = el("button", { type: "button", "data-action": "drain", text: "drain" });
  button.addEventListener("click", () => act(vip, address, button));
  return el("tr", { "data-backend": address }, [
    el("td", {}, [el("span", { class: "swatch" }), el("span", { "data-field": "address" })]),
    el("td", {}, [
      el("span", { class: "pill", "data-field": "health" }),
      el("span", { class: "since", "data-field": "health_for", "data-value": "" }),
    ]),
    el("td", {}, [el("span", { class: "pill", "data-field": "admin" })]),
    el("td", { class: "num", "data-field": "weight" }),
    el("td", { class: "num", "data-field": "effective_weight" }),
    el("td", { class: "num", "data-field": "established" }),
    el("td", { class: "num", "data-field": "share" }),
    el("td", { class: "traffic" }, [
      newSpark("spark"),
      el("span", { class: "pps", "data-field": "pps", "data-value": "" }),
    ]),
    el("td", { class: "action" }, [button]),
  ]);
}

function setAdmin(row, admin) {
  const cell = field(row, "admin");
  setText(cell, admin);
  setAttr(cell, "class", `pill admin-${admin}`);
  setAttr(row, "class", `row-health-${row.dataset.health || "up"} row-admin-${admin}`);
  const button = row.querySelector("button[data-action]");
  const action = admin === "enabled" ? "drain" : "enable";
  setAttr(button, "data-action", action);
  setText(button, action);
}

function renderRates(card, vip, uptime) {
  const memo = vipMemo(vip.name);
  const now = { packets: vip.packets, bytes: vip.bytes, new_flows: vip.new_flows, t: uptime };
  const prev = memo.prev;
  memo.prev = now;
  const show = (f, value, unit) => {
    const node = field(card, f);
    setAttr(node, "data-value", value === null ? "" : String(value));
    const text = value === null ? `– ${unit}` : si(value, unit);
    const cut = text.indexOf(" ");
    setText(node, text.slice(0, cut));
    setText(node.nextElementSibling, text.slice(cut + 1));
  };
  const dt = prev ? now.t - prev.t : 0;
  // A restarted daemon (uptime went back) or reset counters: wait for the next poll.
  const ok =
    prev && dt > 0 && ["packets", "bytes", "new_flows"].every((k) => now[k] >= prev[k]);
  show("rate_packets", ok ? (now.packets - prev.packets) / dt : null, "pkt/s");
  show("rate_bits", ok ? ((now.bytes - prev.bytes) * 8) / dt : null, "bit/s");
  show("rate_new_flows", ok ? (now.new_flows - prev.new_flows) / dt : null, "new conn/s");
}

function renderShare(card, vip) {
  const memo = vipMemo(vip.name);
  const bar = field(card, "share_bar");
  const legend = field(card, "legend");
  const segments = [];
  const items = [];
  for (const b of vip.backends) {
    const colour = colourOf(memo, b.address);
    let seg = byKey(bar, "data-segment", b.address);
    if (!seg) seg = el("div", { class: "segment", "data-segment": b.address });
    seg.style.width = `${b.table_share * 100}%`;
    seg.style.background = colour;
    setAttr(seg, "data-value", String(b.table_share));
    setAttr(seg, "title", `${b.address}: ${percent(b.table_share)} of the table`);
    segments.push(seg);

    let item = byKey(legend, "data-legend", b.address);
    if (!item) {
      item = el("li", { "data-legend": b.address }, [
        el("span", { class: "swatch" }),
        el("span", { class: "addr" }),
        el("span", { class: "pct" }),
      ]);
    }
    item.querySelector(".swatch").style.background = colour;
    setText(item.querySelector(".addr"), b.address);
    setText(item.querySelector(".pct"), percent(b.table_share));
    items.push(item);
  }
  reconcile(bar, segments);
  reconcile(legend, items);
  bar.classList.toggle("empty", vip.backends.every((b) => b.table_share === 0));
}

function renderBackends(card, vip) {
  const memo = vipMemo(vip.name);
  const tbody = card.querySelector("tbody");
  const rows = [];
  for (const b of vip.backends) {
    let row = byKey(tbody, "data-backend", b.address);
    if (!row) row = newRow(vip, b.address);
    row.querySelector(".swatch").style.background = colourOf(memo, b.address);
    setText(field(row, "address"), b.address);

    row.dataset.health = b.health;
    const health = field(row, "health");
    setText(health, b.health);
    setAttr(health, "class", `pill health-${b.health}`);
    const since =
      b.health_changed_ago === null ? "" : ` (for ${duration(b.health_changed_ago)})`;
    setAttr(health, "title", `${b.health_detail || "no check configured"}${since}`);
    const lasted = field(row, "health_for");
    const ago = b.health_changed_ago;
    setText(lasted, ago === null ? "" : `for ${duration(ago)}`);
    setAttr(lasted, "data-value", ago === null ? "" : String(ago));

    setAdmin(row, b.admin);
    setText(field(row, "weight"), String(b.weight));
    const eff = field(row, "effective_weight");
    setText(eff, String(b.effective_weight));
    eff.classList.toggle("differs", b.effective_weight !== b.weight);
    setText(field(row, "established"), count(b.established));
    const share = field(row, "share");
    setText(share, percent(b.table_share));
    setAttr(share, "data-value", String(b.table_share));
    const series = history.backends.get(b.address);
    const values = series ? series.packets : [];
    drawSpark(field(row, "spark"), values, b.address);
    const pps = lastRate(values);
    const ppsNode = field(row, "pps");
    setText(ppsNode, pps === null ? "–" : si(pps, ""));
    setAttr(ppsNode, "data-value", pps === null ? "" : String(pps));
    rows.push(row);
  }
  reconcile(tbody, rows);
}

function renderVip(vip, uptime) {
  const main = field(document, "vips");
  let card = byKey(main, "data-vip", vip.name);
  if (!card) card = newCard(vip.name);
  setText(field(card, "table"), `${vip.table} · ${vip.table_size.toLocaleString("en-US")}`);
  setText(field(card, "encap"), vip.encap);
  setText(field(card, "hash"), `hash ${vip.hash}`);
  field(card, "all_down").hidden = !vip.all_down;
  card.classList.toggle("all-down", vip.all_down);
  renderRates(card, vip, uptime);
  const series = history.vips.get(vip.name);
  drawSpark(field(card, "vip_spark"), series ? series.packets : [], vip.name);
  renderShare(card, vip);
  renderBackends(card, vip);
  return card;
}

// ---- the rest of the page ---------------------------------------------------------------
function renderCounters(name, attr, counters) {
  const list = field(document, name);
  const items = Object.entries(counters)
    .filter(([, n]) => n > 0)
    .sort(([a], [b]) => a.localeCompare(b))
    .map(([key, n]) => {
      const item = byKey(list, attr, key) || el("li", { [attr]: key }, [
        el("span", { class: "key", text: key }),
        el("span", { class: "num" }),
      ]);
      setAttr(item, "data-value", String(n));
      setText(item.querySelector(".num"), count(n));
      return item;
    });
  if (items.length === 0) {
    const none = list.querySelector("li.none") || el("li", { class: "none muted", text: "none" });
    items.push(none);
  }
  reconcile(list, items);
}

function renderAcl(hits) {
  const body = field(document, "acl");
  const rows = hits.map((h) => {
    const row =
      byKey(body, "data-acl", h.scope) ||
      el("tr", { "data-acl": h.scope }, [
        el("td", { class: "key", text: h.scope }),
        ...["allow", "deny", "default"].map((f) => el("td", { class: "num", "data-field": f })),
      ]);
    for (const f of ["allow", "deny", "default"]) {
      const cell = field(row, f);
      setText(cell, count(h[f]));
      setAttr(cell, "data-value", String(h[f]));
      cell.classList.toggle("hit", f !== "allow" && h[f] > 0);
    }
    return row;
  });
  reconcile(body, rows);
}

function render(status) {
  setText(field(document, "instance"), status.instance);
  document.title = `xdplb ${status.instance}`;
  setText(field(document, "attached"), status.attached.join(", ") || "none");
  setText(field(document, "uptime"), duration(status.uptime));
  const ct = status.conn_table;
  // used is null where the table's layout is not one this xdplb reads (a test build's).
  const fill = ct.capacity > 0 && ct.used !== null ? ct.used / ct.capacity : 0;
  const used = ct.used === null ? "?" : count(ct.used);
  setText(field(document, "conn_table"), `${used} / ${count(ct.capacity)} (${ct.used === null ? "?" : percent(fill)})`);
  field(document, "conn_table_meter").style.width = `${Math.min(fill, 1) * 100}%`;
  const last = status.last_rebuild_ms === null ? "" : ` (last ${status.last_rebuild_ms.toFixed(1)} ms)`;
  setText(field(document, "rebuilds"), `${count(status.rebuilds)}${last}`);
  setText(field(document, "health_checks"), count(status.health_checks));
  field(document, "runtime_changes").hidden = !status.runtime_changes;
  const refused = status.last_reload_error;
  field(document, "reload_error").hidden = !refused;
  setText(field(document, "reload_error_text"), refused || "");

  const seen = new Set(status.vips.map((v) => v.name));
  for (const name of [...vipState.keys()]) if (!seen.has(name)) vipState.delete(name);
  reconcile(field(document, "vips"), status.vips.map((v) => renderVip(v, status.uptime)));
  renderCounters("drops", "data-drop", status.drops);
  renderCounters("events", "data-event", status.events);
  renderAcl(status.acl || []);
}

// ---- polling and actions ----------------------------------------------------------------
let polls = 0;
let timer = null;
let inFlight = false;
let again = false;
let errorTimer = null;
let errorFromPoll = false;

// A failed action's message stays 8 s; a failed poll's until the next poll succeeds.
function showError(message, fromPoll = false) {
  const node = field(document, "error");
  setText(node, message);
  node.hidden = false;
  errorFromPoll = fromPoll;
  clearTimeout(errorTimer);
  if (!fromPoll) errorTimer = setTimeout(() => (node.hidden = true), 8000);
}

function clearPollError() {
  if (errorFromPoll) field(document, "error").hidden = true;
  errorFromPoll = false;
}

function setConnection(state) {
  document.body.dataset.connection = state;
  setText(field(document, "connection"), state);
}

async function fetchJson(url, init = {}) {
  const ctrl = new AbortController();
  const abort = setTimeout(() => ctrl.abort(), POLL_TIMEOUT_MS);
  try {
    const resp = await fetch(url, {
      cache: "no-store",
      ...init,
      headers: headers(),
      signal: ctrl.signal,
    });
    if (!resp.ok) {
      let detail = "";
      try {
        const body = await resp.json();
        detail = typeof body.detail === "string" ? `: ${body.detail}` : "";
      } catch (err) {
        // Not JSON: the status code says enough.
      }
      const hint = resp.status === 401 || resp.status === 403 ? " (open the page with ?token=...)" : "";
      throw new Error(`HTTP ${resp.status}${detail}${hint}`);
    }
    return await resp.json();
  } catch (err) {
    if (err.name === "AbortError") throw new Error(`no answer within ${POLL_TIMEOUT_MS} ms`);
    throw err;
  } finally {
    clearTimeout(abort);
  }
}

async function poll() {
  clearTimeout(timer);
  if (inFlight) {
    again = true;
    return;
  }
  inFlight = true;
  const started = performance.now();
  try {
    const last = history.times[history.times.length - 1];
    const since = last === undefined ? "" : `?since=${encodeURIComponent(last)}`;
    const [status, rates] = await Promise.all([
      fetchJson(`${API}/status`),
      fetchJson(`${API}/history${since}`),
    ]);
    mergeHistory(rates);
    render(status);
    polls += 1;
    document.body.dataset.updated = String(polls);
    setConnection("live");
    clearPollError();
    setText(field(document, "last_update"), `· updated ${new Date().toLocaleTimeString()}`);
  } catch (err) {
    setConnection("disconnected");
    showError(`status: ${err.message}`, true);
  } finally {
    inFlight = false;
    if (again) {
      again = false;
      timer = setTimeout(poll, 0);
    } else {
      timer = setTimeout(poll, Math.max(0, POLL_MS - (performance.now() - started)));
    }
  }
}

async function act(vip, address, button) {
  const action = button.dataset.action;
  const path = [
    "vips",
    encodeURIComponent(vip.address),
    String(vip.port),
    encodeURIComponent(vip.protocol),
    "backends",
    encodeURIComponent(address),
    action,
  ].join("/");
  button.disabled = true;
  try {
    const result = await fetchJson(`${API}/${path}`, { method: "POST" });
    const row = button.closest("tr");
    if (row && result && typeof result.admin === "string") setAdmin(row, result.admin);
  } catch (err) {
    showError(`${action} ${address} on ${vip.name}: ${err.message}`);
  } finally {
    button.disabled = false;
    poll();
  }
}

poll();
