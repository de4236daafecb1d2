// ComfyUI-StreamCache front-end extension: live panels drawn on the pack's nodes.
//
// ComfyUI serves every *.js file under web/ (WEB_DIRECTORY) at /extensions/<pack>/js/… and imports it as an ES
// module, hence the three "../" to reach /scripts/. Everything shown here also reaches /history as plain node
// output (the `text` list plus structured lists), so the pack works without this file; it only draws:
//
//  * Train LoRA (Stream Cache): a live loss curve (raw + smoothed, and the validation loss where `val_dataset` is
//    connected) from the `streamcache.train` websocket event ({node, step, total, loss, loss_smooth, samples_per_s,
//    data_wait_pct, learning_rate, val_loss, val_step, grad_norm}), replaced by the full curve from the node's UI
//    outputs `loss` and `val_loss` when the run ends (onExecuted; also re-sent for cached runs);
//  * Encode Dataset: the source/encode report, live from `streamcache.encode` ({node, phase, done, total,
//    samples, new, changed, unchanged, removed, failed}) and final from the UI output `streamcache_report`;
//  * Load Lazy Cache / Cache Info: size, samples, buckets, encoders and a warning badge when the check found
//    problems, from the UI output `streamcache_info`.
//
// It also renames, when a saved workflow is loaded, the inputs that older versions of the pack called otherwise
// (RENAMED_INPUTS, the same table as nodes/inputs.py RENAMED_INPUTS; API prompts are renamed by the server).
// Widget values are stored by position and the renamed inputs kept theirs; what must change is the name of the
// node's input slot for each widget (and of a widget turned into a linked input), which the front end matches by
// name: left as it was, the old slot would stay on the node as a dangling extra input.
//
// Each panel is a DOM widget with serialize:false, added after the node's own widgets, so workflows and API
// prompts are unchanged. The panels expose their figures as data-* attributes (used by tests/e2e).
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";

const TRAIN = "StreamCache_TrainLoRA";
const ENCODE = "StreamCache_EncodeDataset";
const INFO_NODES = new Set(["StreamCache_LoadLazyCache", "StreamCache_CacheInfo"]);
const SMOOTHING = 0.1; // nodes/lora_training.py _SMOOTHING: weight of the newest loss in the moving average
const VAL_COLOR = "#5fd38d"; // the validation loss on the train panel's chart
const MAX_POINTS = 4000; // a live curve keeps at most this many points (every other one is dropped beyond)
const PANEL = "streamcache_panel";

const RENAMED_INPUTS = {
  StreamCache_EncodeDataset: { dataset: "dataset_name" },
  StreamCache_SaveCache: { name: "cache" },
  StreamCache_LoadLazyCache: { name: "cache", dataset: "dataset_name" },
  StreamCache_CleanCache: { name: "cache" },
};

let currentPrompt = null; // prompt id of the run in progress (from `execution_start`)

// ------------------------------------------------------------------------------------------------- helpers

function guard(what, fn) {
  return function (...args) {
    try {
      return fn.apply(this, args);
    } catch (err) {
      console.error(`[streamcache] ${what} failed:`, err);
    }
  };
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text != null) e.textContent = text;
  return e;
}

function fmtNum(v, digits = 4) {
  if (v == null || !Number.isFinite(Number(v))) return "–";
  const x = Number(v);
  if (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e5)) return x.toExponential(2);
  return x.toFixed(digits);
}

function fmtBytes(n) {
  if (n == null || !Number.isFinite(Number(n))) return "–";
  let v = Number(n);
  for (const unit of ["B", "KiB", "MiB", "GiB", "TiB"]) {
    if (v < 1024 || unit === "TiB") return unit === "B" ? `${v} B` : `${v.toFixed(1)} ${unit}`;
    v /= 1024;
  }
  return `${n} B`;
}

function first(list) {
  return Array.isArray(list) ? list[0] : list;
}

