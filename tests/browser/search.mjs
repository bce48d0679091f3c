// Drives headless Chromium through the viewer's search and reports what a user sees, as one JSON line on stdout.
// The assertions live in tests/viewer_search.rs; this script only looks, clicks and takes screenshots.
//
// usage: node search.mjs <viewer base URL> <query> <step id to open> <screenshot dir> <hostile query>
// Types <query> into the header's search box, lists the hits, opens the hit of <step id> and reports the step
// the session page shows; then searches <hostile query> (text that looks like markup) and reports its snippet.
import { launch, viewerPage } from './launch.mjs';
import path from 'node:path';

const [base, query, stepId, shots, hostile] = process.argv.slice(2);
const { browser, close } = await launch(shots);
const report = { console_errors: [], dialogs: [] };
try {
  const { page, ready } = await viewerPage(browser, report);
  page.on('dialog', async (d) => { report.dialogs.push(d.message()); await d.dismiss(); });

  await page.goto(base + '#/');
  await ready();
  // The header's search box, as a person uses it: type, Enter.
  await page.fill('#search-q', query);
  await page.press('#search-q', 'Enter');
  await page.waitForFunction(() => location.hash.startsWith('#/search') && document.querySelector('main[data-ready]'), null, { timeout: 20000 });
  const hits = () => page.$$eval('#search-hits li.hit', (items) => items.map((li) => ({
    step: li.dataset.step,
    link: li.querySelector('a.hit-link').getAttribute('href'),
    meta: li.querySelector('.muted')?.textContent ?? '',
    marks: [...li.querySelectorAll('.snippet mark')].map((m) => m.textContent),
    snippet: li.querySelector('.snippet').textContent,
    elements: [...li.querySelectorAll('.snippet *')].map((e) => e.tagName.toLowerCase()),
  })));
  report.hash = await page.evaluate(() => location.hash);
  report.status = await page.$eval('#search-status', (e) => e.textContent);
  report.hits = await hits();
  await page.screenshot({ path: path.join(shots, 'search.png'), fullPage: true });

  // Open the hit: the session page with its trajectory selected and the step shown, marked.
  await page.click('#search-hits li.hit[data-step="' + stepId + '"] a.hit-link');
  await page.waitForFunction(() => location.hash.startsWith('#/s/') && document.querySelector('main[data-ready]'), null, { timeout: 20000 });
  await page.waitForSelector('#found-step', { timeout: 20000 });
  report.opened = await page.evaluate(() => {
    const card = document.getElementById('found-step');
    const r = card.getBoundingClientRect();
    return {
      hash: location.hash,
      selected: document.querySelector('#tree .node.sel')?.dataset.id ?? null,
      index: card.dataset.index,
      found_cards: document.querySelectorAll('#steps .step.found').length,
      results: [...card.querySelectorAll('.tool .result')].map((e) => e.textContent),
      in_view: r.top < window.innerHeight && r.bottom > 0,
    };
  });
  await page.screenshot({ path: path.join(shots, 'search-opened.png') });

  // Captured text that looks like markup stays text.
  await page.goto(base + '#/search?q=' + encodeURIComponent(hostile));
  await page.waitForFunction((q) => location.hash.includes(encodeURIComponent(q)) && document.querySelector('main[data-ready] #search-status'),
    hostile, { timeout: 20000 });
  report.hostile = await hits();
  await page.screenshot({ path: path.join(shots, 'search-hostile.png'), fullPage: true });
} catch (e) {
  report.error = String(e);
} finally {
  await close();
}
console.log('REPORT ' + JSON.stringify(report));
