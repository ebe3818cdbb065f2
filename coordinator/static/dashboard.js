// The run dashboard: polls the coordinator's read-only JSON API (coordinator/dashboard.py) and draws it.
// Charts: uPlot (static/vendor, pinned). A token given as ?token=... (the read-only dashboard_token) is sent as
// a Bearer header: it is kept in this tab's sessionStorage and taken off the address bar at once (history,
// bookmarks and screen shares then hold no token).
"use strict";

const POLL_MS = 2000;
const TOKEN_KEY = "dlc-dashboard-token";

function takeToken() {
  const url = new URL(location.href);
  const given = url.searchParams.get("token");
  if (given !== null) {
    try { sessionStorage.setItem(TOKEN_KEY, given); } catch (err) { /* storage off: kept in memory only */ }
    url.searchParams.delete("token");
    history.replaceState(history.state, "", url.pathname + url.search + url.hash);
    return given;
  }
  try { return sessionStorage.getItem(TOKEN_KEY); } catch (err) { return null; }
}

const token = takeToken();
const state = { rows: [], next: 0, charts: {}, syncSteps: [], essThreshold: null, lastSamplers: {}, lastPoll: null,
                batchLoaded: null };

async function api(path) {
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const reply = await fetch(`api/${path}`, { headers, cache: "no-store" });
  if (!reply.ok) throw new Error(`${path}: HTTP ${reply.status} ${await reply.text()}`);
  return reply.json();
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  return Number.isInteger(value) ? String(value) : value.toFixed(digits);
}

// ---------------------------------------------------------------------------------------------- charts

// Each chart's series come from the API (`overview.charts`: the statistics' names, meanings and units, from
// rlcommon/step_stats.py via coordinator/dashboard_data.py); the page holds only their colours, in order.
const COLOURS = {
  "chart-reward": ["#2563eb"],
  "chart-reward-components": ["#999", "#2563eb", "#16a34a", "#ea580c", "#9333ea", "#0891b2", "#dc2626", "#65a30d"],
  "chart-ess": ["#7c3aed", "#dc2626", "#999"],
  "chart-delta": ["#0891b2", "#ea580c", "#65a30d"],
  "chart-staleness": ["#2563eb", "#dc2626"],
  "chart-step-time": ["#0f766e"],
  "chart-tokens": ["#9333ea"],
};

function seriesValue(series, row, index) {
  if (series.derived === "ess_threshold") return state.essThreshold;
  if (series.derived === "rate") {
    const before = state.rows[index - 1];
    if (!before || row[series.of] === undefined || !(row.time > before.time)) return null;
    return row[series.of] / (row.time - before.time);
  }
  const value = row[series.name];
  return value === undefined || value === null || Number.isNaN(value) ? null : value;
}

// Vertical dashed lines at the steps where a sync happened (drawn on the ESS chart).
function syncMarkers() {
  return {
    hooks: {
      draw: [(u) => {
        const { ctx } = u;
        ctx.save();
        ctx.strokeStyle = "#16a34a";
        ctx.setLineDash([4, 3]);
        for (const step of state.syncSteps) {
          const x = u.valToPos(step, "x", true);
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          ctx.beginPath();
          ctx.moveTo(x, u.bbox.top);
          ctx.lineTo(x, u.bbox.top + u.bbox.height);
          ctx.stroke();
        }
        ctx.restore();
      }],
    },
  };
}

function chartData(series) {
  const steps = state.rows.map((r) => r.step);
  return [steps, ...series.map((one) => state.rows.map((row, i) => seriesValue(one, row, i)))];
}

function drawCharts(charts) {
  for (const [id, series] of Object.entries(charts)) {
    const data = chartData(series);
    if (state.charts[id] && state.charts[id].series.length === series.length + 1) {
      state.charts[id].setData(data);
      continue;
    }
    if (state.charts[id]) {  // its series changed (a reward component first reported): drawn again
      state.charts[id].destroy();
      delete state.charts[id];
    }
    const box = document.getElementById(id);
    const opts = {
      width: Math.max(380, box.clientWidth - 12),
      height: 190,
      scales: { x: { time: false } },
      series: [{ label: "step" }, ...series.map((one, i) => ({
        label: one.unit ? `${one.name} (${one.unit})` : one.name, stroke: (COLOURS[id] || [])[i] || "#444",
        width: one.derived === "ess_threshold" ? 1 : 1.5, dash: one.derived === "ess_threshold" ? [5, 5] : undefined,
        spanGaps: true,
      }))],
      axes: [{ label: "step" }, {}],
      plugins: id === "chart-ess" ? [syncMarkers()] : [],
    };
    state.charts[id] = new uPlot(opts, data, box);
    box.dataset.ready = "1";
  }
}

