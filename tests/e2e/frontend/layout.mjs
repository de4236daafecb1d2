// Adds every node of the pack fresh in the real ComfyUI front end and loads saved workflows, for
// tests/e2e/test_frontend.py (test_every_node_fresh_and_old_workflows_in_the_real_front_end).
//
//   node layout.mjs '<json config>'
//     config: {url, chromium, out, types: [node ids], workflows: {label: <UI workflow>}, timeout_ms}
//
// For each node type: a node created as the "Add node" menu creates it (LiteGraph.createNode + graph.add), drawn
// once at scale 1, then its size, its widgets (name, type, y, height, hidden) and where each input and output slot is
// drawn (relative to the node). For each workflow: app.loadGraphData, then each node's input slots and widgets and
// the API prompt the page builds (graphToPrompt). Prints ONE JSON line; the pytest side decides what passes.
import { chromium } from "playwright-core";
import fs from "node:fs";
import path from "node:path";

const cfg = JSON.parse(process.argv[2]);
const timeout = cfg.timeout_ms ?? 120000;
const result = { console: [], pageErrors: [] };
const browser = await chromium.launch({
  executablePath: cfg.chromium ?? "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-dev-shm-usage"],
});
try {
  const page = await browser.newPage({ viewport: { width: 1800, height: 1000 } });
  page.on("console", (m) => result.console.push({ type: m.type(), text: m.text(), url: m.location()?.url ?? "" }));
  page.on("pageerror", (e) => result.pageErrors.push(String(e?.stack ?? e)));
  await fetch(`${cfg.url}/api/settings/Comfy.TutorialCompleted`, { method: "POST", body: "true" }).catch(() => {});
  await page.goto(cfg.url, { waitUntil: "domcontentloaded", timeout });
  await page.waitForFunction((types) => {
    const app = window.comfyAPI?.app?.app;
    return !!(app?.canvas && types.every((t) => window.LiteGraph?.registered_node_types?.[t])
              && (app.extensions ?? []).some((e) => e.name === "streamcache.core") && app.graph?._nodes);
  }, cfg.types, { timeout, polling: 100 });
  await page.waitForTimeout(500);
  await page.keyboard.press("Escape");

  result.fresh = await page.evaluate(async (types) => {
    const app = window.comfyAPI.app.app;
    app.graph.clear();
    app.canvas.ds.scale = 1;
    app.canvas.ds.offset = [10, 10];
    const nodes = [];
    let x = 20;
    for (const type of types) {
      const node = window.LiteGraph.createNode(type);
      node.pos = [x, 40];
      app.graph.add(node);
      nodes.push(node);
      x += node.size[0] + 40;
    }
    app.canvas.setDirty(true, true);
    app.canvas.draw(true, true);
    await new Promise((r) => setTimeout(r, 300));
    app.canvas.draw(true, true);
    const rel = (node, p) => (p ? [p[0] - node.pos[0], p[1] - node.pos[1]] : null);
    return nodes.map((node) => ({
      type: node.type, size: [...node.size],
      widgets: (node.widgets ?? []).map((w) => ({
        name: w.name, type: w.type, y: w.y ?? w.last_y ?? null, h: w.computedHeight ?? w.computeSize?.(node.size[0])?.[1] ?? null,
        width: w.width ?? null, hidden: !!w.hidden, serialize: w.serialize !== false })),
      inputs: (node.inputs ?? []).map((slot, i) => ({ name: slot.name, widget: slot.widget?.name ?? null,
                                                     type: slot.type, pos: rel(node, node.getConnectionPos(true, i)) })),
      outputs: (node.outputs ?? []).map((slot, i) => ({ name: slot.name, type: slot.type,
                                                       pos: rel(node, node.getConnectionPos(false, i)) })),
    }));
  }, cfg.types);
  await page.screenshot({ path: path.join(cfg.out, "frontend-every-node.png") });

  result.loaded = {};
  for (const [label, workflow] of Object.entries(cfg.workflows ?? {})) {
    result.loaded[label] = await page.evaluate(async (wf) => {
      const app = window.comfyAPI.app.app;
      await app.loadGraphData(structuredClone(wf));
      return {
        prompt: (await app.graphToPrompt()).output,
        nodes: app.graph._nodes.map((n) => ({
          id: n.id, type: n.type,
          inputs: (n.inputs ?? []).map((s) => ({ name: s.name, widget: s.widget?.name ?? null, link: s.link ?? null })),
          widgets: (n.widgets ?? []).filter((w) => w.serialize !== false).map((w) => w.name) })),
      };
    }, workflow);
  }
} catch (err) {
  result.error = String(err?.stack ?? err);
} finally {
  await browser.close();
}
fs.writeFileSync(path.join(cfg.out, "frontend-layout-result.json"), JSON.stringify(result, null, 1));
process.stdout.write(JSON.stringify(result) + "\n");