function injectStyle() {
  if (document.getElementById("streamcache-style")) return;
  const style = el("style");
  style.id = "streamcache-style";
  style.textContent = `
.streamcache-panel{box-sizing:border-box;width:100%;height:100%;display:flex;flex-direction:column;gap:4px;
  padding:4px 6px;font:11px/1.35 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;
  color:var(--input-text,#ddd);background:var(--comfy-input-bg,#222);border-radius:6px;overflow:hidden}
.streamcache-head{display:flex;flex-wrap:wrap;gap:2px 10px;white-space:nowrap}
.streamcache-head b{font-weight:600;color:var(--fg-color,#fff)}
.streamcache-muted{opacity:.65}
.streamcache-canvas{flex:1 1 auto;min-height:60px;width:100%;display:block}
.streamcache-grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(96px,1fr));gap:3px}
.streamcache-chip{display:flex;justify-content:space-between;gap:4px;padding:1px 5px;border-radius:4px;
  background:rgba(127,127,127,.15)}
.streamcache-chip.warn{background:rgba(230,140,30,.35)}
.streamcache-bar{height:5px;border-radius:3px;background:rgba(127,127,127,.25);overflow:hidden}
.streamcache-bar>div{height:100%;width:0;background:#4aa3ff;transition:width .2s}
.streamcache-badge{align-self:flex-start;padding:0 6px;border-radius:8px;font-weight:600}
.streamcache-badge.ok{background:rgba(60,170,90,.35)}
.streamcache-badge.warn{background:rgba(230,120,20,.75);color:#fff}
.streamcache-rows{display:grid;grid-template-columns:auto 1fr;gap:0 8px;overflow:hidden}
.streamcache-rows span:nth-child(odd){opacity:.65}
.streamcache-rows span{overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.streamcache-foot{white-space:pre-wrap;overflow:hidden;max-height:3.9em;opacity:.8}
`;
  document.head.appendChild(style);
}

function findNode(id) {
  if (id == null) return null;
  const key = String(id);
  for (const graph of [app.graph, app.canvas?.graph]) {
    if (!graph?.getNodeById) continue;
    const node = graph.getNodeById(key) ?? graph.getNodeById(Number(key));
    if (node) return node;
  }
  const last = key.split(":").pop(); // a node inside a subgraph: "outer:inner" — shown if that graph is open
  if (last !== key) return app.canvas?.graph?.getNodeById?.(last) ?? app.canvas?.graph?.getNodeById?.(Number(last));
  return null;
}

function redrawCanvas() {
  app.graph?.setDirtyCanvas?.(true, true);
}

function addPanel(node, panel, minHeight) {
  const widget = node.addDOMWidget(PANEL, "streamcache", panel.root, {
    serialize: false,
    hideOnZoom: false,
    getMinHeight: () => minHeight,
    getValue: () => undefined,
    setValue: () => {},
  });
  widget.serialize = false;
  node.streamcachePanel = panel;
  const [w, h] = node.computeSize();
  node.setSize([Math.max(node.size?.[0] ?? 0, w, 300), Math.max(node.size?.[1] ?? 0, h)]);
  return widget;
}

// ------------------------------------------------------------------------------------------------ train panel

class LossPanel {
  constructor() {
    this.root = el("div", "streamcache-panel streamcache-train");
    this.head = el("div", "streamcache-head");
    this.canvas = el("canvas", "streamcache-canvas");
    this.foot = el("div", "streamcache-foot streamcache-muted", "Loss curve: queue the prompt to train.");
    this.root.append(this.head, this.canvas, this.foot);
    this.reset(null);
    this.renderHead(null);
    new ResizeObserver(guard("loss chart resize", () => this.draw())).observe(this.canvas);
  }

  reset(prompt) {
    this.prompt = prompt;
    this.steps = [];
    this.raw = [];
    this.smooth = [];
    this.val = []; // [global step, validation loss]; the first is measured before the run's first step
    this.total = 0;
    this.final = false;
  }

