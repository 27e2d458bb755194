// Pagoda dashboard: polls /dashboard/api/state once a second and redraws. Plain DOM, no libraries; every value
// from the server goes in as text (textContent), never as markup.
"use strict";

const POLL_MS = 1000;
// The charts always span the router's 10-minute timeline, so a young router's few windows sit at the right.
const TIMELINE_S = 600;
const SVG = "http://www.w3.org/2000/svg";
const CODEC_COLOURS = ["#3b5bdb", "#0ca678", "#f08c00", "#ae3ec9", "#1098ad", "#e8590c", "#74b816", "#868e96"];
// Literal colours: SVG presentation attributes do not take CSS variables everywhere.
const PERCENTILES = [["p50_s", "#3b5bdb"], ["p90_s", "#f08c00"], ["p99_s", "#d92d20"]];

let polls = 0;
let lastOk = 0;

function $(id) { return document.getElementById(id); }

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function svgEl(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

function fmtInt(n) { return Number(n || 0).toLocaleString("en-US"); }

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n || 0), i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms";
  return s.toFixed(2) + " s";
}

function fmtDuration(secs) {
  const h = Math.floor(secs / 3600), m = Math.floor((secs % 3600) / 60), s = secs % 60;
  return h > 0 ? `${h}h ${m}m` : m > 0 ? (s > 0 ? `${m}m ${s}s` : `${m} min`) : `${s}s`;
}

function replaceChildren(node, children) {
  node.replaceChildren(...children);
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) tr.appendChild(c instanceof Node ? c : el("td", c));
  return tr;
}

function numCell(v) { return el("td", v, "num"); }

function barRow(label, segments, total, figure) {
  const r = el("div", null, "row");
  r.appendChild(el("div", label, "mono"));
  const track = el("div", null, "track");
  for (const s of segments) {
    const seg = el("div", null, "seg");
    seg.style.width = (total > 0 ? Math.min(100, (100 * s.value) / total) : 0) + "%";
    seg.style.background = s.colour;
    seg.title = `${s.name}: ${s.text}`;
    track.appendChild(seg);
  }
  r.appendChild(track);
  r.appendChild(el("div", figure, "fig"));
  return r;
}

function renderCards(st) {
  const t = st.timeline;
  $("requests-total").textContent = fmtInt(t.requests_total);
  $("request-rate").textContent = t.request_rate_1m.toFixed(2);
  const ready = st.workers.filter((w) => w.ready).length;
  $("workers-ready").textContent = `${ready} / ${st.workers.length}`;
  let held = 0, used = 0, total = 0;
  for (const w of st.workers) {
    if (!w.stats) continue;
    held += w.stats.blocks_used + w.stats.blocks_cached;
    used += w.stats.blocks_used;
    total += w.stats.blocks_total;
  }
  $("kv-blocks-held").textContent = fmtInt(held);
  $("kv-blocks-detail").textContent = `${fmtInt(used)} in use · ${fmtInt(total)} in the pools`;
  $("placements-total").textContent = fmtInt(st.router.placements_total);
  const latest = [...t.windows].reverse().find((w) => w.ttft);
  $("ttft-p50").textContent = latest ? fmtSeconds(latest.ttft.p50_s) : "–";
  $("strategy").textContent = st.router.strategy;
  $("uptime").textContent = fmtDuration(st.router.uptime_s);
}

// Each worker's steps and step sequences at the previous update, by address, for the batch since then.
const lastSteps = new Map();

// Sequences a forward step computed on average: since the previous update (when the worker stepped) and overall.
function meanBatch(w) {
  const s = w.stats;
  if (!s || !s.steps_total) return "–";
  const before = lastSteps.get(w.address);
  lastSteps.set(w.address, [s.steps_total, s.step_sequences_total]);
  const overall = `${(s.step_sequences_total / s.steps_total).toFixed(1)} overall`;
  if (!before || s.steps_total <= before[0]) return overall;
  return `${((s.step_sequences_total - before[1]) / (s.steps_total - before[0])).toFixed(1)} now · ${overall}`;
}

