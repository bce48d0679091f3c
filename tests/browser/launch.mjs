// The one way the browser scripts start Chromium: headless, a fresh profile in a temporary directory, the
// screenshot directory made. `close()` ends the browser and removes the profile. `viewerPage` is the page every
// script drives, its console errors collected into `report.console_errors`.
import { chromium } from 'playwright-core';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

export async function launch(shots) {
  fs.mkdirSync(shots, { recursive: true });
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'llmtap-chromium-'));
  const browser = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    viewport: { width: 1400, height: 1000 },
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
      '--disable-component-update', '--disable-sync'],
  });
  const close = async () => {
    await browser.close();
    fs.rmSync(profile, { recursive: true, force: true });
  };
  return { browser, close };
}

// The browser's page, with every console error and uncaught exception pushed to `report.console_errors`, and
// `ready()`: waits until the viewer has rendered its current route (`main[data-ready]`).
export async function viewerPage(browser, report) {
  const page = browser.pages()[0] || (await browser.newPage());
  page.on('console', (m) => { if (m.type() === 'error') report.console_errors.push(m.text()); });
  page.on('pageerror', (e) => report.console_errors.push(String(e)));
  const ready = () => page.waitForSelector('main[data-ready]', { timeout: 20000 });
  return { page, ready };
}