  onEvent(d) {
    const step = Number(d.step);
    if (this.final || this.prompt !== currentPrompt || (this.steps.length && step <= this.steps.at(-1))) {
      this.reset(currentPrompt);
    }
    this.total = Number(d.total) || this.total;
    this.steps.push(step);
    this.raw.push(Number(d.loss));
    this.smooth.push(Number(d.loss_smooth ?? d.loss));
    const lastVal = this.val.at(-1);
    if (d.val_loss != null && d.val_step != null && (!lastVal || Number(d.val_step) > lastVal[0])) {
      this.val.push([Number(d.val_step), Number(d.val_loss)]);
    }
    if (this.steps.length > MAX_POINTS) {
      for (const a of [this.steps, this.raw, this.smooth]) a.splice(0, a.length, ...a.filter((_, i) => i % 2 === 0));
    }
    this.renderHead(d);
    this.foot.textContent = "training…";
    this.draw();
  }

  onFinal(losses, text, val) {
    const values = (losses ?? []).map(Number);
    const last = this.prompt === currentPrompt && !this.final ? this.last ?? {} : {};
    this.reset(currentPrompt);
    this.final = true;
    let s = null;
    values.forEach((v, i) => {
      s = s == null ? v : (1 - SMOOTHING) * s + SMOOTHING * v;
      this.steps.push(i + 1);
      this.raw.push(v);
      this.smooth.push(s);
    });
    this.total = values.length;
    this.val = (Array.isArray(val) ? val : []).map(([step, v]) => [Number(step), Number(v)]);
    this.renderHead({ step: values.length, total: values.length, loss: values.at(-1), loss_smooth: s,
                      samples_per_s: last.samples_per_s, data_wait_pct: last.data_wait_pct,
                      learning_rate: last.learning_rate, val_loss: last.val_loss, grad_norm: last.grad_norm });
    this.foot.textContent = text ?? "done";
    this.draw();
  }

  renderHead(d) {
    this.last = d ?? this.last;
    const h = this.head;
    h.replaceChildren();
    const item = (label, value) => {
      const span = el("span");
      span.append(el("span", "streamcache-muted", label + " "), el("b", null, value));
      h.append(span);
    };
    item("step", d ? `${d.step}/${d.total}` : "–");
    item("loss", d ? fmtNum(d.loss) : "–");
    item("smoothed", d ? fmtNum(d.loss_smooth) : "–");
    item("samples/s", d && d.samples_per_s != null ? fmtNum(d.samples_per_s, 2) : "–");
    item("data wait", d && d.data_wait_pct != null ? `${Number(d.data_wait_pct).toFixed(1)}%` : "–");
    if (d && d.learning_rate != null) item("lr", Number(d.learning_rate).toPrecision(3));
    if (d && d.val_loss != null) item("val loss", fmtNum(d.val_loss));
    if (d && d.grad_norm != null) item("grad norm", fmtNum(d.grad_norm, 3));
    Object.assign(this.root.dataset, {
      step: d?.step ?? "", total: d?.total ?? "", loss: d?.loss ?? "", lossSmooth: d?.loss_smooth ?? "",
      learningRate: d?.learning_rate ?? "", gradNorm: d?.grad_norm ?? "", valPoints: String(this.val.length),
      points: String(this.steps.length), final: String(this.final),
    });
  }