function renderWorkers(st) {
  const rows = st.workers.map((w) => {
    const health = el("td");
    health.appendChild(el("span", null, w.ready ? "dot ok" : "dot"));
    health.appendChild(el("span", w.ready ? "ready" : "not ready"));
    if (w.error) health.appendChild(el("div", w.error, "err-text"));
    const s = w.stats;
    const model = el("td", w.model || "–");
    if (w.lora_adapters && w.lora_adapters.length) model.appendChild(el("div", `LoRA: ${w.lora_adapters.join(", ")}`, "sub-text"));
    return row([
      el("td", w.address, "mono"),
      health,
      el("td", w.role || "both"),
      el("td", w.scheduling || "–"),
      model,
      numCell(s ? `${s.running} / ${s.waiting}` : "–"),
      numCell(`${fmtInt(w.queued_tokens)} tok · ${w.decoding} decoding`),
      numCell(s ? `${fmtInt(s.blocks_used)} / ${fmtInt(s.blocks_cached)} / ${fmtInt(s.blocks_total)}` : "no stats"),
      numCell(meanBatch(w)),
      numCell(s ? fmtInt(s.preemptions_total) : "–"),
      numCell(s ? fmtInt(s.offloaded_groups_total) : "–"),
      numCell(s ? fmtInt(s.disk_corrupted_total) : "–"),
    ]);
  });
  // Forget workers that left (a restarted pod comes back under a new address), so the map stays the fleet's size.
  const listed = new Set(st.workers.map((w) => w.address));
  for (const addr of lastSteps.keys()) if (!listed.has(addr)) lastSteps.delete(addr);
  replaceChildren($("workers").tBodies[0], rows);
}

function renderTiers(st) {
  const codecs = [...new Set(st.tiers.flatMap((t) => Object.keys(t.by_codec)))].sort();
  const colour = (c) => CODEC_COLOURS[codecs.indexOf(c) % CODEC_COLOURS.length];
  const rows = st.tiers.map((t) => {
    const segs = Object.entries(t.by_codec).map(([c, b]) => ({ name: c, value: b, colour: colour(c), text: fmtBytes(b) }));
    const pct = t.capacity_bytes > 0 ? ((100 * t.used_bytes) / t.capacity_bytes).toFixed(1) : "0.0";
    return barRow(t.tier, segs, t.capacity_bytes, `${fmtBytes(t.used_bytes)} / ${fmtBytes(t.capacity_bytes)} (${pct}%)`);
  });
  if (rows.length === 0) rows.push(el("p", "No worker has reported its tiers yet.", "note"));
  const legend = el("div", null, "legend");
  for (const c of codecs) {
    const item = el("span");
    const sw = el("span", null, "swatch");
    sw.style.background = colour(c);
    item.appendChild(sw);
    item.appendChild(document.createTextNode(c));
    legend.appendChild(item);
  }
  rows.push(legend);
  replaceChildren($("tiers"), rows);
}

function renderPrefixHits(st) {
  const prompt = st.router.prompt_tokens_total;
  const rows = st.prefix_hits.map((h) => {
    const share = prompt > 0 ? ((100 * h.tokens) / prompt).toFixed(1) : "0.0";
    const seg = { name: h.tier, value: h.tokens, colour: "var(--accent)", text: fmtInt(h.tokens) };
    return barRow(h.tier, [seg], prompt, `${fmtInt(h.tokens)} tok (${share}%)`);
  });
  if (rows.length === 0) rows.push(el("p", "No prefix hits reported yet.", "note"));
  replaceChildren($("prefix-hits"), rows);
}

function renderEvictions(st) {
  const most = Math.max(1, ...st.evictions.map((e) => e.evicted_slots));
  const rows = st.evictions.map((e) => {
    const seg = { name: e.policy, value: e.evicted_slots, colour: "var(--p90)", text: fmtInt(e.evicted_slots) };
    return barRow(e.policy, [seg], most, `${fmtInt(e.evicted_slots)} slots · ${fmtInt(e.freed_blocks)} blocks`);
  });
  if (rows.length === 0) rows.push(el("p", "No evictions yet (full-cache requests evict nothing).", "note"));
  replaceChildren($("evictions"), rows);
}

// The previous update's tenant totals and time, for the rates.
let lastTenants = null;

function renderTenants(st) {
  const before = lastTenants;
  const seconds = before ? (st.generated_unix_ms - before.at) / 1000 : 0;
  const rows = st.tenants.map((t) => {
    const total = t.prompt_tokens + t.completion_tokens;
    const prev = before && before.totals.get(t.tenant);
    const rate = prev !== undefined && seconds > 0 ? ((total - prev) / seconds).toFixed(1) : "–";
    return row([el("td", t.tenant, "mono"), numCell(fmtInt(t.prompt_tokens)), numCell(fmtInt(t.completion_tokens)),
      numCell(rate)]);
  });
  if (rows.length === 0) {
    const empty = el("td", "No request yet.", "note");
    empty.colSpan = 4;
    rows.push(row([empty]));
  }
  replaceChildren($("tenants").tBodies[0], rows);
  lastTenants = {
    at: st.generated_unix_ms,
    totals: new Map(st.tenants.map((t) => [t.tenant, t.prompt_tokens + t.completion_tokens])),
  };
}

