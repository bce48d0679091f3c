// llmtap viewer: plain JS, no build step. Pages are rendered from the JSON API with DOM nodes and textContent
// only (captured content is never parsed as HTML). Routes: #/ sessions, #/s/<session>[?t=<trajectory>] session
// (a trajectory id in place of the session id opens its session), #/c/<id> call, #/d/<id>[?against=<id>] what
// changed in a call's request, #/cmp/<a>/<b> two trajectories (or sessions' first runs) side by side,
// #/costs spend over time, #/metrics llmtap's own metrics, #/search?q=<text>&<filters> search over steps (a hit
// opens #/s/<session>?t=<trajectory>&step=<index>, the step shown and marked). Annotations (a note, a label, a
// score) on sessions, trajectories and steps are written with POST/DELETE api/annotations.
'use strict';

const main = document.getElementById('main');
const liveDot = document.getElementById('live');

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'style') el.style.cssText = v;
    else el.setAttribute(k, v === true ? '' : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// replaceChildren neither flattens arrays nor skips nulls.
const render = (...children) => main.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));

async function get(url) {
  const r = await fetch(url, { credentials: 'same-origin' });
  if (!r.ok) throw new Error(url + ': ' + r.status);
  return r.json();
}

const num = (n) => (n === undefined || n === null ? '' : Number(n).toLocaleString('en-US'));
const enc = encodeURIComponent;
function cost(t) {
  // Unknown is never shown as $0: no priced call → "unknown"; some unpriced → "+ unknown".
  if (!t) return 'unknown';
  if (t.cost_usd === null || t.cost_usd === undefined) return t.calls && !t.unpriced_calls ? '$0' : 'unknown';
  const v = '$' + fmtUsd(t.cost_usd);
  return t.unpriced_calls ? v + ' + unknown' : v;
}
function fmtUsd(s) {
  const n = Number(s);
  return n >= 1 ? n.toFixed(2) : n >= 0.01 ? n.toFixed(4) : n.toPrecision(3);
}
function callCost(c) {
  if (!c) return 'unknown';
  if (c.unknown) return 'unknown';
  return '$' + fmtUsd(c.total);
}
function dur(ms) {
  if (ms === null || ms === undefined) return '';
  if (ms < 1000) return Math.round(ms) + ' ms';
  if (ms < 60000) return (ms / 1000).toFixed(1) + ' s';
  return Math.floor(ms / 60000) + ' m ' + Math.round((ms % 60000) / 1000) + ' s';
}
const time = (s) => (s ? new Date(s).toLocaleString() : '');
const json = (v) => JSON.stringify(v, null, 2);
const shortId = (id) => (id.length > 36 ? id.slice(0, 35) + '…' : id);

// Copy text; where the page has no clipboard (plain HTTP beyond loopback is not a secure context), show it
// selected in a box instead.
async function copyText(text, btn) {
  try {
    await navigator.clipboard.writeText(text);
    btn.textContent = 'Copied';
  } catch (e) {
    const box = h('textarea', { class: 'copybox', readonly: true, rows: 8 });
    box.value = text;
    btn.after(box);
    box.select();
    btn.textContent = 'Copy the selected text';
  }
}
// A button copying `value` as the JSON the API returned for it.
const copyJson = (label, what, value) => {
  const b = h('button', { class: 'copy-json', 'data-what': what, onclick: () => copyText(JSON.stringify(value, null, 2), b) }, label);
  return b;
};

// Long text (a tool's output): the first lines, and a button that shows the rest.
const LONG_LINES = 40, LONG_CHARS = 4000;
function longText(text) {
  const lines = text.split('\n');
  if (lines.length <= LONG_LINES && text.length <= LONG_CHARS) return h('pre', {}, text);
  const head = lines.slice(0, LONG_LINES).join('\n').slice(0, LONG_CHARS);
  const pre = h('pre', { class: 'cut' }, head);
  const more = h('button', { class: 'show-all', onclick: () => { pre.textContent = text; pre.classList.remove('cut'); more.remove(); } },
    'show all (' + num(lines.length) + ' lines, ' + num(text.length) + ' chars)');
  return h('div', { class: 'long' }, pre, more);
}

// A text the server split into the person's text and context the client injected (`content_parts`): the
// injected blocks folded under their summary line.
function withContext(parts, textClass) {
  return parts.map((p) => (p.injected
    ? h('details', { class: 'injected', 'data-tag': p.injected }, h('summary', {}, p.summary), h('pre', {}, p.text))
    : h('div', { class: textClass }, p.text.trim())));
}

// --- live events: one EventSource for the page; views register a handler ---
let onLive = null;
let liveTimers = [];
function connectLive() {
  const es = new EventSource('api/events');
  es.onopen = () => liveDot.classList.add('on');
  es.onerror = () => liveDot.classList.remove('on');
  const fire = (e) => {
    const data = JSON.parse(e.data);
    liveTimers.forEach(clearTimeout);
    // Calls come in bursts (a step and its call): one refresh per burst. Events leave the pipeline before the
    // store commits them, so a second refresh picks up what the first was too early for.
    liveTimers = [300, 1500].map((ms) => setTimeout(() => onLive && onLive(data), ms));
  };
  es.addEventListener('call', fire);
  es.addEventListener('step', fire);
}