  draw() {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(1, Math.round(c.clientWidth * dpr));
    const h = Math.max(1, Math.round(c.clientHeight * dpr));
    if (c.width !== w || c.height !== h) {
      c.width = w;
      c.height = h;
    }
    const g = c.getContext("2d");
    g.clearRect(0, 0, w, h);
    const css = getComputedStyle(this.root);
    const fg = css.color || "#ddd";
    g.font = `${10 * dpr}px ui-monospace, monospace`;
    const padL = 50 * dpr, padR = 6 * dpr, padT = 6 * dpr, padB = 14 * dpr;
    const pw = w - padL - padR, ph = h - padT - padB;
    if (pw <= 0 || ph <= 0) return;
    const values = this.raw.concat(this.smooth, this.val.map((p) => p[1])).filter(Number.isFinite);
    g.strokeStyle = "rgba(127,127,127,0.35)";
    g.lineWidth = dpr;
    g.strokeRect(padL, padT, pw, ph);
    if (!values.length) {
      g.fillStyle = fg;
      g.globalAlpha = 0.6;
      g.fillText("no loss yet", padL + 6 * dpr, padT + ph / 2);
      g.globalAlpha = 1;
      return;
    }
    let lo = Math.min(...values), hi = Math.max(...values);
    // a log scale when the losses span decades (an early spike would flatten everything else)
    const log = lo > 0 && hi / lo > 30;
    const t = log ? Math.log10 : (v) => v;
    let tlo = t(lo), thi = t(hi);
    if (thi - tlo < 1e-12) { tlo -= 0.05 * (Math.abs(tlo) || 1); thi += 0.05 * (Math.abs(thi) || 1); }
    const span = thi - tlo;
    tlo -= span * 0.05; thi += span * 0.05;
    const xMax = Math.max(this.total, this.steps.at(-1) ?? 1, 1);
    // validation points sit at the run's own steps: the first was measured before step 1, at step 0
    const valStart = this.val.length ? this.val[0][0] : 0;
    const xMin = this.val.length ? 0 : xMax > 1 ? 1 : 0;
    const x = (s) => padL + (pw * (s - xMin)) / Math.max(xMax - xMin, 1);
    const y = (v) => padT + ph - (ph * (t(v) - tlo)) / (thi - tlo);
    g.fillStyle = fg;
    g.globalAlpha = 0.7;
    g.textBaseline = "top";
    g.fillText(fmtNum(hi, 3), 2 * dpr, padT);
    g.textBaseline = "bottom";
    g.fillText(fmtNum(lo, 3), 2 * dpr, padT + ph);
    if (log) {
      g.textBaseline = "middle";
      g.fillText("log", 2 * dpr, padT + ph / 2);
    }
    g.textBaseline = "top";
    g.fillText(this.val.length ? "0" : "1", padL, padT + ph + 2 * dpr);
    const endLabel = String(xMax);
    g.fillText(endLabel, padL + pw - g.measureText(endLabel).width, padT + ph + 2 * dpr);
    g.globalAlpha = 1;
    const line = (ys, color, width) => {
      g.beginPath();
      g.strokeStyle = color;
      g.lineWidth = width * dpr;
      let started = false;
      ys.forEach((v, i) => {
        if (!Number.isFinite(v)) return;
        const px = x(this.steps[i]), py = y(v);
        if (started) g.lineTo(px, py); else { g.moveTo(px, py); started = true; }
      });
      if (this.steps.length === 1) g.arc(x(this.steps[0]), y(ys[0]), 2 * dpr, 0, 2 * Math.PI);
      g.stroke();
    };
    line(this.raw, "rgba(120,170,255,0.55)", 1);
    line(this.smooth, "#ffb347", 2);
    if (this.val.length) { // the validation loss: a line through its points, each marked
      g.strokeStyle = g.fillStyle = VAL_COLOR;
      g.lineWidth = 1.5 * dpr;
      g.beginPath();
      this.val.forEach(([s, v], i) => (i ? g.lineTo : g.moveTo).call(g, x(s - valStart), y(v)));
      g.stroke();
      for (const [s, v] of this.val) g.fillRect(x(s - valStart) - 2 * dpr, y(v) - 2 * dpr, 4 * dpr, 4 * dpr);
    }
    g.fillStyle = "#ffb347";
    g.textBaseline = "top";
    const legend = "smoothed";
    g.fillText(legend, padL + pw - g.measureText(legend).width - 4 * dpr, padT + 2 * dpr);
    g.fillStyle = "rgba(120,170,255,0.9)";
    g.fillText("raw", padL + pw - g.measureText(legend + " raw").width - 8 * dpr, padT + 2 * dpr);
    if (this.val.length) {
      g.fillStyle = VAL_COLOR;
      g.fillText("val", padL + pw - g.measureText(legend + " raw val").width - 12 * dpr, padT + 2 * dpr);
    }
  }
}

// ------------------------------------------------------------------------------------------------ encode panel

const ENCODE_FIELDS = [
  ["new", "new"], ["changed", "changed"], ["unchanged", "unchanged"], ["removed", "removed"],
  ["encoded", "encoded"], ["failed", "failed"], ["samples", "samples"], ["bytes_written", "written"],
];

