// One phase of the dashboard test, in Debian's headless Chromium driven by playwright-core.
// Usage: node dashboard.mjs PHASE  with PGHERD_API (base URL), PGHERD_TOKEN, SCREENSHOTS (dir)
// and EXPECT (JSON: {"pg1": "primary", ...} roles, for the healthy phase).
// Phases: healthy (every node with its role, no console error, the result cache serving
// with hits, screenshot),
// degraded (node $STOPPED shown down within a few seconds, screenshot),
// switchover (started from the page with the token and a confirmation, pg $TARGET becomes
// the primary on the page),
// sets (set $SET's row for subscriber $SUBSCRIBER streaming, with a lag, screenshot).
import { chromium } from "playwright-core";

const phase = process.argv[2];
const base = process.env.PGHERD_API;
const shots = process.env.SCREENSHOTS;

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const problems = [];
try {
  const page = await browser.newPage({ viewport: { width: 1366, height: 900 } });
  page.on("console", (m) => { if (m.type() === "error") problems.push("console: " + m.text()); });
  page.on("pageerror", (e) => problems.push("page error: " + e.message));
  page.on("requestfailed", (r) => problems.push("request failed: " + r.url()));
  await page.goto(base + "/", { waitUntil: "load" });
  // The first poll has drawn the topology.
  await page.waitForSelector("#topology g.node", { timeout: 10000 });

  if (phase === "healthy") {
    const expect = JSON.parse(process.env.EXPECT);
    for (const [node, role] of Object.entries(expect)) {
      const g = page.locator(`#topology g.node[data-node="${node}"]`);
      await g.waitFor({ timeout: 5000 });
      const got = await g.getAttribute("data-role");
      if (got !== role) problems.push(`${node}: role ${got} on the page, expected ${role}`);
      const state = await g.getAttribute("data-state");
      if (state !== "up") problems.push(`${node}: state ${state}, expected up`);
    }
    const count = await page.locator("#topology g.node").count();
    if (count !== Object.keys(expect).length) problems.push(`${count} nodes drawn`);
    // Each replica's stream is drawn from the node it streams from (here the primary).
    const primary = Object.keys(expect).find((n) => expect[n] === "primary");
    for (const [node, role] of Object.entries(expect)) {
      if (role !== "replica") continue;
      const from = await page.locator(`#topology line[data-to="${node}"]`).getAttribute("data-from", { timeout: 5000 });
      if (from !== primary) problems.push(`${node}'s stream drawn from ${from}, expected ${primary}`);
    }
    const writes = await page.textContent("#writes");
    if (!writes.includes(Object.keys(expect).find((n) => expect[n] === "primary"))) {
      problems.push("header does not name the primary: " + writes);
    }
    // Let a few polls run (charts fill) before the picture.
    await page.waitForTimeout(3000);
    await page.screenshot({ path: `${shots}/dashboard-healthy.png`, fullPage: true });
    // Transaction latency percentiles per pool are shown.
    const header = await page.textContent("#pools thead");
    if (!header.includes("p99")) problems.push("no latency percentiles in the pools table");
    const latency = await page.locator("#pools tbody tr td:last-child").allTextContents();
    if (!latency.some((t) => /\d/.test(t))) problems.push("no latency figures: " + latency.join(", "));
    // The result cache the traffic asks for: serving, with hits and a hit ratio.
    const cached = page.locator('#cache tr[data-database="app"]');
    await cached.waitFor({ timeout: 10000 });
    await page.waitForFunction(() => {
      const row = document.querySelector('#cache tr[data-database="app"]');
      return row && Number(row.querySelector("td.hits").textContent) > 0;
    }, null, { timeout: 10000 });
    const cells = await cached.locator("td").allTextContents();
    if (cells[1] !== "serving") problems.push("result cache: " + cells.join(" | "));
    if (!/^\d+\.\d %$/.test(cells[5])) problems.push("no hit ratio: " + cells.join(" | "));
    // The charts keep their history across a reload.
    const before = await page.evaluate(() => history.tps.length);
    await page.reload({ waitUntil: "load" });
    await page.waitForSelector("#topology g.node", { timeout: 10000 });
    const after = await page.evaluate(() => history.tps.length);
    if (before < 2 || after < before) {
      problems.push(`chart history: ${before} points before the reload, ${after} after`);
    }
  } else if (phase === "degraded") {
    const node = process.env.STOPPED;
    const started = Date.now();
    await page.waitForSelector(`#topology g.node[data-node="${node}"][data-state="down"]`, { timeout: 15000 });
    await page.waitForSelector(`#nodes tr[data-node="${node}"] td.state-down`, { timeout: 5000 });
    console.log(`page showed ${node} down ${Date.now() - started} ms after loading`);
    await page.waitForTimeout(1500);
    await page.screenshot({ path: `${shots}/dashboard-degraded.png`, fullPage: true });
  } else if (phase === "switchover") {
    const target = process.env.TARGET;
    await page.fill("#token", process.env.PGHERD_TOKEN);
    await page.dispatchEvent("#token", "change");
    await page.click(`button[data-action="switchover"][data-node="${target}"]`);
    await page.waitForSelector("#confirm", { state: "visible" });
    const question = await page.textContent("#confirm-text");
    if (!question.includes(target)) problems.push("the confirmation does not name the target: " + question);
    await page.click("#confirm-ok");
    await page.waitForSelector(`#topology g.node[data-node="${target}"][data-role="primary"]`, { timeout: 90000 });
    await page.waitForFunction(() => document.querySelector("#message").textContent.includes("done"), null, { timeout: 90000 });
    const message = await page.textContent("#message");
    console.log("page says: " + message);
    await page.screenshot({ path: `${shots}/dashboard-switched.png`, fullPage: true });
  } else if (phase === "sets") {
    const row = `#sets tr[data-set="${process.env.SET}"][data-subscriber="${process.env.SUBSCRIBER}"]`;
    await page.waitForSelector(row, { timeout: 10000 });
    await page.waitForFunction((sel) => {
      const r = document.querySelector(sel);
      return r && r.querySelectorAll("td")[5].textContent === "yes";
    }, row, { timeout: 10000 });
    const cells = await page.locator(row + " td").allTextContents();
    if (!/\d/.test(cells[6])) problems.push("no lag shown: " + cells.join(" | "));
    console.log("sets row: " + cells.join(" | "));
    await page.screenshot({ path: `${shots}/dashboard-sets.png`, fullPage: true });
  } else {
    problems.push("unknown phase " + phase);
  }
} catch (e) {
  problems.push(String(e && e.stack || e));
} finally {
  await browser.close();
}
if (problems.length) {
  console.error(problems.join("\n"));
  process.exit(1);
}
console.log(`${phase}: ok`);