// --- sessions list ---
async function sessionsPage(params) {
  const filters = ['agent', 'model', 'since', 'until', 'q', 'label'];
  const form = h('form', { class: 'filters', onsubmit: (e) => {
    e.preventDefault();
    const q = new URLSearchParams();
    for (const f of filters) if (form.elements[f].value) q.set(f, form.elements[f].value);
    location.hash = '#/?' + q.toString();
  } },
  h('input', { name: 'agent', placeholder: 'agent', value: params.get('agent') || '' }),
  h('input', { name: 'model', placeholder: 'model', value: params.get('model') || '' }),
  h('input', { name: 'since', placeholder: 'since (RFC 3339)', value: params.get('since') || '' }),
  h('input', { name: 'until', placeholder: 'until (RFC 3339)', value: params.get('until') || '' }),
  h('input', { name: 'q', placeholder: 'search text', value: params.get('q') || '', size: 30 }),
  h('input', { name: 'label', placeholder: 'annotation label', value: params.get('label') || '' }),
  h('button', { type: 'submit' }, 'Filter'));
  const body = h('tbody', { id: 'sessions' });
  const more = h('button', { hidden: true }, 'More');
  const table = h('table', {}, h('thead', {}, h('tr', {},
    h('th', {}, 'Session'), h('th', {}, 'Agent'), h('th', {}, 'Models'), h('th', {}, 'Started'), h('th', { class: 'num' }, 'Duration'),
    h('th', { class: 'num' }, 'Trajectories'),
    h('th', { class: 'num' }, 'Calls'), h('th', { class: 'num' }, 'Input'), h('th', { class: 'num' }, 'Output'),
    h('th', { class: 'num' }, 'Cache read'), h('th', { class: 'num' }, 'Cache write'),
    h('th', { class: 'num' }, 'Cost'), h('th', { class: 'num' }, 'Errors'))), body);
  render(h('h1', {}, 'Sessions'), form, table, more);
  const query = new URLSearchParams();
  for (const f of filters) if (params.get(f)) query.set(f, params.get(f));
  const seen = new Set();
  let first = true;
  const row = (s) => {
    const t = s.totals;
    return h('tr', { class: !first && !seen.has(s.id) ? 'new' : null, 'data-id': s.id },
      h('td', { class: 'session' }, h('a', { href: '#/s/' + enc(s.id), title: s.id, class: s.title ? 'title' : 'id' }, s.title || shortId(s.id)),
        s.title ? h('div', { class: 'muted sid' }, shortId(s.id)) : null, labelChips(s.annotations)),
      h('td', {}, s.agent || ''),
      h('td', {}, s.models.join(', ')), h('td', {}, time(s.started_at)),
      h('td', { class: 'num' }, dur(t.duration_ms)),
      h('td', { class: 'num', title: 'side calls, titles, warmups and quota probes are counted apart' },
        num(s.trajectories - s.side_trajectories), s.side_trajectories ? h('span', { class: 'muted' }, ' + ' + num(s.side_trajectories) + ' side') : null),
      h('td', { class: 'num calls' }, num(t.calls)),
      h('td', { class: 'num' }, num(t.input_tokens)), h('td', { class: 'num' }, num(t.output_tokens)),
      h('td', { class: 'num' }, num(t.cache_read_tokens)), h('td', { class: 'num' }, num(t.cache_write_tokens)),
      h('td', { class: 'num cost' }, cost(t)),
      h('td', { class: 'num' + (t.errors ? ' err' : '') }, num(t.errors)));
  };
  let next = null;
  async function load(reset) {
    const q = new URLSearchParams(query);
    if (!reset && next) q.set('before', next);
    const page = await get('api/sessions?' + q.toString());
    const rows = page.sessions.map(row);
    if (reset) body.replaceChildren(...rows); else body.append(...rows);
    for (const s of page.sessions) seen.add(s.id);
    next = page.next;
    more.hidden = !next;
    first = false;
  }
  more.onclick = () => load(false);
  await load(true);
  main.dataset.ready = '1';
  // Live: refresh the first page (the newest sessions) unless the user paged further.
  onLive = () => { if (body.children.length <= 50) load(true); };
}