// One chart per eval set (evaluation while training): its metrics over the versions evaluated, the series' names
// from the API (`overview.evals.charts`); a version whose set is still being sampled has no point yet.
const EVAL_COLOURS = ["#2563eb", "#dc2626", "#16a34a"];

function drawEvalCharts(evals) {
  const section = document.getElementById("eval-charts");
  const sets = Object.keys(evals.charts);
  section.hidden = sets.length === 0;
  for (const name of sets) {
    const series = evals.charts[name];
    const points = evals.points[name].filter((p) => p.complete);
    const data = [points.map((p) => p.weight_version),
                  ...series.map((one) => points.map((p) => (p.metrics[one.name] ?? null)))];
    const id = `eval-chart-${name}`;
    if (state.charts[id]) {
      state.charts[id].setData(data);
      document.getElementById(id).dataset.points = points.length;
      continue;
    }
    const box = el("div", { class: "chart", id, "data-eval-set": name },
                   el("h2", {}, `eval: ${name} (by weight version)`));
    section.append(box);
    const opts = {
      width: Math.max(380, box.clientWidth - 12),
      height: 190,
      scales: { x: { time: false } },
      series: [{ label: "version" }, ...series.map((one, i) => ({
        label: one.name, stroke: EVAL_COLOURS[i % EVAL_COLOURS.length], width: 1.5, spanGaps: true,
        points: { show: true },
      }))],
      axes: [{ label: "weight version" }, {}],
    };
    state.charts[id] = new uPlot(opts, data, box);
    box.dataset.ready = "1";
    box.dataset.points = points.length;
  }
}

// ---------------------------------------------------------------------------------------------- tables

function fillTable(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows);
}

function drawHeadline(o) {
  document.getElementById("run-id").textContent = `· run ${o.run_id}`;
  const last = state.rows[state.rows.length - 1];
  const headline = document.getElementById("headline");
  headline.replaceChildren(
    el("span", {}, `${o.sync_policy_detail} · published v`, el("b", { id: "published-version" }, o.published_version),
       " · trainer v", el("b", { id: "trainer-version" }, o.trainer_version), " · last step ",
       el("b", { id: "last-step", "data-value": last ? last.step : "" }, last ? last.step : "–"),
       " · reward ", el("b", { id: "last-reward", "data-value": last ? last[o.headline.reward] : "" },
                        fmt(last && last[o.headline.reward], 4)),
       ` · ${o.headline.lag} `, el("b", { id: "last-ess-lag", "data-value": last ? last[o.headline.lag] : "" },
                                       fmt(last && last[o.headline.lag], 4))),
  );
}

function drawPlan(o) {
  const c = o.counts;
  const rows = [
    ["batches planned (being sampled)", c.planned, "count-planned"],
    ["batches complete (waiting to train)", c.complete, "count-complete"],
    ["batches trained", c.trained, "count-trained"],
    ["batches in the plan so far", c.total, "count-total"],
    ["run length (batches)", c.limit || "unbounded", "count-limit"],
    ["tasks queue depth", o.queue.tasks, "queue-tasks"],
    ["rollouts queue depth", o.queue.rollouts, "queue-rollouts"],
    ["slots re-issued (stalled batches)", o.slots_reissued, "slots-reissued"],
    ["dead letters", o.deadletters.length, "deadletter-length"],
  ];
  document.getElementById("plan").replaceChildren(
    ...rows.map(([k, v, id]) => el("tr", {}, el("td", {}, k), el("td", { id, "data-value": v }, fmt(v)))));
}

