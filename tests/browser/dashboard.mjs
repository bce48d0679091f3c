// Drives headless Chromium through the viewer's annotations and cost page and reports what a user sees, as one
// JSON line on stdout. The assertions live in tests/viewer_dashboard.rs; this script only acts, looks and takes
// screenshots.
//
// usage: node dashboard.mjs <viewer base URL> <screenshot dir> <session id> <trajectory id> <step id> <label>
//        <note> <score> <costs since YYYY-MM-DD> <costs until YYYY-MM-DD>
import { launch, viewerPage } from './launch.mjs';
import path from 'node:path';

const [base, shots, sessionId, trajectoryId, stepId, label, note, score, since, until] = process.argv.slice(2);
const { browser, close } = await launch(shots);
const report = { console_errors: [] };
try {
  const { page, ready } = await viewerPage(browser, report);
  const stepBlock = () => page.locator(`#steps .annotations[data-target="step"][data-id="${stepId}"]`);
  const shown = () => stepBlock().evaluate((box) => [...box.querySelectorAll('.ann')].map((a) => ({
    id: a.dataset.annotation,
    label: a.querySelector('.ann-label')?.textContent ?? null,
    score: a.querySelector('.ann-score')?.textContent ?? null,
    note: a.querySelector('.ann-note')?.textContent ?? null,
    // Markup in a note must stay text: no element inside it.
    note_elements: a.querySelector('.ann-note')?.children.length ?? null,
  })));

  // Annotate a step of the session in the page.
  await page.goto(base + '#/s/' + encodeURIComponent(sessionId) + '?t=' + encodeURIComponent(trajectoryId));
  await ready();
  await stepBlock().locator('button.annotate').click();
  const form = stepBlock().locator('form.ann-form');
  await form.locator('input[name=label]').fill(label);
  await form.locator('input[name=score]').fill(score);
  await form.locator('textarea[name=note]').fill(note);
  await form.locator('button[type=submit]').click();
  await stepBlock().locator('.ann').first().waitFor({ timeout: 10000 });
  report.after_save = await shown();
  await stepBlock().screenshot({ path: path.join(shots, 'annotation-step.png') });

  // Reloaded: it comes back from the store.
  await page.reload();
  await ready();
  await stepBlock().locator('.ann').first().waitFor({ timeout: 10000 });
  report.after_reload = await shown();
  report.tree_labels = await page.$$eval('#tree .ann-label', (l) => l.map((x) => x.textContent));
  await page.screenshot({ path: path.join(shots, 'session-annotated.png'), fullPage: true });

  // The sessions list filtered by the label, from the filter box.
  await page.goto(base + '#/');
  await ready();
  await page.fill('form.filters input[name=label]', label);
  // The list before the filter is marked: the filtered one is a new table.
  await page.evaluate(() => { document.getElementById('sessions').dataset.stale = '1'; });
  await page.click('form.filters button[type=submit]');
  await page.waitForSelector('main[data-ready] #sessions:not([data-stale])', { timeout: 20000 });
  report.filtered = await page.$$eval('#sessions tr', (rows) => rows.map((r) => ({
    id: r.dataset.id, labels: [...r.querySelectorAll('.ann-label')].map((l) => l.textContent) })));
  report.filtered_hash = await page.evaluate(() => location.hash);
  await page.screenshot({ path: path.join(shots, 'sessions-by-label.png'), fullPage: true });

  // The cost page over the whole range of the recording.
  await page.goto(base + '#/costs?since=' + since + '&until=' + until);
  await page.waitForSelector('main[data-ready] #cost-total', { timeout: 20000 });
  report.costs = await page.evaluate(() => ({
    total: document.getElementById('cost-total').textContent,
    calls: document.getElementById('cost-calls').textContent,
    savings: document.getElementById('cost-savings').textContent,
    spend_bars: [...document.querySelectorAll('#chart-spend rect.cbar')].map((r) => ({
      day: r.dataset.day, title: r.querySelector('title').textContent })),
    token_bars: document.querySelectorAll('#chart-tokens rect.cbar').length,
    // Rendered height, in the chart's own units (CSS could override the attribute).
    spend_bar_height: Math.max(0, ...[...document.querySelectorAll('#chart-spend rect.cbar')].map((r) => r.getBBox().height)),
    models: [...document.querySelectorAll('#costs-by-model tbody tr')].map((r) => r.dataset.key),
    agents: [...document.querySelectorAll('#costs-by-agent tbody tr')].map((r) => r.dataset.key),
    top_links: [...document.querySelectorAll('#top-sessions tbody a')].map((a) => a.getAttribute('href')),
  }));
  await page.screenshot({ path: path.join(shots, 'costs.png'), fullPage: true });
  // A top session's link opens its session page.
  await page.click('#top-sessions tbody a');
  await page.waitForSelector('main[data-ready] #tree', { timeout: 20000 });
  report.opened_from_costs = await page.evaluate(() => location.hash);

  // Deleted from the page: gone after a reload too.
  await page.goto(base + '#/s/' + encodeURIComponent(sessionId) + '?t=' + encodeURIComponent(trajectoryId));
  await ready();
  await stepBlock().locator('.ann').first().waitFor({ timeout: 10000 });
  await stepBlock().locator('.ann button.ann-del').first().click();
  await page.waitForFunction((id) => !document.querySelector(`#steps .annotations[data-id="${id}"] .ann`), stepId);
  await page.reload();
  await ready();
  report.after_delete = await shown();
} catch (e) {
  report.error = String(e);
} finally {
  await close();
}
console.log('REPORT ' + JSON.stringify(report));