// --- session page ---
async function sessionPage(id, params) {
  const s = await get('api/sessions/' + enc(id));
  const byId = new Map(s.trajectories.map((t) => [t.id, t]));
  const focus = s.focus || params.get('t');
  // An old link naming a trajectory: show its session's address, keeping the trajectory selected.
  if (s.id !== id) history.replaceState(null, '', '#/s/' + enc(s.id) + (focus ? '?t=' + enc(focus) : ''));
  let selected = byId.has(focus) ? focus : s.trajectories[0].id;
  const t = s.totals;
  const totals = h('div', { class: 'totals' },
    ...[['Calls', num(t.calls)], ['Duration', dur(t.duration_ms)], ['Input', num(t.input_tokens)],
      ['Output', num(t.output_tokens)], ['Cache read', num(t.cache_read_tokens)],
      ['Cache write', num(t.cache_write_tokens)], ['Cost', cost(t)], ['Errors', num(t.errors)]]
      .map(([k, v]) => h('div', {}, h('span', { class: 'muted' }, k), h('b', {}, v))));
  const exports = h('div', { class: 'exports' }, h('span', { class: 'muted' }, 'Export: '),
    s.exports.map((e) => h('a', { href: e.url, download: '' }, e.format)));
  const stepsBox = h('div', { class: 'steps', id: 'steps' });
  const trajectoryNotes = h('div', { id: 'trajectory-notes' });
  const notesOf = (tid) => s.annotations.filter((a) => a.target === 'trajectory' && a.target_id === tid);
  const treeBox = h('div', { class: 'tree', id: 'tree' });
  const timeline = h('div', { class: 'timeline', id: 'timeline' });
  const compareWith = h('input', { name: 'other', placeholder: 'another trajectory or session id', size: 36 });
  const compareFrom = h('select', { name: 'from' }, s.trajectories.map((tr) =>
    h('option', { value: tr.id }, (tr.run ? '#' + tr.run + ' ' : '') + (tr.agent || 'agent') + ' · ' + (tr.title || tr.id).slice(0, 50))));
  const compare = h('form', { class: 'filters compare', onsubmit: (e) => {
    e.preventDefault();
    if (compareWith.value.trim()) location.hash = '#/cmp/' + enc(compareFrom.value) + '/' + enc(compareWith.value.trim());
  } }, h('span', { class: 'muted' }, 'Compare '), compareFrom, h('span', { class: 'muted' }, ' with '), compareWith,
  h('button', { type: 'submit' }, 'Compare'));
  render(h('h1', { id: 'session-title' }, (s.title || s.agent || 'session') + ' ', h('span', { class: 'muted' }, s.id)),
    s.title && s.agent ? h('p', { class: 'muted' }, s.agent) : null,
    totals, annotationsBlock('session', s.id, s.annotations.filter((a) => a.target === 'session')),
    h('div', { class: 'exports' }, exports, copyJson('Copy session as JSON', 'session', s)), compare,
    h('h2', {}, 'Trajectories'), treeBox, h('h2', {}, 'Timeline'), timeline,
    h('h2', { id: 'steps-title' }, 'Steps'), trajectoryNotes, stepsBox);

  // Tree, as the server arranged it (`under`): runs, their sub-agents under the tool call that started them,
  // continuations under what they continue, then the run's side calls, titles, warmups and quota probes, dimmed.
  const kids = new Map();
  const tops = [];
  for (const tr of s.trajectories) {
    if (tr.under && byId.has(tr.under)) { if (!kids.has(tr.under)) kids.set(tr.under, []); kids.get(tr.under).push(tr); }
    else tops.push(tr);
  }
  function node(tr) {
    const how = tr.continues ? 'continues ' + tr.continues.slice(0, 8)
      : tr.parent_tool_call_id ? 'sub-agent of tool call ' + tr.parent_tool_call_id
        + (tr.parent_step !== undefined && tr.parent_step !== null ? ' (step ' + tr.parent_step + ')' : '')
        : tr.purpose || (tr.side ? 'side' : 'main');
    const label = h('span', { class: 'node' + (tr.id === selected ? ' sel' : '') + (tr.side ? ' dim' : ''),
      'data-id': tr.id, 'data-purpose': tr.purpose, onclick: () => select(tr.id) },
    tr.run ? h('span', { class: 'run' }, '#' + tr.run) : null,
    h('b', {}, tr.agent || 'agent'), ' ', h('span', { class: 'via' }, how),
    tr.title ? h('span', { class: 'ttl', title: tr.title }, tr.title) : null, ' · ',
    num(tr.steps) + ' steps · ' + num(tr.llm_calls) + ' calls · ' + cost(tr.totals), labelChips(notesOf(tr.id)));
    const children = (kids.get(tr.id) || []).map(node);
    return h('li', {}, label, children.length ? h('ul', {}, children) : null);
  }
  treeBox.replaceChildren(h('ul', {}, tops.map(node)));

  // Timeline: one lane per trajectory; bars from the first page of each lane's steps.
  const lanes = await Promise.all(s.trajectories.slice(0, 20).map(async (tr) =>
    ({ tr, steps: (await get('api/trajectories/' + enc(tr.id) + '/steps?limit=200')).steps })));
  drawTimeline(timeline, lanes);

  let next = null;
  async function loadSteps(reset) {
    const q = reset || next === null ? '' : '&after=' + next;
    const page = await get('api/trajectories/' + enc(selected) + '/steps?limit=100' + q);
    const cards = page.steps.map(stepCard);
    if (reset) stepsBox.replaceChildren(...cards); else stepsBox.append(...cards);
    next = page.next;
    if (next !== null) stepsBox.append(h('button', { onclick: (e) => { e.target.remove(); loadSteps(false); } }, 'More steps'));
  }
  async function select(tid) {
    selected = tid;
    for (const n of treeBox.querySelectorAll('.node')) n.classList.toggle('sel', n.dataset.id === tid);
    document.getElementById('steps-title').textContent = 'Steps of ' + (byId.get(tid).agent || tid);
    trajectoryNotes.replaceChildren(annotationsBlock('trajectory', tid, notesOf(tid)));
    await loadSteps(true);
  }
  await select(selected);
  if (params.get('step') !== null) {
    await revealStep(stepsBox, params.get('step'), async () => {
      if (next === null) return false;
      for (const b of stepsBox.querySelectorAll(':scope > button')) b.remove();
      await loadSteps(false);
      return true;
    });
  }
  main.dataset.ready = '1';
  // A call or step whose session is the one on screen (a new side call included) redraws the page.
  onLive = (ev) => {
    // Not while an annotation is being written: the redraw would drop the form.
    if (document.querySelector('.ann-form')) return;
    if (ev.session_id === s.id || byId.has(ev.trajectory_id) || !ev.trajectory_id) route();
  };
}

function drawTimeline(box, lanes) {
  let t0 = Infinity, t1 = -Infinity;
  const ms = (s) => new Date(s).getTime();
  for (const { steps } of lanes) for (const st of steps) {
    if (!st.timings) continue;
    t0 = Math.min(t0, ms(st.timings.started_at));
    let end = ms(st.timings.ended_at);
    for (const tc of st.tool_calls) if (tc.duration_ms) end = Math.max(end, ms(st.timings.ended_at) + tc.duration_ms);
    t1 = Math.max(t1, end);
  }
  if (!(t1 > t0)) { box.replaceChildren(h('div', { class: 'muted', style: 'padding:.3rem' }, 'No timed calls.')); return; }
  const pct = (t) => ((t - t0) / (t1 - t0)) * 100 + '%';
  const w = (d) => (d / (t1 - t0)) * 100 + '%';
  box.replaceChildren(...lanes.map(({ tr, steps }) => {
    const track = h('div', { class: 'track' });
    for (const st of steps) {
      if (!st.timings) continue;
      const s0 = ms(st.timings.started_at), s1 = ms(st.timings.ended_at);
      const bar = h('a', { class: 'bar llm' + (st.status === 'error' ? ' err' : '') + (st.call_type === 'warmup' ? ' dim' : ''),
        style: 'left:' + pct(s0) + ';width:' + w(Math.max(s1 - s0, 1)),
        href: st.provider_trace_id ? '#/c/' + enc(st.provider_trace_id) : null,
        title: (st.model || '') + ' · ' + dur(st.timings.duration_ms) + ' · TTFT ' + dur(st.timings.time_to_first_token_ms) });
      if (st.timings.time_to_first_token_ms) {
        bar.append(h('span', { class: 'ttft', style: 'left:' + (st.timings.time_to_first_token_ms / Math.max(s1 - s0, 1)) * 100 + '%' }));
      }
      track.append(bar);
      for (const tc of st.tool_calls) {
        if (!tc.duration_ms) continue;
        track.append(h('span', { class: 'bar tool', style: 'left:' + pct(s1) + ';width:' + w(tc.duration_ms),
          title: tc.tool_name + ' · ' + dur(tc.duration_ms) }));
      }
    }
    const name = (tr.run ? '#' + tr.run + ' ' : '') + (tr.agent || tr.id.slice(0, 8)) + (tr.side ? ' · ' + (tr.purpose || 'side') : '');
    return h('div', { class: 'lane' + (tr.side ? ' dim' : ''), 'data-id': tr.id }, h('span', { class: 'label', title: name }, name), track);
  }));
}