class EncodePanel {
  constructor() {
    this.root = el("div", "streamcache-panel streamcache-encode");
    this.status = el("div", "streamcache-head");
    this.bar = el("div", "streamcache-bar");
    this.fill = el("div");
    this.bar.append(this.fill);
    this.grid = el("div", "streamcache-grid");
    this.foot = el("div", "streamcache-foot streamcache-muted");
    this.root.append(this.status, this.bar, this.grid, this.foot);
    this.render({}, "Encode report: queue the prompt to encode.");
  }

  render(d, status, done, total) {
    this.status.textContent = status;
    const pct = total ? Math.min(100, (100 * (done ?? 0)) / total) : d.phase === "done" ? 100 : 0;
    this.fill.style.width = `${pct}%`;
    this.grid.replaceChildren();
    for (const [key, label] of ENCODE_FIELDS) {
      let value = d[key];
      if (key === "encoded" && value == null && d.phase === "encoding") value = `${done ?? 0}/${total ?? 0}`;
      if (key === "bytes_written") value = value == null ? "–" : fmtBytes(value);
      const chip = el("span", "streamcache-chip" + (key === "failed" && Number(value) > 0 ? " warn" : ""));
      chip.append(el("span", "streamcache-muted", label), el("b", null, value == null ? "–" : String(value)));
      this.grid.append(chip);
    }
    const fields = {};
    for (const [key] of ENCODE_FIELDS) fields[key] = d[key] ?? "";
    Object.assign(this.root.dataset, { phase: d.phase ?? "", done: done ?? "", total: total ?? "", ...fields });
  }

  onEvent(d) {
    this.render(d, `encoding ${d.done}/${d.total} entries…`, Number(d.done), Number(d.total));
    this.foot.textContent = "";
  }

  onFinal(report, text) {
    const d = { ...report, phase: "done" };
    const what = d.sourceless ? "source folder gone: served from the cache"
      : d.stopped ? "stopped: run again to encode the rest"
      : `done in ${fmtNum(d.seconds, 1)} s, reused ${d.reused ?? 0} cached entries`;
    this.render(d, what);
    const failures = (d.failures ?? []).map((f) => `failed: ${f}`).join("\n");
    this.foot.textContent = failures || (text ?? "").split("\n").slice(-1)[0];
  }
}

// -------------------------------------------------------------------------------------------------- info panel

class InfoPanel {
  constructor() {
    this.root = el("div", "streamcache-panel streamcache-info");
    this.badge = el("span", "streamcache-badge", "not run yet");
    this.rows = el("div", "streamcache-rows");
    this.foot = el("div", "streamcache-foot");
    this.root.append(this.badge, this.rows, this.foot);
  }

  onFinal(info) {
    const d = info ?? {};
    const problems = d.problems ?? [];
    this.badge.className = "streamcache-badge " + (problems.length ? "warn" : "ok");
    this.badge.textContent = d.exists === false ? "no cache"
      : problems.length ? `⚠ ${problems.length} problem${problems.length > 1 ? "s" : ""}`
      : `✓ ok (${d.verified === "full" ? "fully verified" : "headers checked"})`;
    this.badge.title = problems.join("\n");
    const rows = [];
    const add = (k, v) => v != null && v !== "" && rows.push([k, String(v)]);
    if (d.kind === "dataset") add("dataset", d.dataset);
    add("samples", d.samples_with_repeats != null ? `${d.samples} (${d.samples_with_repeats} with repeats)` : d.samples);
    if (d.buckets) add("buckets", Object.entries(d.buckets).map(([k, n]) => `${k} ×${n}`).join(", "));
    if (d.bytes != null) add("size", `${fmtBytes(d.bytes)} · ${d.entries} entries · ${d.shards} shards`);
    if (d.kind === "cache" && d.datasets) {
      add("datasets", Object.entries(d.datasets).map(([k, n]) => `${k} (${n})`).join(", ") || "none");
    }
    add("VAE", d.vae_fingerprint ? String(d.vae_fingerprint).slice(0, 16) : null);
    add("text enc.", d.text_fingerprint ? String(d.text_fingerprint).slice(0, 16) : null);
    add("from", d.converted_from || d.source || d.folder || null);
    if (d.exists === false) add("path", d.root);
    this.rows.replaceChildren(...rows.flatMap(([k, v]) => {
      const value = el("span", null, v);
      value.title = v;
      return [el("span", null, k), value];
    }));
    const short = (p) => (d.root && p.startsWith(d.root) ? "…" + p.slice(d.root.length) : p);
    this.foot.textContent = problems.slice(0, 3).map(short).join("\n");
    Object.assign(this.root.dataset, { problems: String(problems.length), samples: d.samples ?? "",
                                       bytes: d.bytes ?? "" });
  }
}