function renderEvicPress(st) {
  const rows = [];
  for (const w of st.workers) {
    const e = w.stats && w.stats.evicpress;
    if (!e) continue;
    const placed = e.placed.map(([tier, n]) => `${tier} ${fmtInt(n)}`).join(" · ");
    rows.push(el("div", `${w.address}: ${fmtInt(e.contexts)} contexts (${placed})`, "mono"));
    rows.push(el("div", `${fmtInt(e.profiles_total)} profiles (${fmtInt(e.reprofiles_total)} re-profiles, ` +
      `${e.profile_questions} extra questions, ${fmtInt(e.profiles_on_own_queries_total)} on the contexts' own queries)` +
      ` · ${fmtInt(e.compressed_total)} compressed · ` +
      `${fmtInt(e.moved_down_total)} moved down · ${fmtInt(e.dropped_total)} dropped`, "note"));
    for (const [variant, q, similarity] of e.variants) {
      const seg = { name: variant, value: q, colour: "var(--accent)", text: q.toFixed(3) };
      const soft = similarity == null ? "" : ` · embedding similarity ${similarity.toFixed(3)}`;
      rows.push(barRow(variant, [seg], 1, `quality ${q.toFixed(3)}${soft}`));
    }
  }
  if (rows.length === 0) rows.push(el("p", "No worker places its tiers by EvicPress (--tier-placement evicpress).", "note"));
  replaceChildren($("evicpress"), rows);
}

function renderKvstore(st) {
  const box = $("kvstore");
  const kv = st.kvstore;
  if (!kv) {
    replaceChildren(box, [el("p", "Waiting for the first status…", "note")]);
    return;
  }
  if (!kv.configured) {
    replaceChildren(box, [el("p", "not configured (start the router with --kvstore ADDR)", "note")]);
    return;
  }
  const summary = el("p");
  summary.textContent = kv.leader_id
    ? `leader node ${kv.leader_id} (${kv.leader_address}) · term ${kv.term} · max apply lag ${kv.max_apply_lag}`
    : `no leader known · term ${kv.term}`;
  const table = el("table");
  const head = row(["Node", "Address", "Role", "Term", "Commit", "Applied", "Behind leader", "Blocks"]
    .map((h) => el("th", h)));
  table.appendChild(el("thead")).appendChild(head);
  const body = table.appendChild(el("tbody"));
  for (const n of kv.nodes) {
    if (!n.reachable) {
      const err = el("td", n.error || "unreachable", "err-text");
      err.colSpan = 6;
      body.appendChild(row([el("td", "–"), el("td", n.address, "mono"), err]));
      continue;
    }
    body.appendChild(row([
      numCell(n.node_id), el("td", n.address, "mono"), el("td", n.role), numCell(n.term), numCell(fmtInt(n.commit_index)),
      numCell(fmtInt(n.applied_index)), numCell(n.behind_leader === null ? "–" : fmtInt(n.behind_leader)),
      numCell(fmtInt(n.blocks)),
    ]));
  }
  replaceChildren(box, [summary, table]);
}

// A chart over the timeline's windows: bars (one series) or lines (several, with gaps where a value is null).
function chart(svg, recorded, series, opts) {
  const W = 600, H = 170, left = 62, right = 8, top = 8, bottom = 22;
  const slots = Math.max(Math.round(TIMELINE_S / opts.windowS), recorded.length, 1);
  const windows = Array(slots - recorded.length).fill({}).concat(recorded);
  const n = windows.length;
  const x = (i) => left + ((W - left - right) * (i + 0.5)) / n;
  let max = 0;
  for (const s of series) for (const w of windows) max = Math.max(max, s.value(w) || 0);
  max = max > 0 ? max * 1.1 : 1;
  const y = (v) => top + (H - top - bottom) * (1 - v / max);
  const parts = [];
  parts.push(svgEl("line", { x1: left, y1: y(0), x2: W - right, y2: y(0), class: "axis" }));
  parts.push(svgEl("line", { x1: left, y1: top, x2: left, y2: y(0), class: "axis" }));
  for (const v of [max / 1.1, max / 2.2]) {
    const t = svgEl("text", { x: left - 4, y: y(v) + 4, "text-anchor": "end" });
    t.textContent = opts.format(v);
    parts.push(t);
  }
  const label = svgEl("text", { x: left, y: H - 6 });
  label.textContent = `${fmtDuration(n * opts.windowS)} ago`;
  parts.push(label);
  const now = svgEl("text", { x: W - right, y: H - 6, "text-anchor": "end" });
  now.textContent = "now";
  parts.push(now);
  if (opts.bars) {
    const bw = Math.max(1, (W - left - right) / n - 1);
    windows.forEach((w, i) => {
      const v = series[0].value(w) || 0;
      if (v <= 0) return;
      parts.push(svgEl("rect", { x: x(i) - bw / 2, y: y(v), width: bw, height: y(0) - y(v), fill: series[0].colour }));
    });
  } else {
    for (const s of series) {
      let d = "";
      let pen = false;
      windows.forEach((w, i) => {
        const v = s.value(w);
        if (v === null || v === undefined) { pen = false; return; }
        d += `${pen ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`;
        pen = true;
        parts.push(svgEl("circle", { cx: x(i).toFixed(1), cy: y(v).toFixed(1), r: 1.8, fill: s.colour }));
      });
      if (d) parts.push(svgEl("path", { d, fill: "none", stroke: s.colour, "stroke-width": 1.5 }));
    }
  }
  svg.replaceChildren(...parts);
}