function stepCard(st) {
  const results = new Map(st.observations.map((o) => [o.source_call_id, o]));
  const user = st.role !== 'agent';
  return h('div', { class: 'step ' + st.role + (st.call_type === 'warmup' ? ' dim' : ''), 'data-index': st.step_index },
    h('div', { class: 'head' }, h('b', {}, '#' + st.step_index + ' ' + st.role), h('span', {}, st.model),
      st.call_type && st.call_type !== 'main' ? h('span', {}, st.call_type) : null,
      st.timings ? h('span', {}, dur(st.timings.duration_ms)) : null,
      st.role === 'agent' ? h('span', {}, num(st.token_usage.input_tokens) + ' in / ' + num(st.token_usage.output_tokens) + ' out') : null,
      st.cost ? h('span', { class: 'cost' }, callCost(st.cost)) : null,
      st.status !== 'ok' ? h('span', { class: 'err' }, st.status + (st.error ? ': ' + st.error : '')) : null,
      st.provider_trace_id ? h('a', { href: '#/c/' + enc(st.provider_trace_id) }, 'call') : null,
      copyJson('copy JSON', 'step', st)),
    st.reasoning_content ? h('details', {}, h('summary', {}, 'reasoning'), h('div', { class: 'text reasoning' }, st.reasoning_content)) : null,
    st.content_parts ? withContext(st.content_parts, 'text user-text')
      : st.content ? h('div', { class: 'text' + (user ? ' user-text' : '') }, st.content) : null,
    st.tool_calls.map((tc) => {
      const r = results.get(tc.tool_call_id);
      return h('div', { class: 'tool' },
        h('div', {}, h('b', {}, tc.tool_name), ' ', h('span', { class: 'muted' }, tc.tool_call_id),
          tc.duration_ms !== undefined ? ' · ' + dur(tc.duration_ms) : ''),
        h('pre', { class: 'args' }, json(tc.input)),
        r ? h('div', { class: 'result' + (r.error ? ' err' : '') }, h('span', { class: 'muted' }, r.error ? 'result (' + r.error + ')' : 'result'),
          r.content_parts ? withContext(r.content_parts, 'text') : longText(r.content ?? r.output_summary ?? '')) : h('div', { class: 'muted' }, 'no result yet'));
    }),
    st.snippets.length ? h('details', {}, h('summary', {}, st.snippets.length + ' snippets'),
      st.snippets.map((sn) => h('div', {}, h('span', { class: 'muted' }, (sn.file_path || '') + (sn.start_line ? ':' + sn.start_line : '')),
        h('pre', {}, sn.text)))) : null,
    st.annotations ? annotationsBlock('step', st.step_id, st.annotations) : null);
}

// A message's text when it is only text blocks; its JSON otherwise (tool calls, results, images).
function msgText(m) {
  const c = m.content ?? m.parts;
  if (typeof c === 'string') return c;
  if (Array.isArray(c) && c.every((b) => typeof b.text === 'string' && Object.keys(b).every((k) => k === 'text' || k === 'type'))) {
    return c.map((b) => b.text).join('\n');
  }
  return json(c ?? m);
}

// --- call page ---
async function callPage(id) {
  const c = await get('api/calls/' + enc(id));
  const u = c.usage || {};
  const r = c.request || {};
  const kv = (pairs) => h('div', { class: 'grid' }, pairs.flatMap(([k, v]) => [h('span', { class: 'muted' }, k), h('span', {}, v)]));
  const copy = h('button', { onclick: async () => {
    try { await navigator.clipboard.writeText(c.curl); copy.textContent = 'Copied'; } catch (e) { copy.textContent = 'Select the text below'; }
  } }, 'Copy as curl');
  const diffBox = h('div', { id: 'diff-box' }, diffView(await get('api/calls/' + enc(id) + '/diff')));
  render(
    h('h1', {}, 'Call ', h('span', { class: 'muted' }, c.id)),
    h('p', {}, c.session ? h('a', { href: '#/s/' + enc(c.session) }, '← session') : null, ' ',
      c.previous_call ? h('a', { href: '#/c/' + enc(c.previous_call) }, 'previous call') : null, ' ',
      copyJson('Copy call as JSON', 'call', c)),
    kv([['Model', c.model || ''], ['API', c.api + ' ' + c.method + ' ' + c.path],
      ['Status', h('span', { class: c.status >= 400 ? 'err' : '' }, (c.status ?? '') + ' ' + c.outcome + (c.error ? ' — ' + c.error : ''))],
      ['Started', time(c.timings.started_at)], ['Duration', dur(c.timings.duration_ms)],
      ['Time to first byte', dur(c.timings.time_to_first_byte_ms)],
      ['Usage', num(u.input) + ' in (cache read ' + num(u.cache_read ?? 0) + ', cache write ' + num(u.cache_write ?? 0) + ') / ' + num(u.output) + ' out' + (u.reasoning ? ' (reasoning ' + num(u.reasoning) + ')' : '')],
      ['Cost', h('span', { id: 'call-cost', title: c.cost && c.cost.unknown ? c.cost.unknown : '' }, callCost(c.cost))],
      ...(c.cost && !c.cost.unknown ? [['Cost split', 'input $' + c.cost.input + ' · cache read $' + c.cost.cache_read + ' · cache write $' + c.cost.cache_write + ' · output $' + c.cost.output + ' · reasoning $' + c.cost.reasoning]] : [])]),
    h('div', { id: 'replay-box', class: 'replay' }),
    h('h2', {}, 'Changes since the previous call'), diffBox,
    r.system ? h('details', {}, h('summary', {}, 'system prompt'), h('pre', {}, typeof r.system === 'string' ? r.system : json(r.system))) : null,
    h('details', { id: 'tools' }, h('summary', {}, (r.tools || []).length + ' tool definitions'), h('pre', {}, json(r.tools))),
    h('details', {}, h('summary', {}, 'parameters'), h('pre', {}, json(r.params))),
    h('h2', {}, 'Raw'),
    h('details', {}, h('summary', {}, 'request'), h('pre', {}, json(c.raw_request))),
    h('details', {}, h('summary', {}, 'response'), h('pre', {}, json(c.raw_response))),
    c.raw_stream ? h('details', {}, h('summary', {}, 'stream as received'), h('pre', {}, c.raw_stream)) : null,
    h('details', {}, h('summary', {}, 'headers'), h('pre', {}, c.request_headers.map((x) => x.join(': ')).join('\n') + '\n\n' + c.response_headers.map((x) => x.join(': ')).join('\n'))),
    h('h2', {}, 'Repeat it'), copy, h('details', {}, h('summary', {}, 'curl'), h('pre', { id: 'curl' }, c.curl)),
    c.exports ? h('div', { class: 'exports' }, h('span', { class: 'muted' }, 'Export the session: '),
      c.exports.map((e) => h('a', { href: e.url, download: '' }, e.format))) : null);
  await replayBox(c.id, document.getElementById('replay-box'));
  main.dataset.ready = '1';
  onLive = null;
}