function drawSamplers(o) {
  const now = o.now;
  const seconds = state.lastPoll ? now - state.lastPoll : null;
  const rows = o.samplers.map((s) => {
    const before = state.lastSamplers[s.sampler_id];
    const rate = (key) => (before && seconds > 0 ? (s[key] - before[key]) / seconds : null);
    return el("tr", { "data-sampler": s.sampler_id },
      el("td", {}, s.sampler_id), el("td", {}, s.weight_version),
      el("td", { class: `health-${s.health}`, title: s.health_detail }, s.health),
      el("td", {}, s.num_inflight_tasks), el("td", {}, fmt(rate("num_rollouts"), 1)),
      el("td", {}, fmt(rate("num_tokens"), 0)), el("td", {}, `${fmt(now - s.last_heartbeat_at, 1)} s ago`));
  });
  state.lastSamplers = Object.fromEntries(o.samplers.map((s) => [s.sampler_id, s]));
  state.lastPoll = now;
  fillTable("samplers", rows);
}

function drawFleet(o) {
  // The desired sampler count and why (coordinator/fleet.py); no reason: the coordinator decided nothing yet.
  const f = o.fleet;
  const line = document.getElementById("fleet");
  const decided = Boolean(f && f.reason);
  line.textContent = decided ? `Fleet: desired ${f.desired} (${f.reason})` : "Fleet: no decision yet";
  line.dataset.value = decided ? f.desired : "";
  line.title = decided
    ? `${f.serving} serving, ${f.starting} starting, ${f.draining} draining; min ${f.min}, max ${f.max}` : "";
}

function drawSyncs(o) {
  fillTable("syncs", o.syncs.map((s) => el("tr", {},
    el("td", {}, s.weight_version), el("td", {}, s.step), el("td", {}, s.reason), el("td", {}, s.state),
    el("td", {}, fmt(s.seconds, 2)), el("td", {}, `${s.acked.length} / ${s.expected.length}`),
    el("td", {}, s.unhealthy.join(", ") || "–"))));
}

function drawDeadLetters(o) {
  fillTable("deadletters", o.deadletters.recent.map((d) => el("tr", {},
    el("td", {}, d.entry_id), el("td", {}, d.stream), el("td", {}, d.consumer), el("td", {}, d.delivery_count),
    el("td", {}, d.reason))));
}

async function poll() {
  try {
    const o = await api(`overview?since=${state.next}`);
    // Rows older than the coordinator keeps (coordinator.keep_step_rows) were dropped: start from its first.
    if (o.steps.from !== state.next) state.rows = [];
    state.rows.push(...o.steps.rows);
    state.next = o.steps.from + o.steps.rows.length;
    state.syncSteps = o.syncs.map((s) => s.step);
    state.essThreshold = o.ess_threshold;
    drawHeadline(o);
    drawCharts(o.charts);
    drawEvalCharts(o.evals);
    drawPlan(o);
    drawSamplers(o);
    drawFleet(o);
    drawSyncs(o);
    drawDeadLetters(o);
    const connection = document.getElementById("connection");
    connection.textContent = `updated ${new Date().toLocaleTimeString()} · ${state.rows.length} steps`;
    connection.dataset.steps = state.rows.length;
    if (!document.getElementById("view-rollouts").hidden) await loadBatchList();
  } catch (err) {
    document.getElementById("connection").textContent = `no answer: ${err.message}`;
  }
}

// ------------------------------------------------------------------------------------- rollout browser

function tokenColour(metric, value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "transparent";
  if (metric === "logmu") {  // log mu in [-5, 0]: white (certain) to orange (unlikely)
    const a = Math.min(1, -value / 5);
    return `rgba(234, 88, 12, ${a.toFixed(3)})`;
  }
  const a = Math.min(1, Math.abs(value) / 0.5);  // |delta| of 0.5 nat and more: full colour
  return value >= 0 ? `rgba(220, 38, 38, ${a.toFixed(3)})` : `rgba(37, 99, 235, ${a.toFixed(3)})`;
}