// ------------------------------------------------------------------------------------------------ old names

// Rename, in a node's saved data, the widget slots an older version named otherwise (before configure reads it).
// Only widget slots: Save Streamable Cache's `dataset` socket keeps its name.
function renameSavedInputs(info, renamed) {
  if (!info || !renamed) return info;
  const names = new Set((info.inputs ?? []).map((slot) => slot?.name));
  for (const slot of info.inputs ?? []) {
    const next = slot && renamed[slot.name];
    if (!next || !slot.widget || names.has(next)) continue;
    if (slot.label === slot.name) delete slot.label;
    if (slot.localized_name === slot.name) slot.localized_name = next;
    if (slot.widget.name === slot.name) slot.widget.name = next;
    slot.name = next;
    names.add(next);
  }
  const values = info.widgets_values;
  if (values && typeof values === "object" && !Array.isArray(values)) {
    for (const [old, next] of Object.entries(renamed)) {
      if (old in values && !(next in values)) {
        values[next] = values[old];
        delete values[old];
      }
    }
  }
  return info;
}

// ------------------------------------------------------------------------------------------------ registration

const PANELS = {
  [TRAIN]: { make: () => new LossPanel(), minHeight: 170 },
  [ENCODE]: { make: () => new EncodePanel(), minHeight: 122 },
};
for (const name of INFO_NODES) PANELS[name] = { make: () => new InfoPanel(), minHeight: 96 };

function onEventFor(type, handler) {
  api.addEventListener(type, guard(`${type} event`, ({ detail }) => {
    const node = findNode(detail?.node);
    const panel = node?.streamcachePanel;
    if (!panel) return;
    handler(panel, detail);
    redrawCanvas();
  }));
}

app.registerExtension({
  name: "streamcache.core",

  setup() {
    injectStyle();
    api.addEventListener("execution_start", ({ detail }) => {
      currentPrompt = detail?.prompt_id ?? null;
    });
    onEventFor("streamcache.train", (panel, d) => panel.onEvent?.(d));
    onEventFor("streamcache.encode", (panel, d) => panel.onEvent?.(d));
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    const renamed = RENAMED_INPUTS[nodeData?.name];
    if (renamed) {
      const configure = nodeType.prototype.configure;
      nodeType.prototype.configure = function (info, ...rest) {
        guard(`${nodeData.name} old input names`, () => renameSavedInputs(info, renamed)).call(this);
        return configure.apply(this, [info, ...rest]);
      };
    }

    const spec = PANELS[nodeData?.name];
    if (!spec) return;

    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function (...args) {
      const result = onNodeCreated?.apply(this, args);
      guard(`${nodeData.name} panel`, () => addPanel(this, spec.make(), spec.minHeight)).call(this);
      return result;
    };

    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output, ...rest) {
      const result = onExecuted?.apply(this, [output, ...rest]);
      guard(`${nodeData.name} output`, () => {
        const panel = this.streamcachePanel;
        if (!panel || !output) return;
        const text = first(output.text);
        if (nodeData.name === TRAIN && Array.isArray(output.loss)) panel.onFinal(output.loss, text, output.val_loss);
        else if (nodeData.name === ENCODE && output.streamcache_report) panel.onFinal(first(output.streamcache_report), text);
        else if (INFO_NODES.has(nodeData.name) && output.streamcache_info) panel.onFinal(first(output.streamcache_info));
        redrawCanvas();
      }).call(this);
      return result;
    };
  },
});