// --- replay: the call this one replayed, its replays, and (with [viewer] replay on) a form re-sending it,
// edited, through llmtap with a key typed here. The key goes into the one POST and is cleared from the field. ---
async function replayBox(callId, box) {
  const r = await get('api/calls/' + enc(callId) + '/replay');
  const link = (x) => h('a', { href: '#/c/' + enc(x.id), class: 'replay-link', 'data-id': x.id },
    shortId(x.id) + ' (' + [x.model, x.status].filter((v) => v !== null && v !== undefined).join(', ') + ')');
  const list = h('span', { id: 'replays' }, r.replays.map(link));
  const parts = [
    r.replay_of ? h('p', { id: 'replay-of' }, 'Replay of ', h('a', { href: '#/c/' + enc(r.replay_of) }, r.replay_of)) : null,
    h('p', { class: r.replays.length ? '' : 'muted' }, 'Replays: ', r.replays.length ? list : 'none'),
  ];
  if (!r.enabled || r.refusal) {
    parts.push(h('p', { class: 'muted' }, r.refusal ? 'Cannot replay: ' + r.refusal
      : 'Replay is off (set [viewer] replay = true in llmtap\'s config, or run `llmtap replay ' + callId + '`).'));
    box.replaceChildren(...parts.filter(Boolean));
    return;
  }
  const bodyText = r.body === null ? '' : typeof r.body === 'string' ? r.body : json(r.body);
  const model = h('input', { id: 'replay-model', value: r.model || '', size: 40 });
  const key = h('input', { id: 'replay-key', type: 'password', autocomplete: 'off', size: 40,
    placeholder: (r.key_needed ? 'key, sent as ' : 'key if any, sent as ') + r.key_header });
  const body = h('textarea', { id: 'replay-body', rows: 14, spellcheck: 'false' });
  body.value = bodyText;
  const result = h('div', { id: 'replay-result' });
  const send = h('button', { id: 'replay-send', onclick: async () => {
    const posted = {};
    if (model.value !== (r.model || '')) posted.model = model.value;
    if (body.value !== bodyText) {
      try { posted.body = JSON.parse(body.value); } catch (e) { result.replaceChildren(h('span', { class: 'err' }, 'The body is not JSON: ' + e.message)); return; }
    }
    // The key leaves the field as it is sent.
    posted.key = key.value;
    key.value = '';
    send.disabled = true;
    result.replaceChildren(h('span', { class: 'muted' }, 'Sending…'));
    try {
      const resp = await fetch('api/calls/' + enc(callId) + '/replay', { method: 'POST', credentials: 'same-origin',
        headers: { 'content-type': 'application/json' }, body: JSON.stringify(posted) });
      const out = await resp.json();
      if (!resp.ok) result.replaceChildren(h('span', { class: 'err' }, out.error || String(resp.status)));
      else if (!out.id) result.replaceChildren(h('span', {}, 'Sent (status ' + out.status + '); its capture is not stored yet, session ' + out.session));
      else {
        const a = link({ id: out.id, status: out.status });
        a.id = 'replay-new';
        result.replaceChildren('Replayed: ', a);
        if (!r.replays.length) parts[1].replaceChildren('Replays: ', list);
        parts[1].className = '';
        list.append(link({ id: out.id, status: out.status }));
      }
    } catch (e) {
      result.replaceChildren(h('span', { class: 'err' }, String(e)));
    } finally {
      send.disabled = false;
    }
  } }, 'Replay');
  parts.push(h('details', { id: 'replay-form' }, h('summary', {}, 'Replay this call, edited'),
    h('div', { class: 'grid' }, h('span', { class: 'muted' }, 'Model'), model, h('span', { class: 'muted' }, 'Key'), key),
    h('p', { class: 'muted' }, 'The request body (edit it as JSON). The key is sent once with this replay and never stored.'),
    body, h('p', {}, send), result));
  box.replaceChildren(...parts.filter(Boolean));
}

// What changed in a call's request against another (the previous call of its trajectory unless `against`):
// messages added and removed (unchanged runs folded), the system prompt, tools and parameters.
function diffView(d) {
  const x = d.diff;
  const sysText = (v) => (v === null || v === undefined ? '(none)' : typeof v === 'string' ? v : json(v));
  const t = x.tools;
  const toolChanges = [['added', t.added], ['removed', t.removed], ['changed', t.changed]].filter(([, n]) => n.length)
    .map(([k, n]) => h('span', { class: 'diff-tools-' + k }, k + ': ' + n.join(', ')));
  const params = Object.entries(x.params);
  return h('div', { class: 'diff', id: 'diff', 'data-against': d.against || '' },
    h('p', { class: 'muted' }, d.against
      ? ['Against ', h('a', { href: '#/c/' + enc(d.against) }, d.against), ': ']
      : 'The first call of its trajectory: everything is new. ',
    num(x.added) + ' message(s) added, ' + num(x.removed) + ' removed, ' + num(x.same) + ' unchanged.'),
    // The first call has nothing to compare its system prompt, tools and parameters with (shown below it).
    !d.against ? null : x.system.changed
      ? h('details', { class: 'diff-system', open: true }, h('summary', {}, 'system prompt changed'),
        h('div', { class: 'cols' }, h('pre', { class: 'diff-removed' }, sysText(x.system.old)), h('pre', { class: 'diff-added' }, sysText(x.system.new))))
      : h('div', { class: 'muted' }, 'System prompt unchanged.'),
    !d.against ? null : h('div', { class: toolChanges.length ? '' : 'muted' }, 'Tools (' + num(t.count) + '): ', toolChanges.length ? toolChanges : 'unchanged.'),
    d.against && params.length ? h('pre', { class: 'diff-params' }, params.map(([k, v]) => k + ': ' + JSON.stringify(v.old) + ' → ' + JSON.stringify(v.new)).join('\n')) : null,
    x.messages.map((o) => (o.op === 'same'
      ? h('div', { class: 'diff-same muted' }, '… ' + num(o.count) + ' unchanged message(s)')
      : h('div', { class: 'msg diff-' + o.op }, h('b', {}, (o.op === 'added' ? '+ ' : '− ') + (o.message.role || o.message.type || '')),
        o.content_parts ? withContext(o.content_parts, 'text') : h('pre', {}, msgText(o.message))))));
}