function drawBatch(batch) {
  const metric = document.getElementById("token-metric").value;
  document.getElementById("batch-summary").textContent =
    `batch ${batch.batch_id} · ${batch.status}${batch.trained_step >= 0 ? ` at step ${batch.trained_step}` : ""} · ` +
    `${batch.num_samples} of ${batch.num_slots} samples found in the rollouts stream` +
    (batch.token_stats ? " · trainer's per-token log-ratios: yes" : " · trainer's per-token log-ratios: not kept") +
    (batch.truncated ? " · cut short: the lookup's byte budget ran out" : "") + (batch.note ? ` · ${batch.note}` : "");
  const groups = batch.groups.map((g) => el("div", { class: "group", "data-group": g.group_id },
    el("div", { class: "prompt" }, `group ${g.group_id}: `, el("b", {}, g.prompt),
       g.answer ? el("span", { class: "muted" }, `  expected ${g.answer}`) : ""),
    ...g.samples.map((s) => {
      const values = s[metric];
      // One run per weight version that sampled the response (in-flight updates: several): a `vswitch` badge
      // before the first token of each later run, and every token's tooltip names its version.
      const runs = s.version_runs && s.version_runs.length ? s.version_runs : [{ start: 0, version: s.weight_version }];
      const tokens = [];
      let run = 0;
      s.tokens.forEach((text, t) => {
        while (run + 1 < runs.length && runs[run + 1].start <= t) {
          run += 1;
          tokens.push(el("span", { class: "vswitch", "data-version": runs[run].version, "data-start": t,
                                   title: `weight version ${runs[run].version} from token ${t}` }, `v${runs[run].version}`));
        }
        const version = runs[run].version;
        tokens.push(el("span", {
          class: "tok", "data-version": version, style: `background:${tokenColour(metric, values ? values[t] : null)}`,
          title: `v${version} · log μ ${fmt(s.logmu[t], 4)} · δ_lag ${fmt(s.lag ? s.lag[t] : null, 4)} · ` +
                 `δ_num ${fmt(s.num ? s.num[t] : null, 4)}`,
        }, text));
      });
      const versions = runs.map((r) => `v${r.version}`).join("→");
      return el("div", { class: "sample", "data-sample": s.sample_index },
        el("span", {}, `#${s.sample_index}`), el("span", { class: "reward", "data-value": s.reward }, `reward ${fmt(s.reward, 2)}`),
        el("span", { class: "versions", title: runs.length > 1 ? "weight versions that sampled this response" : "weight version" },
           versions),
        el("span", { class: "tokens" }, ...tokens));
    })));
  document.getElementById("groups").replaceChildren(...groups);
  document.getElementById("groups").dataset.batch = batch.batch_id;
}

async function loadBatch(batchId) {
  const batch = await api(`batches/${batchId}`);
  state.batchLoaded = batch;
  drawBatch(batch);
}

async function loadBatchList() {
  const select = document.getElementById("batch-select");
  const { batches } = await api("batches?limit=50");
  const chosen = select.value;
  select.replaceChildren(...batches.map((b) => el("option", { value: b.batch_id },
    `batch ${b.batch_id} · ${b.status}${b.trained_step >= 0 ? ` · step ${b.trained_step}` : ""}`)));
  if (chosen && batches.some((b) => String(b.batch_id) === chosen)) select.value = chosen;
  else {  // first time: the newest trained batch (the trainer's per-token log-ratios exist for trained ones)
    const trained = batches.find((b) => b.status === "trained");
    if (trained) select.value = String(trained.batch_id);
  }
  if (!state.batchLoaded && select.value) await loadBatch(select.value);
}

function show(view) {
  for (const button of document.querySelectorAll("nav button")) button.classList.toggle("active", button.dataset.view === view);
  document.getElementById("view-overview").hidden = view !== "overview";
  document.getElementById("view-rollouts").hidden = view !== "rollouts";
  if (view === "rollouts") loadBatchList().catch((err) => {
    document.getElementById("batch-summary").textContent = `no answer: ${err.message}`;
  });
}

document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => show(b.dataset.view)));
document.getElementById("batch-select").addEventListener("change", (e) => loadBatch(e.target.value).catch((err) => {
  document.getElementById("batch-summary").textContent = `no answer: ${err.message}`;  // e.g. 429: another lookup runs
}));
document.getElementById("token-metric").addEventListener("change", () => state.batchLoaded && drawBatch(state.batchLoaded));
poll();
setInterval(poll, POLL_MS);
