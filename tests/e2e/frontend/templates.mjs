// Loads the pack's templates in the real ComfyUI front end, with its classic canvas renderer and with Vue nodes,
// for tests/e2e/test_frontend.py (test_templates_lay_out_without_overlaps_in_both_renderers).
//
//   node templates.mjs '<json config>'
//     config: {url, chromium, out, workflows: {label: <UI workflow>}, timeout_ms}
//
// For each renderer (the server-side setting Comfy.VueNodes.Enabled, set before the page loads and put back after)
// and each workflow: app.loadGraphData, a moment to lay it out, then each node's box in canvas units as drawn —
// the classic renderer's node.getBounding() (title bar included), or the Vue node's element, mapped from the screen
// through the canvas's scale and offset — and each group's bounding box. A screenshot of each, fitted to the view,
// goes to `out`. Prints ONE JSON line; the pytest side decides what passes.
import { chromium } from "playwright-core";
import fs from "node:fs";
import path from "node:path";

const cfg = JSON.parse(process.argv[2]);
const timeout = cfg.timeout_ms ?? 120000;
const SETTING = "Comfy.VueNodes.Enabled";
const result = { console: [], pageErrors: [], layouts: {} };

async function setting(value) {
  const res = await fetch(`${cfg.url}/api/settings/${SETTING}`, { method: "POST", body: JSON.stringify(value) });
  if (!res.ok) throw new Error(`POST /api/settings/${SETTING}: HTTP ${res.status}`);
}

async function layouts(browser, vue) {
  const page = await browser.newPage({ viewport: { width: 1800, height: 1100 } });
  page.on("console", (m) => result.console.push({ type: m.type(), text: m.text(), url: m.location()?.url ?? "" }));
  page.on("pageerror", (e) => result.pageErrors.push(String(e?.stack ?? e)));
  await page.goto(cfg.url, { waitUntil: "domcontentloaded", timeout });
  await page.waitForFunction(() => {
    const app = window.comfyAPI?.app?.app;
    return !!(app?.canvas && app.graph && (app.extensions ?? []).some((e) => e.name === "streamcache.core"));
  }, null, { timeout, polling: 100 });
  await page.waitForTimeout(500);
  await page.keyboard.press("Escape");
  const mode = vue ? "vue" : "classic";
  for (const [label, workflow] of Object.entries(cfg.workflows)) {
    await page.evaluate(async (wf) => { await window.comfyAPI.app.app.loadGraphData(structuredClone(wf)); }, workflow);
    await page.waitForTimeout(1500); // Vue nodes measure themselves after they mount
    result.layouts[`${label} | ${mode}`] = await page.evaluate(() => {
      const app = window.comfyAPI.app.app;
      const ds = app.canvas.ds;
      const rect = app.canvas.canvas.getBoundingClientRect();
      const toCanvas = (x, y) => [(x - rect.left) / ds.scale - ds.offset[0], (y - rect.top) / ds.scale - ds.offset[1]];
      const elements = {};
      for (const el of document.querySelectorAll("[data-node-id]")) {
        const r = el.getBoundingClientRect();
        elements[el.getAttribute("data-node-id")] = [...toCanvas(r.left, r.top), ...toCanvas(r.right, r.bottom)];
      }
      const settings = app.extensionManager?.setting;
      const vueOn = !!(settings?.get ? settings.get("Comfy.VueNodes.Enabled")
                                     : app.ui?.settings?.getSettingValue?.("Comfy.VueNodes.Enabled"));
      return {
        vue: vueOn,
        nodes: app.graph._nodes.map((n) => {
          const b = n.getBounding();
          return { id: n.id, type: n.type, title: n.title ?? n.type,
                   box: vueOn ? (elements[String(n.id)] ?? null) : [b[0], b[1], b[0] + b[2], b[1] + b[3]] };
        }),
        groups: (app.graph._groups ?? []).map((g) => {
          const b = g._bounding ?? g.bounding;
          return { title: g.title, box: [b[0], b[1], b[0] + b[2], b[1] + b[3]] };
        }),
      };
    });
    await page.evaluate((laid) => { // fit the whole template into the view
      const canvas = window.comfyAPI.app.app.canvas;
      const boxes = [...laid.nodes, ...laid.groups].map((x) => x.box).filter(Boolean);
      const [x0, y0] = [Math.min(...boxes.map((b) => b[0])), Math.min(...boxes.map((b) => b[1]))];
      const [x1, y1] = [Math.max(...boxes.map((b) => b[2])), Math.max(...boxes.map((b) => b[3]))];
      const rect = canvas.canvas.getBoundingClientRect();
      const scale = 0.95 * Math.min(rect.width / (x1 - x0), rect.height / (y1 - y0));
      canvas.ds.scale = scale;
      canvas.ds.offset = [rect.width / scale / 2 - (x0 + x1) / 2, rect.height / scale / 2 - (y0 + y1) / 2];
      canvas.setDirty(true, true);
    }, result.layouts[`${label} | ${mode}`]);
    await page.waitForTimeout(800);
    const name = `template-${label.replace(/[^A-Za-z0-9]+/g, "-")}-${mode}.png`;
    await page.screenshot({ path: path.join(cfg.out, name) });
  }
  await page.close();
}

const browser = await chromium.launch({
  executablePath: cfg.chromium ?? "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-dev-shm-usage"],
});
let before = null;
try {
  await fetch(`${cfg.url}/api/settings/Comfy.TutorialCompleted`, { method: "POST", body: "true" }).catch(() => {});
  const res = await fetch(`${cfg.url}/api/settings/${SETTING}`);
  before = res.ok ? await res.json() : null;
  for (const vue of [false, true]) {
    await setting(vue);
    await layouts(browser, vue);
  }
} catch (err) {
  result.error = String(err?.stack ?? err);
} finally {
  await setting(before).catch(() => {});
  await browser.close();
}
fs.writeFileSync(path.join(cfg.out, "frontend-templates-result.json"), JSON.stringify(result, null, 1));
process.stdout.write(JSON.stringify(result) + "\n");