async function diffPage(id, params) {
  const against = params.get('against');
  const d = await get('api/calls/' + enc(id) + '/diff' + (against ? '?against=' + enc(against) : ''));
  render(h('h1', {}, 'Call ', h('a', { href: '#/c/' + enc(d.id) }, d.id), h('span', { class: 'muted' }, ' what changed')), diffView(d));
  main.dataset.ready = '1';
}

// Two trajectories side by side, steps aligned (the same task run twice lines up step for step).
async function comparePage(a, b) {
  const c = await get('api/compare?a=' + enc(a) + '&b=' + enc(b));
  const head = (side) => {
    const tr = side.trajectory;
    return h('th', {}, h('a', { href: '#/s/' + enc(tr.id) }, tr.title || tr.agent || tr.id), h('div', { class: 'muted' },
      tr.id + ' · ' + num(tr.steps) + ' steps · ' + num(tr.llm_calls) + ' calls · ' + cost(tr.totals) + ' · ' + dur(tr.totals.duration_ms)));
  };
  const cell = (side, i) => h('td', {}, i === null ? h('div', { class: 'muted' }, '—') : stepCard(side.steps[i]));
  render(h('h1', {}, 'Compare'), h('table', { class: 'compare', id: 'compare' },
    h('thead', {}, h('tr', {}, head(c.a), head(c.b))),
    h('tbody', {}, c.rows.map((r) => h('tr', { class: r.a === null ? 'only-b' : r.b === null ? 'only-a' : 'both' }, cell(c.a, r.a), cell(c.b, r.b))))));
  main.dataset.ready = '1';
}

// llmtap's own metrics, as /metrics has them (one collection of the same instruments).
async function metricsPage() {
  const m = await get('api/metrics');
  const value = (s) => (s.count !== undefined ? num(s.count) + ' (sum ' + Number(s.sum).toPrecision(4) + ')' : num(s.value));
  const labels = (l) => Object.entries(l).map(([k, v]) => k + '=' + v).join(', ');
  render(h('h1', {}, 'llmtap metrics'),
    h('table', { id: 'metrics' }, h('tr', {}, h('th', {}, 'metric'), h('th', {}, 'attributes'), h('th', {}, 'value')),
      m.metrics.flatMap((f) => f.samples.map((s) => h('tr', { 'data-name': f.name },
        h('td', { title: f.help }, f.name), h('td', {}, labels(s.labels)), h('td', {}, value(s)))))));
  main.dataset.ready = '1';
}

// --- annotations: a note, a label and a score on a session, trajectory or step (rendered as text only) ---
function labelChips(list) {
  const labels = [...new Set((list || []).map((a) => a.label).filter((l) => l))];
  return labels.length ? h('span', { class: 'ann-chips' }, labels.map((l) => h('span', { class: 'ann-label' }, l))) : null;
}

function annotationItem(a) {
  const item = h('div', { class: 'ann', 'data-annotation': a.id },
    a.label ? h('span', { class: 'ann-label' }, a.label) : null,
    a.score !== null && a.score !== undefined ? h('span', { class: 'ann-score' }, 'score ' + a.score) : null,
    a.note ? h('span', { class: 'ann-note' }, a.note) : null,
    h('button', { class: 'ann-del', title: 'delete this annotation', onclick: async () => {
      const r = await fetch('api/annotations/' + enc(a.id), { method: 'DELETE', credentials: 'same-origin' });
      if (r.ok) item.remove();
    } }, '×'));
  return item;
}

