// Drives headless Chromium through the llmtap viewer and reports what a user sees, as one JSON line on stdout.
// The assertions live in tests/viewer.rs; this script only looks and takes screenshots.
//
// usage: node viewer.mjs <viewer base URL> <session id> <call id> <screenshot dir> <native session id>
//        <a trajectory id of that session> <a call whose diff to look at> <trajectory A> <trajectory B>
// Protocol: prints "READY-FOR-CALL" once the sessions list is open, then waits (up to 30 s) for a new session
// row to appear without a reload (the test makes a call meanwhile); then prints "READY-FOR-SESSION-CALL" and
// waits for the native session's row to count one more call (the test makes a call in that session), then
// prints the report line.
import { launch, viewerPage } from './launch.mjs';
import path from 'node:path';

const [base, sessionId, callId, shots, nativeSession, nativeTrajectory, diffCall, compareA, compareB] = process.argv.slice(2);
const { browser, close } = await launch(shots);
const report = { console_errors: [], csp: null };
try {
  // "Copy as JSON" writes the clipboard; the script reads it back.
  await browser.grantPermissions(['clipboard-read', 'clipboard-write'], { origin: new URL(base).origin });
  const { page, ready } = await viewerPage(browser, report);
  const clipboard = () => page.evaluate(() => navigator.clipboard.readText());

  const first = await page.goto(base + '#/');
  report.csp = first.headers()['content-security-policy'] || null;
  await ready();
  report.sessions = await page.$$eval('#sessions tr', (rows) => rows.map((r) => ({
    id: r.dataset.id, cells: [...r.children].map((c) => c.textContent),
    title: r.querySelector('td.session .title')?.textContent ?? null })));
  await page.screenshot({ path: path.join(shots, 'sessions.png'), fullPage: true });

  await page.goto(base + '#/s/' + encodeURIComponent(sessionId));
  await ready();
  report.session = await page.evaluate(() => ({
    tree_nodes: document.querySelectorAll('#tree .node').length,
    steps: document.querySelectorAll('#steps .step').length,
    agent_steps: document.querySelectorAll('#steps .step.agent').length,
    tool_calls: document.querySelectorAll('#steps .tool').length,
    tool_results: document.querySelectorAll('#steps .tool .result').length,
    timeline_bars: document.querySelectorAll('#timeline .bar.llm').length,
    tool_bars: document.querySelectorAll('#timeline .bar.tool').length,
  }));
  await page.screenshot({ path: path.join(shots, 'session.png'), fullPage: true });

  // A session with a native id: its side calls, titles, warmups and quota probes dimmed under the run.
  await page.goto(base + '#/s/' + encodeURIComponent(nativeSession));
  await ready();
  const treeView = () => page.evaluate(() => ({
    hash: location.hash,
    tree_nodes: document.querySelectorAll('#tree .node').length,
    selected: document.querySelector('#tree .node.sel')?.dataset.id ?? null,
  }));
  report.claude = {
    ...(await treeView()),
    ...(await page.evaluate(() => ({
      dim_nodes: document.querySelectorAll('#tree .node.dim').length,
      dim_purposes: [...document.querySelectorAll('#tree .node.dim')].map((n) => n.dataset.purpose ?? null),
      lanes: document.querySelectorAll('#timeline .lane').length,
      dim_lanes: document.querySelectorAll('#timeline .lane.dim').length,
      steps: document.querySelectorAll('#steps .step').length,
    }))),
  };
  report.claude.title = await page.$eval('#session-title', (e) => e.firstChild.textContent.trim());
  report.claude.tree_titles = await page.$$eval('#tree .node', (nodes) => nodes.map((n) => ({
    purpose: n.dataset.purpose ?? null, title: n.querySelector('.ttl')?.textContent ?? null })));
  // The injected context of the first user step: folded under its summary line, opened by a click.
  const injected = page.locator('#steps details.injected').first();
  report.claude.injected = {
    count: await page.locator('#steps details.injected').count(),
    open_before: await injected.evaluate((d) => d.open),
    visible_before: await injected.locator('pre').isVisible(),
    summary: await injected.locator('summary').textContent(),
    user_text: await page.locator('#steps .step.user .user-text').first().textContent(),
  };
  await page.screenshot({ path: path.join(shots, 'session-native.png'), fullPage: true });
  await injected.locator('summary').click();
  report.claude.injected.open_after = await injected.evaluate((d) => d.open);
  report.claude.injected.visible_after = await injected.locator('pre').isVisible();
  report.claude.injected.text = await injected.locator('pre').textContent();
  await page.locator('#steps .step').first().screenshot({ path: path.join(shots, 'step-context-open.png') });
  // A long tool output (none of the recordings has one): the page's own renderer, cut, then shown whole.
  report.claude.show_all = await page.evaluate(() => {
    const text = Array.from({ length: 100 }, (_, i) => 'line ' + i).join('\n');
    const box = longText(text);
    document.getElementById('steps').append(box);
    const before = box.querySelector('pre').textContent.split('\n').length;
    const label = box.querySelector('button.show-all').textContent;
    box.querySelector('button.show-all').click();
    const after = box.querySelector('pre').textContent;
    box.remove();
    return { before, label, whole: after === text, button_left: !!box.querySelector('button.show-all') };
  });
  // Copy as JSON: a step, and the session (with the session's JSON as the API serves it now, before the
  // test makes more calls in this session).
  await page.locator('#steps .step').first().locator('button.copy-json').click();
  await page.waitForFunction(() => document.querySelector('#steps .step button.copy-json').textContent === 'Copied');
  report.copied_step = await clipboard();
  await page.click('button.copy-json[data-what="session"]');
  await page.waitForFunction(() => document.querySelector('button.copy-json[data-what="session"]').textContent === 'Copied');
  report.copied_session = await clipboard();
  report.api_session = await page.evaluate(async (id) => (await fetch('api/sessions/' + encodeURIComponent(id))).text(),
    nativeSession);
  // A link naming one of its trajectories (as written before sessions were grouped) opens the session.
  await page.goto(base + '#/s/' + encodeURIComponent(nativeTrajectory));
  await ready();
  report.claude.old_link = await treeView();

  await page.goto(base + '#/c/' + encodeURIComponent(callId));
  await ready();
  report.call = await page.evaluate(() => ({
    cost: document.getElementById('call-cost').textContent,
    text: document.getElementById('main').innerText,
  }));
  await page.screenshot({ path: path.join(shots, 'call.png'), fullPage: true });
  await page.click('button.copy-json[data-what="call"]');
  await page.waitForFunction(() => document.querySelector('button.copy-json[data-what="call"]').textContent === 'Copied');
  report.copied_call = await clipboard();

  // What a later call added to its conversation.
  await page.goto(base + '#/c/' + encodeURIComponent(diffCall));
  await ready();
  report.diff = await page.evaluate(() => ({
    against: document.getElementById('diff').dataset.against,
    added: [...document.querySelectorAll('#diff .diff-added')].map((e) => ({
      head: e.querySelector('b')?.textContent ?? null, text: e.querySelector('pre')?.textContent ?? null })),
    removed: document.querySelectorAll('#diff .diff-removed').length,
    same: [...document.querySelectorAll('#diff .diff-same')].map((e) => e.textContent),
  }));
  await page.locator('#diff').screenshot({ path: path.join(shots, 'call-diff.png') });

  // Two runs of the same task side by side.
  await page.goto(base + '#/cmp/' + encodeURIComponent(compareA) + '/' + encodeURIComponent(compareB));
  await ready();
  report.compare = await page.evaluate(() => ({
    rows: [...document.querySelectorAll('#compare tbody tr')].map((r) => ({
      kind: r.className, steps: [...r.children].map((c) => c.querySelector('.step')?.dataset.index ?? null) })),
  }));
  await page.screenshot({ path: path.join(shots, 'compare.png'), fullPage: true });

  await page.goto(base + '#/');
  await ready();
  const before = await page.$$eval('#sessions tr', (rows) => rows.map((r) => r.dataset.id));
  // Survives only if the page is not reloaded.
  await page.evaluate(() => { window.__llmtapMarker = 'same page'; });
  // Live updates arrive over an EventSource: wait until it is connected before asking for the call.
  await page.waitForSelector('#live.on', { timeout: 10000 });
  console.log('READY-FOR-CALL');
  await page.waitForFunction((n) => document.querySelectorAll('#sessions tr').length > n, before.length,
    { timeout: 30000 });
  report.live = {
    before: before.length,
    after: await page.$$eval('#sessions tr', (rows) => rows.map((r) => r.dataset.id)),
    marker: await page.evaluate(() => window.__llmtapMarker || null),
  };
  await page.screenshot({ path: path.join(shots, 'sessions-live.png'), fullPage: true });

  // A call in an existing session updates its row; no second row appears.
  const nativeRow = () => page.$$eval('#sessions tr', (rows, id) => rows.filter((r) => r.dataset.id === id)
    .map((r) => r.querySelector('td.calls').textContent), nativeSession);
  const callsBefore = await nativeRow();
  console.log('READY-FOR-SESSION-CALL');
  await page.waitForFunction(([id, before]) => {
    const rows = [...document.querySelectorAll('#sessions tr')].filter((r) => r.dataset.id === id);
    return rows.length === 1 && rows[0].querySelector('td.calls').textContent !== before;
  }, [nativeSession, callsBefore[0]], { timeout: 30000 });
  report.live_session = {
    before: callsBefore,
    after: await nativeRow(),
    rows: await page.$$eval('#sessions tr', (rows) => rows.length),
    marker: await page.evaluate(() => window.__llmtapMarker || null),
  };
} catch (e) {
  report.error = String(e);
} finally {
  await close();
}
console.log('REPORT ' + JSON.stringify(report));
