// rnnserve's live dashboard: polls /dashboard/stats every second and draws each panel on a canvas.
"use strict";

const WINDOW_S = 300;
const COLORS = ["#4fc3f7", "#ffb74d", "#81c784", "#e57373"];

const fmtNumber = (v) => {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
  if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
  return v.toFixed(a >= 10 ? 1 : 2);
};
const fmtBytes = (v) => {
  if (v === null || v === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
};
const fmtSeconds = (v) => {
  if (v === null || v === undefined) return "–";
  if (v === 0) return "0";
  if (v < 1) return (v * 1000).toFixed(v < 0.01 ? 2 : 1) + " ms";
  return v.toFixed(2) + " s";
};

const pick = (path) => (p) => path.split(".").reduce((o, k) => (o === null || o === undefined ? null : o[k]), p);

const TILES = [
  ["generation_tps", "generation tok/s", fmtNumber],
  ["prompt_tps", "prompt tok/s", fmtNumber],
  ["running", "running", fmtNumber],
  ["waiting", "waiting", fmtNumber],
  ["slots", "state slots", (p) => `${fmtNumber(p.slots_used)} / ${fmtNumber(p.slots_total)}`, true],
  ["state_memory", "state memory", (p) => `${fmtBytes(p.state_memory_used_bytes)} / ${fmtBytes(p.state_memory_total_bytes)}`, true],
  ["ttft.p50", "TTFT p50", fmtSeconds],
  ["itl.p50", "inter-token p50", fmtSeconds],
  ["e2e.p50", "end-to-end p50", fmtSeconds],
  ["errors_per_s", "errors/s", fmtNumber],
  ["rejected_per_s", "rejected (429)/s", fmtNumber],
];

const latency = (key) => [["p50", `${key}.p50`], ["p90", `${key}.p90`], ["p99", `${key}.p99`]];
const PANELS = [
  { id: "throughput", title: "Throughput (tokens/s)", fmt: fmtNumber,
    series: [["generation", "generation_tps"], ["prompt", "prompt_tps"]] },
  { id: "requests", title: "Requests", fmt: fmtNumber, series: [["running", "running"], ["waiting", "waiting"]] },
  { id: "slots", title: "State slots", fmt: fmtNumber, series: [["used", "slots_used"], ["total", "slots_total"]] },
  { id: "memory", title: "State memory", fmt: fmtBytes,
    series: [["used", "state_memory_used_bytes"], ["total", "state_memory_total_bytes"]] },
  { id: "ttft", title: "Time to first token", fmt: fmtSeconds, series: latency("ttft") },
  { id: "itl", title: "Inter-token latency", fmt: fmtSeconds, series: latency("itl") },
  { id: "e2e", title: "End-to-end latency", fmt: fmtSeconds, series: latency("e2e") },
  { id: "outcomes", title: "Finished, errors, rejections (/s)", fmt: fmtNumber,
    series: [["finished", "requests_per_s"], ["errors", "errors_per_s"], ["rejected 429", "rejected_per_s"]] },
];

const state = { points: [], last: 0 };
window.rnnserveDashboard = state;

function build() {
  const tiles = document.getElementById("tiles");
  for (const [key, label] of TILES) {
    const tile = document.createElement("div");
    tile.className = "tile";
    tile.innerHTML = `<div class="label">${label}</div><div class="value" id="v-${key.replace(".", "-")}">–</div>`;
    tiles.appendChild(tile);
  }
  const charts = document.getElementById("charts");
  for (const panel of PANELS) {
    const box = document.createElement("div");
    box.className = "chart";
    const legend = panel.series
      .map(([name], i) => `<span><i style="background:${COLORS[i]}"></i>${name}</span>`).join("");
    box.innerHTML = `<h2>${panel.title}</h2><div class="legend">${legend}</div><canvas id="c-${panel.id}"></canvas>`;
    charts.appendChild(box);
    panel.get = panel.series.map(([, path]) => pick(path));
  }
}

// A round grid step of at least `raw`: 1, 2, 2.5 or 5 times a power of ten (a power of two for bytes).
function niceStep(raw, binary) {
  if (binary) return 2 ** Math.ceil(Math.log2(Math.max(raw, 1)));
  const power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw);
}

function draw(panel, points, now) {
  const canvas = document.getElementById(`c-${panel.id}`);
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  const left = 64, right = 16, top = 6, bottom = 18;
  const plotW = width - left - right, plotH = height - top - bottom;
  let max = 0;
  for (const p of points) for (const get of panel.get) { const v = get(p); if (v !== null && v > max) max = v; }
  const step = niceStep(max > 0 ? max / 4 : 0.25, panel.fmt === fmtBytes);
  const ticks = Math.max(1, Math.ceil(max / step));
  max = ticks * step;
  const x = (t) => left + plotW * (1 - (now - t) / WINDOW_S);
  const y = (v) => top + plotH * (1 - v / max);

  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#8a96a3";
  ctx.strokeStyle = "#2a3440";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= ticks; i += 1) {
    const v = step * i, yy = Math.round(y(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(left + plotW, yy); ctx.stroke();
    ctx.fillText(panel.fmt(v), left - 6, yy);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (let s = 0; s <= WINDOW_S; s += 60) ctx.fillText(s === 0 ? "now" : `-${s / 60}m`, x(now - s), top + plotH + 4);

  ctx.lineWidth = 2;
  panel.get.forEach((get, i) => {
    ctx.strokeStyle = COLORS[i];
    ctx.beginPath();
    let drawing = false;
    for (const p of points) {
      const v = get(p);
      if (v === null || v === undefined) { drawing = false; continue; }
      if (drawing) ctx.lineTo(x(p.t), y(v)); else ctx.moveTo(x(p.t), y(v));
      drawing = true;
    }
    ctx.stroke();
  });
}

function render() {
  const points = state.points;
  if (!points.length) return;
  const latest = points[points.length - 1];
  for (const [key, , fmt, whole] of TILES) {
    document.getElementById(`v-${key.replace(".", "-")}`).textContent = whole ? fmt(latest) : fmt(pick(key)(latest));
  }
  for (const panel of PANELS) draw(panel, points, latest.t);
}

async function poll() {
  try {
    const response = await fetch(`/dashboard/stats?since=${state.last}`, { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const stats = await response.json();
    document.getElementById("model").textContent = stats.model;
    if (stats.points.length) {
      state.points.push(...stats.points);
      state.last = stats.points[stats.points.length - 1].t;
      const oldest = state.last - WINDOW_S;
      while (state.points.length && state.points[0].t < oldest) state.points.shift();
    }
    document.getElementById("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    render();
  } catch (err) {
    document.getElementById("status").textContent = `stats unavailable: ${err.message}`;
  }
  setTimeout(poll, 1000);
}

build();
window.addEventListener("resize", render);
poll();