function annotationForm(target, id, done) {
  const label = h('input', { name: 'label', maxlength: 64, placeholder: 'label', size: 14 });
  const score = h('input', { name: 'score', type: 'number', step: 'any', placeholder: 'score', size: 6 });
  const note = h('textarea', { name: 'note', rows: 2, cols: 50, maxlength: 4000, placeholder: 'note' });
  const msg = h('span', { class: 'err ann-error' });
  const form = h('form', { class: 'ann-form', onsubmit: async (e) => {
    e.preventDefault();
    const body = { target, id };
    if (note.value.trim()) body.note = note.value;
    if (label.value.trim()) body.label = label.value;
    if (score.value !== '') body.score = Number(score.value);
    const r = await fetch('api/annotations', { method: 'POST', credentials: 'same-origin',
      headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
    const answer = await r.json().catch(() => ({}));
    if (!r.ok) { msg.textContent = answer.error || 'failed: ' + r.status; return; }
    form.remove();
    done(answer);
  } }, label, score, note, h('button', { type: 'submit' }, 'Save'),
  h('button', { type: 'button', onclick: () => { form.remove(); done(null); } }, 'Cancel'), msg);
  return form;
}

// The annotations of one target and an "annotate" button opening a form; a saved one is added in place.
function annotationsBlock(target, id, list) {
  const items = h('div', { class: 'ann-list' }, (list || []).map(annotationItem));
  const open = h('button', { class: 'annotate' }, 'annotate ' + target);
  const box = h('div', { class: 'annotations', 'data-target': target, 'data-id': id }, items, open);
  open.onclick = () => {
    open.hidden = true;
    const form = annotationForm(target, id, (a) => { if (a) items.append(annotationItem(a)); open.hidden = false; });
    box.append(form);
    form.elements.label.focus();
  };
  return box;
}

// --- cost over time: totals, spend and tokens by day, by model and agent, the most expensive sessions ---
const SVG = 'http://www.w3.org/2000/svg';
function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}
const isoDay = (d) => d.getFullYear() + '-' + String(d.getMonth() + 1).padStart(2, '0') + '-' + String(d.getDate()).padStart(2, '0');

// Stacked bars, one per day: `series` is [[name, cssClass, value(group)]], `label` formats a bar's total.
function dayChart(id, days, byDay, series, label) {
  const W = 960, H = 200, top = 12, bottom = 28, left = 64;
  const total = (g) => (g ? series.reduce((n, [, , f]) => n + f(g), 0) : 0);
  const max = Math.max(0, ...days.map((d) => total(byDay.get(d))));
  const chart = svg('svg', { id, class: 'chart', viewBox: '0 0 ' + W + ' ' + H, role: 'img' });
  const scale = (v) => (max > 0 ? (v / max) * (H - top - bottom) : 0);
  const slot = (W - left) / Math.max(days.length, 1);
  chart.append(svg('line', { class: 'axis', x1: left, x2: W, y1: H - bottom, y2: H - bottom }),
    svg('text', { class: 'tick', x: left - 6, y: top + 4, 'text-anchor': 'end' }, label(max)),
    svg('text', { class: 'tick', x: left - 6, y: H - bottom, 'text-anchor': 'end' }, label(0)));
  days.forEach((d, i) => {
    const g = byDay.get(d);
    let y = H - bottom;
    const x = left + i * slot + slot * 0.15;
    for (const [name, cls, f] of series) {
      const v = g ? f(g) : 0;
      if (!(v > 0)) continue;
      const hgt = Math.max(scale(v), 1);
      y -= hgt;
      chart.append(svg('rect', { class: 'cbar ' + cls, x, y, width: slot * 0.7, height: hgt, 'data-day': d },
        svg('title', {}, d + ' · ' + name + ': ' + label(v))));
    }
    if (days.length <= 31 || i % Math.ceil(days.length / 31) === 0) {
      chart.append(svg('text', { class: 'tick', x: x + slot * 0.35, y: H - 10, 'text-anchor': 'middle' }, d.slice(5)));
    }
  });
  return chart;
}

function costTotals(t) {
  const usd = (v) => (v === null || v === undefined ? 'unknown' : '$' + fmtUsd(v));
  return h('div', { class: 'totals', id: 'cost-totals' },
    [['Spend', usd(t.cost_usd) + (t.unpriced_calls && t.cost_usd !== null ? ' + unknown' : ''), 'cost-total'],
      ['Calls', num(t.calls), 'cost-calls'], ['Input', num(t.input_tokens)], ['Output', num(t.output_tokens)],
      ['Cache read', num(t.cache_read_tokens)], ['Cache write', num(t.cache_write_tokens)],
      ['Cache reads cost', usd(t.cache_read_cost_usd)],
      ['Cache savings', usd(t.cache_savings_usd) + (t.savings_unknown_calls ? ' (+ ' + num(t.savings_unknown_calls) + ' calls unknown)' : ''), 'cost-savings'],
      ['Unpriced calls', num(t.unpriced_calls)]]
      .map(([k, v, id]) => h('div', {}, h('span', { class: 'muted' }, k), h('b', { id }, v))));
}

function groupTable(id, name, groups, link) {
  const most = Math.max(0, ...groups.map((g) => Number(g.totals.cost_usd || 0)));
  return h('table', { id, class: 'costs' }, h('thead', {}, h('tr', {}, h('th', {}, name), h('th', { class: 'num' }, 'Calls'),
    h('th', { class: 'num' }, 'Input'), h('th', { class: 'num' }, 'Output'), h('th', { class: 'num' }, 'Cache read'),
    h('th', { class: 'num' }, 'Cost'), h('th', {}, ''))),
  h('tbody', {}, groups.map((g) => {
    const t = g.totals;
    const meter = h('span', { class: 'meter' });
    meter.style.width = (most > 0 ? (Number(t.cost_usd || 0) / most) * 100 : 0) + '%';
    return h('tr', { 'data-key': g.key ?? '' }, h('td', {}, link(g)), h('td', { class: 'num' }, num(t.calls)),
      h('td', { class: 'num' }, num(t.input_tokens)), h('td', { class: 'num' }, num(t.output_tokens)),
      h('td', { class: 'num' }, num(t.cache_read_tokens)),
      h('td', { class: 'num cost' }, cost({ cost_usd: t.cost_usd, calls: t.calls, unpriced_calls: t.unpriced_calls })),
      h('td', { class: 'meter-cell' }, meter));
  })));
}

async function costsPage(params) {
  const now = new Date();
  const since = params.get('since') || isoDay(new Date(now.getTime() - 29 * 86400000));
  const until = params.get('until') || isoDay(now);
  const tz = -now.getTimezoneOffset();
  const form = h('form', { class: 'filters', id: 'cost-range', onsubmit: (e) => {
    e.preventDefault();
    location.hash = '#/costs?since=' + enc(form.elements.since.value) + '&until=' + enc(form.elements.until.value);
  } }, h('input', { name: 'since', type: 'date', value: since }), h('span', { class: 'muted' }, 'to'),
  h('input', { name: 'until', type: 'date', value: until }), h('button', { type: 'submit' }, 'Show'),
  [7, 30, 90].map((n) => h('a', { href: '#/costs?since=' + isoDay(new Date(now.getTime() - (n - 1) * 86400000)) + '&until=' + isoDay(now) }, 'last ' + n + ' days')));
  const d = await get('api/costs?since=' + enc(since) + '&until=' + enc(until) + '&tz=' + tz);
  const days = [];
  for (let t = new Date(since + 'T00:00:00'); isoDay(t) <= until && days.length < 1000; t.setDate(t.getDate() + 1)) days.push(isoDay(t));
  const byDay = new Map(d.by_day.map((g) => [g.day, g]));
  const usd = (v) => '$' + fmtUsd(v);
  const compact = (n) => (n >= 1e6 ? (n / 1e6).toFixed(1) + 'M' : n >= 1e3 ? (n / 1e3).toFixed(1) + 'k' : String(Math.round(n)));
  const tokens = [['input (uncached)', 'input', (g) => g.totals.input_tokens - g.totals.cache_read_tokens - g.totals.cache_write_tokens],
    ['cache read', 'cache-read', (g) => g.totals.cache_read_tokens], ['cache write', 'cache-write', (g) => g.totals.cache_write_tokens],
    ['output', 'output', (g) => g.totals.output_tokens]];
  render(h('h1', {}, 'Cost over time'), form, costTotals(d.totals),
    h('h2', {}, 'Spend by day'), dayChart('chart-spend', days, byDay, [['spend', 'spend', (g) => Number(g.totals.cost_usd || 0)]], usd),
    h('h2', {}, 'Tokens by day'), dayChart('chart-tokens', days, byDay, tokens, compact),
    h('div', { class: 'legend' }, tokens.map(([name, cls]) => h('span', {}, h('i', { class: 'swatch ' + cls }), name))),
    h('h2', {}, 'By model'), groupTable('costs-by-model', 'Model', d.by_model.map((g) => ({ key: g.model, totals: g.totals })), (g) => g.key ?? '(none)'),
    h('h2', {}, 'By agent'), groupTable('costs-by-agent', 'Agent', d.by_agent.map((g) => ({ key: g.agent, totals: g.totals })), (g) => g.key ?? '(none)'),
    h('h2', {}, 'Most expensive sessions'),
    groupTable('top-sessions', 'Session', d.top_sessions.map((x) => ({ key: x.session_id, totals: x.totals, title: x.title })),
      (g) => h('a', { href: '#/s/' + enc(g.key), title: g.key }, g.title || shortId(g.key))),
    h('p', { class: 'muted' }, 'Calls started from ' + time(d.since) + ' to ' + time(d.until) + '. Cache savings: what the cache reads would have cost at each call\'s uncached input price, less what they cost.'));
  main.dataset.ready = '1';
  onLive = null;
}

async function route() {
  delete main.dataset.ready;
  onLive = null;
  const hash = location.hash.slice(1) || '/';
  const [path, qs] = hash.split('?');
  try {
    if (path.startsWith('/s/')) await sessionPage(decodeURIComponent(path.slice(3)), new URLSearchParams(qs || ''));
    else if (path.startsWith('/c/')) await callPage(decodeURIComponent(path.slice(3)));
    else if (path.startsWith('/d/')) await diffPage(decodeURIComponent(path.slice(3)), new URLSearchParams(qs || ''));
    else if (path.startsWith('/cmp/')) {
      const [a, b] = path.slice(5).split('/').map(decodeURIComponent);
      await comparePage(a, b || '');
    }
    else if (path === '/metrics') await metricsPage();
    else if (path === '/costs') await costsPage(new URLSearchParams(qs || ''));
    else if (path === '/search') await searchPage(new URLSearchParams(qs || ''));
    else await sessionsPage(new URLSearchParams(qs || ''));
  } catch (e) {
    render(h('p', { class: 'err' }, String(e)));
  }
}

// --- search: the header's box, the results page, and the step a hit opens ---
const SEARCH_FILTERS = ['model', 'agent', 'since', 'until', 'min_cost', 'max_cost'];
const FIELD_NAMES = { prompt: 'prompt', output: 'output', reasoning: 'reasoning', tool_call: 'tool call', tool_result: 'tool result', error: 'error' };

function searchBox() {
  const form = document.getElementById('search-box');
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    const q = form.elements.q.value.trim();
    if (q) location.hash = '#/search?' + new URLSearchParams({ q }).toString();
  });
}

