// Drives the real ComfyUI front end in headless Chromium for tests/e2e/test_frontend.py.
//
//   node drive.mjs '<json config>'
//     config: {url, workflow: <UI workflow object>, out: <artifact dir>, chromium: <path>, timeout_ms,
//              train_node, encode_node, info_node, cached_wait_ms}
//
// Loads the page, checks the pack's extension registered, loads the workflow with app.loadGraphData, queues it
// with app.queuePrompt, samples the Train LoRA panel (data-* attributes of the pack's DOM widget) while the run
// goes on, waits for the final curve, takes screenshots, queues once more (cached run: the curve must come back
// from the cached UI output), and prints ONE JSON line with everything observed, console messages included. The
// pytest side decides what passes; this script exits non-zero only when it could not drive the page at all.
import { chromium } from "playwright-core";
import fs from "node:fs";
import path from "node:path";

const cfg = JSON.parse(process.argv[2]);
const timeout = cfg.timeout_ms ?? 240000;
const result = { console: [], pageErrors: [], samples: [], steps: {} };
const started = Date.now();
const mark = (name) => { result.steps[name] = (Date.now() - started) / 1000; };

const browser = await chromium.launch({
  executablePath: cfg.chromium ?? "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-dev-shm-usage"],
});
try {
  const page = await browser.newPage({ viewport: { width: 1600, height: 2000 } }); // Train LoRA's chart in view
  page.on("console", (m) => result.console.push({ type: m.type(), text: m.text(), url: m.location()?.url ?? "" }));
  page.on("pageerror", (e) => result.pageErrors.push(String(e?.stack ?? e)));
  mark("launched");

  // a fresh user folder: mark the first-run tutorial done so the template browser does not cover the canvas
  for (const [id, value] of [["Comfy.TutorialCompleted", true]]) {
    await fetch(`${cfg.url}/api/settings/${id}`, { method: "POST", body: JSON.stringify(value) }).catch(() => {});
  }
  await page.goto(cfg.url, { waitUntil: "domcontentloaded", timeout });
  // ready: node definitions registered (ours included), the canvas exists and the default graph is loaded
  await page.waitForFunction(() => {
    const app = window.comfyAPI?.app?.app;
    return !!(app?.canvas && window.LiteGraph?.registered_node_types?.StreamCache_TrainLoRA
              && (app.extensions ?? []).some((e) => e.name === "streamcache.core") && app.graph?._nodes);
  }, null, { timeout, polling: 100 });
  await page.waitForTimeout(500);
  mark("page_ready");
  await page.keyboard.press("Escape"); // any first-run dialog

  // a Train LoRA node as a user adds it: which "control after generate" mode its seed starts with
  result.freshSeedControl = await page.evaluate(() => {
    const app = window.comfyAPI.app.app;
    const node = window.LiteGraph.createNode("StreamCache_TrainLoRA");
    app.graph.add(node);
    const seed = (node.widgets ?? []).find((w) => w.name === "seed");
    const control = (seed?.linkedWidgets ?? [])[0]
      ?? (node.widgets ?? []).find((w) => w.name === "control_after_generate");
    const value = control ? control.value : JSON.stringify((node.widgets ?? []).map((w) => [w.name, w.value]));
    app.graph.remove(node);
    return value;
  });
  await page.evaluate(async (workflow) => {
    await window.comfyAPI.app.app.loadGraphData(workflow);
  }, cfg.workflow);
  mark("workflow_loaded");
  result.panels = await page.evaluate(() => {
    const g = window.comfyAPI.app.app.graph;
    return g._nodes.map((n) => ({ id: n.id, type: n.type, panel: !!n.streamcachePanel,
                                  widgets: (n.widgets ?? []).map((w) => w.name) }));
  });
  result.prompt = await page.evaluate(async () => (await window.comfyAPI.app.app.graphToPrompt()).output);
  result.widgets_values = await page.evaluate(
    () => window.comfyAPI.app.app.graph.serialize().nodes.map((n) => [n.id, n.widgets_values]));
  if (!result.panels.find((p) => p.id === cfg.train_node)?.panel) {
    await page.screenshot({ path: path.join(cfg.out, "frontend.png") });
    throw new Error("the Train LoRA node has no streamcache panel: " + JSON.stringify(result.panels));
  }

  const panelState = (id) => page.evaluate((nodeId) => {
    const n = window.comfyAPI.app.app.graph.getNodeById(nodeId);
    const root = n?.streamcachePanel?.root;
    if (!root) return null;
    const r = root.getBoundingClientRect();
    return { ...root.dataset, visible: r.width > 0 && r.height > 0, w: r.width, h: r.height,
             text: root.innerText };
  }, id);

  // after the extension's own listener (listeners run in order): what the panel showed right after each event
  await page.evaluate((nodeId) => {
    window.__streamcacheSeen = [];
    window.comfyAPI.api.api.addEventListener("streamcache.train", ({ detail }) => {
      const root = window.comfyAPI.app.app.graph.getNodeById(nodeId)?.streamcachePanel?.root;
      window.__streamcacheSeen.push({ event: detail, panel: root ? { ...root.dataset } : null });
    });
  }, cfg.train_node);
  await page.evaluate(() => window.comfyAPI.app.app.queuePrompt(0, 1));
  mark("queued");
  let shot = 0;
  const deadline = Date.now() + timeout;
  while (Date.now() < deadline) {
    const train = await panelState(cfg.train_node);
    const encode = await panelState(cfg.encode_node);
    const last = result.samples.at(-1);
    if (!last || JSON.stringify(last.train) !== JSON.stringify(train) || last.encode?.phase !== encode?.phase
        || last.encode?.done !== encode?.done) {
      result.samples.push({ t: (Date.now() - started) / 1000, train, encode });
      if (train?.points && Number(train.points) >= 2 && train.final !== "true" && shot === 0) {
        shot = 1;
        await page.screenshot({ path: path.join(cfg.out, "frontend-live.png") });
      }
    }
    if (train?.final === "true") break;
    await page.waitForTimeout(50);
  }
  mark("finished");
  result.seen = await page.evaluate(() => window.__streamcacheSeen);
  await page.keyboard.press("Escape"); // a toast or dialog over the canvas
  await page.waitForTimeout(500); // let the info panel and the canvas settle
  result.final = {
    train: await panelState(cfg.train_node),
    encode: await panelState(cfg.encode_node),
    info: cfg.info_node != null ? await panelState(cfg.info_node) : null,
  };
  await page.screenshot({ path: path.join(cfg.out, "frontend.png") });
  const box = await page.evaluate((nodeId) => {
    const root = window.comfyAPI.app.app.graph.getNodeById(nodeId)?.streamcachePanel?.root;
    const r = root?.getBoundingClientRect();
    return r ? { x: r.x, y: r.y, width: r.width, height: r.height } : null;
  }, cfg.train_node);
  if (box && box.width > 0) await page.screenshot({ path: path.join(cfg.out, "frontend-loss-curve.png"), clip: box });

  // a second queue: everything upstream is cached; the curve must come back from the cached UI output
  await page.evaluate((id) => {
    const p = window.comfyAPI.app.app.graph.getNodeById(id)?.streamcachePanel;
    if (p) { p.reset(null); p.renderHead(null); }
  }, cfg.train_node);
  await page.evaluate(() => window.comfyAPI.app.app.queuePrompt(0, 1));
  const again = Date.now() + (cfg.cached_wait_ms ?? 60000);
  let cached = null;
  while (Date.now() < again) {
    cached = await panelState(cfg.train_node);
    if (cached?.final === "true") break;
    await page.waitForTimeout(100);
  }
  result.cached = cached;
  mark("cached_run");
  result.history = await page.evaluate(async () => {
    const r = await window.comfyAPI.api.api.fetchApi("/history?max_items=10");
    return r.json();
  });
} catch (err) {
  result.error = String(err?.stack ?? err);
} finally {
  await browser.close();
}
fs.writeFileSync(path.join(cfg.out, "frontend-result.json"), JSON.stringify(result, null, 1));
process.stdout.write(JSON.stringify(result) + "\n");
