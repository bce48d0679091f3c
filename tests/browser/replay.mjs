// Drives headless Chromium through the viewer's Replay and reports what a user sees, as one JSON line on stdout.
// The assertions live in tests/viewer_replay.rs; this script only acts, looks and takes screenshots.
//
// usage: node replay.mjs <viewer base URL> <call id> <new model> <key> <screenshot dir>
// On the call's page: opens "Replay this call, edited", types the model and the key, replays, waits for the
// link to the new call, follows it, and comes back to the original.
import { launch, viewerPage } from './launch.mjs';
import path from 'node:path';

const [base, callId, newModel, key, shots] = process.argv.slice(2);
const { browser, close } = await launch(shots);
const report = { console_errors: [] };
try {
  const { page, ready } = await viewerPage(browser, report);

  await page.goto(base + '#/c/' + encodeURIComponent(callId));
  await ready();
  report.before = {
    replays: await page.$$eval('#replays a', (links) => links.map((a) => a.dataset.id)),
    model: await page.inputValue('#replay-model'),
    key_type: await page.getAttribute('#replay-key', 'type'),
  };
  await page.click('#replay-form summary');
  await page.fill('#replay-model', newModel);
  await page.fill('#replay-key', key);
  await page.screenshot({ path: path.join(shots, 'replay-form.png'), fullPage: true });
  await page.click('#replay-send');
  await page.waitForSelector('#replay-new', { timeout: 30000 });
  report.after = {
    new_id: await page.getAttribute('#replay-new', 'data-id'),
    result: await page.textContent('#replay-result'),
    // The key field is emptied once the replay is sent.
    key_left: await page.inputValue('#replay-key'),
    replays: await page.$$eval('#replays a', (links) => links.map((a) => a.dataset.id)),
  };
  await page.screenshot({ path: path.join(shots, 'replay-sent.png'), fullPage: true });

  // The new call's page names its original.
  await page.click('#replay-new');
  await page.waitForFunction((id) => location.hash === '#/c/' + encodeURIComponent(id), report.after.new_id);
  await ready();
  report.replayed = {
    hash: await page.evaluate(() => location.hash),
    replay_of: await page.textContent('#replay-of'),
    replay_of_href: await page.getAttribute('#replay-of a', 'href'),
    text: await page.evaluate(() => document.getElementById('main').innerText),
  };
  await page.screenshot({ path: path.join(shots, 'replay-new-call.png'), fullPage: true });

  // Back on the original (a fresh load): its replays listed.
  await page.click('#replay-of a');
  await ready();
  await page.reload();
  await ready();
  report.original = {
    hash: await page.evaluate(() => location.hash),
    replays: await page.$$eval('#replays a', (links) => links.map((a) => a.dataset.id)),
  };
  // Nothing the page keeps holds the key.
  report.storage = await page.evaluate(() => JSON.stringify({ ...localStorage }) + JSON.stringify({ ...sessionStorage })
    + document.cookie + document.documentElement.outerHTML);
  await page.screenshot({ path: path.join(shots, 'replay-original.png'), fullPage: true });
} catch (e) {
  report.error = String(e);
} finally {
  await close();
}
console.log('REPORT ' + JSON.stringify(report));