// A hit's snippet: text nodes, the matched parts in <mark> (captured text is never parsed as HTML).
const snippetView = (pieces) => h('div', { class: 'snippet' }, pieces.map((p) => (p.hit ? h('mark', {}, p.text) : p.text)));

function hitView(hit) {
  const link = '#/s/' + enc(hit.session_id) + '?t=' + enc(hit.trajectory_id) + '&step=' + hit.step_index;
  return h('li', { class: 'hit', 'data-step': hit.step_id },
    h('a', { href: link, class: 'hit-link' }, (hit.agent || 'agent') + ' · step #' + hit.step_index + ' ' + hit.role),
    h('span', { class: 'muted' }, ' ' + [FIELD_NAMES[hit.field] || hit.field, hit.model, time(hit.timestamp),
      hit.cost_usd !== null && hit.cost_usd !== undefined ? '$' + fmtUsd(hit.cost_usd) : null].filter(Boolean).join(' · ')),
    hit.error ? h('span', { class: 'err' }, ' error') : null,
    snippetView(hit.snippet));
}

async function searchPage(params) {
  const box = document.getElementById('search-q');
  box.value = params.get('q') || '';
  const form = h('form', { class: 'filters', id: 'search-filters', onsubmit: (e) => {
    e.preventDefault();
    const q = new URLSearchParams();
    for (const f of ['q', ...SEARCH_FILTERS]) if (form.elements[f].value.trim()) q.set(f, form.elements[f].value.trim());
    if (form.elements.errors.checked) q.set('errors', '1');
    location.hash = '#/search?' + q.toString();
  } },
  h('input', { name: 'q', placeholder: 'words or "a phrase"', value: params.get('q') || '', size: 30 }),
  SEARCH_FILTERS.map((f) => h('input', { name: f, placeholder: f === 'since' || f === 'until' ? f + ' (RFC 3339)' : f.replace('_', ' '),
    value: params.get(f) || '', size: f.endsWith('cost') ? 8 : 14 })),
  h('label', {}, h('input', { type: 'checkbox', name: 'errors', checked: params.get('errors') === '1' }), ' errors only'),
  h('button', { type: 'submit' }, 'Search'));
  const list = h('ol', { class: 'hits', id: 'search-hits' });
  const status = h('p', { class: 'muted', id: 'search-status' });
  render(h('h1', {}, 'Search'), form, status, list);
  if (!params.get('q')) { status.textContent = 'Type words to find; every one must occur in a step.'; main.dataset.ready = '1'; return; }
  const q = new URLSearchParams();
  for (const f of ['q', 'errors', ...SEARCH_FILTERS]) if (params.get(f)) q.set(f, params.get(f));
  const r = await fetch('api/search?' + q.toString(), { credentials: 'same-origin' });
  const res = await r.json();
  if (!r.ok) { status.textContent = res.error || String(r.status); status.className = 'err'; main.dataset.ready = '1'; return; }
  status.textContent = res.hits.length ? num(res.hits.length) + (res.hits.length >= res.limit ? '+' : '') + (res.hits.length === 1 ? ' step' : ' steps') + ', newest first' : 'No step matches.';
  list.replaceChildren(...res.hits.map(hitView));
  main.dataset.ready = '1';
}

// Show step `index` of the steps on screen, loading further pages (`more`, false when there are none) until it
// is there; mark it and scroll to it.
async function revealStep(box, index, more) {
  let card = box.querySelector('.step[data-index="' + CSS.escape(String(index)) + '"]');
  while (!card && await more()) card = box.querySelector('.step[data-index="' + CSS.escape(String(index)) + '"]');
  if (!card) return;
  card.classList.add('found');
  card.id = 'found-step';
  card.scrollIntoView({ block: 'center' });
}

window.addEventListener('hashchange', route);
searchBox();
connectLive();
route();