function renderCharts(st) {
  const t = st.timeline;
  chart($("chart-requests"), t.windows, [{ colour: "#3b5bdb", value: (w) => w.requests }],
    { bars: true, windowS: t.window_s, format: (v) => v.toFixed(v < 10 ? 1 : 0) });
  const pct = (key) => PERCENTILES.map(([p, colour]) => ({ colour, value: (w) => (w[key] ? w[key][p] : null) }));
  chart($("chart-ttft"), t.windows, pct("ttft"), { windowS: t.window_s, format: fmtSeconds });
  chart($("chart-itl"), t.windows, pct("inter_token"), { windowS: t.window_s, format: fmtSeconds });
}

function renderPlacements(st) {
  const rows = st.placements.map((d) => {
    const cands = el("td", null, "candidates");
    for (const c of d.candidates) {
      const line = el("div", null, c.worker === d.chosen ? "chosen" : "");
      line.textContent = `${c.worker}: ${c.hits_device}/${c.hits_host}/${c.hits_disk}/${c.hits_peer} · `
        + `${fmtSeconds(c.prefill_s)} + ${fmtSeconds(c.load_s)} + ${fmtSeconds(c.queue_s)} = ${fmtSeconds(c.total_s)}`
        + (c.feasible ? "" : " (no room)");
      cands.appendChild(line);
    }
    return row([
      el("td", d.request_id, "mono"), el("td", d.strategy), el("td", d.chosen, "mono"), el("td", d.reason),
      numCell(`${fmtInt(d.prompt_tokens)} / ${fmtInt(d.prompt_blocks)}`), numCell(`${d.decision_us.toFixed(0)} µs`), cands,
    ]);
  });
  if (rows.length === 0) {
    const empty = el("td", "No request placed yet.", "note");
    empty.colSpan = 7;
    rows.push(row([empty]));
  }
  replaceChildren($("placements").tBodies[0], rows);
}

function render(st) {
  renderCards(st);
  renderWorkers(st);
  renderTiers(st);
  renderPrefixHits(st);
  renderEvictions(st);
  renderTenants(st);
  renderEvicPress(st);
  renderKvstore(st);
  renderCharts(st);
  renderPlacements(st);
}

function showError(text) {
  const box = $("error");
  box.textContent = text || "";
  box.classList.toggle("hidden", !text);
}

function updateLive() {
  const live = $("live");
  const age = (Date.now() - lastOk) / 1000;
  const stale = !lastOk || age > 5;
  live.classList.toggle("stale", stale);
  live.textContent = !lastOk ? "connecting…" : stale ? `stale: last update ${age.toFixed(0)} s ago` : "live";
}

async function poll() {
  try {
    const resp = await fetch("/dashboard/api/state", { credentials: "same-origin", cache: "no-store" });
    if (resp.status === 401 || resp.status === 403) {
      // The session ended (expired, logged out, or the admin key changed): show the login page.
      window.location.reload();
      return;
    }
    if (!resp.ok) throw new Error(`the router answered ${resp.status}`);
    const st = await resp.json();
    render(st);
    lastOk = Date.now();
    polls += 1;
    document.body.dataset.polls = String(polls);
    showError("");
  } catch (e) {
    showError(`Cannot update: ${e.message}`);
  }
  updateLive();
  setTimeout(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", poll);
