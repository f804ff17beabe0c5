// Small DOM and formatting helpers shared by the pages. Server strings only ever reach the page
// as text nodes or attribute values, never as HTML.

// h('a', {href: '#/x', class: 'c'}, 'text', child) builds an element.
export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === false || value == null) continue;
    if (name.startsWith('on')) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? '' : value);
  }
  node.append(...children.flat(Infinity).filter((c) => c != null && c !== false).map((c) => (c instanceof Node ? c : String(c))));
  return node;
}

// A table with <th scope="col"> headers; returns the table and its tbody.
export function table(label, headers, attrs = {}) {
  const body = h('tbody');
  const t = h('table', attrs, h('caption', { class: 'sr-only' }, label),
    h('thead', {}, h('tr', {}, headers.map((x) => h('th', { scope: 'col' }, x)))), body);
  return [t, body];
}

// Brings tbody in line with items without rebuilding what did not change, so a focused button
// or a text selection in an unchanged cell survives the refresh. Buttons use event delegation
// (listeners are not compared).
export function syncRows(tbody, items, keyOf, buildRow) {
  const old = new Map([...tbody.rows].map((r) => [r.dataset.key, r]));
  let cursor = tbody.firstElementChild;
  for (const item of items) {
    const key = String(keyOf(item));
    const fresh = buildRow(item);
    fresh.dataset.key = key;
    let row = old.get(key);
    if (row) {
      old.delete(key);
      patchRow(row, fresh);
    } else row = fresh;
    if (row === cursor) cursor = cursor.nextElementSibling;
    else tbody.insertBefore(row, cursor);
  }
  for (const row of old.values()) row.remove();
}

function patchRow(row, fresh) {
  for (const a of fresh.attributes) if (row.getAttribute(a.name) !== a.value) row.setAttribute(a.name, a.value);
  const cells = [...fresh.cells]; // a copy: replaceWith() moves cells out of `fresh`
  cells.forEach((cell, i) => {
    const cur = row.cells[i];
    if (!cur) row.append(cell);
    else if (!cur.isEqualNode(cell)) cur.replaceWith(cell);
  });
  while (row.cells.length > cells.length) row.lastElementChild.remove();
}

// Runs fn now and then every `every` ms after the previous run finished, so a slow server never
// gets a pile of requests. kick() runs it at once (or right after the run in flight).
// fn returning false stops the timer (kick() starts it again). Stops when ctx.signal aborts.
export function poller(ctx, every, fn) {
  let timer = null;
  let busy = false;
  let again = false;
  let failed = false; // clear only the banner this poller raised, not an action's error
  async function run() {
    clearTimeout(timer);
    if (ctx.signal.aborted) return;
    if (busy) { again = true; return; }
    busy = true;
    let more = true;
    try {
      more = await fn();
      if (failed) ctx.clearError();
      failed = false;
    } catch (err) {
      if (!ctx.signal.aborted) ctx.showError(err);
      failed = true;
    } finally {
      busy = false;
    }
    if (ctx.signal.aborted) return;
    if (again) { again = false; run(); } else if (more !== false) timer = setTimeout(run, every);
  }
  ctx.signal.addEventListener('abort', () => clearTimeout(timer));
  run();
  return { kick: run };
}

// A click on a row's action button (`selector`) runs act(button, the row's job id), then
// list.kick(). The button is not `disabled` while in flight (that would drop the keyboard focus):
// a repeat click on the same row is ignored instead.
export function onRowAction(tbody, selector, list, act) {
  const pending = new Set();
  tbody.addEventListener('click', async (e) => {
    const button = e.target.closest(selector);
    const id = button?.closest('tr').dataset.job;
    if (!button || pending.has(id)) return;
    pending.add(id);
    try {
      await act(button, id);
    } finally {
      pending.delete(id);
    }
    list.kick();
  });
}

export const dash = '—';

// epochMs in the past -> "3 s ago"; in the future -> "in 3 s".
export function ago(epochMs) {
  if (epochMs == null) return dash;
  const s = (Date.now() - epochMs) / 1000;
  const a = Math.abs(s);
  const text = a < 60 ? `${Math.round(a)} s` : a < 3600 ? `${Math.round(a / 60)} min`
    : a < 86400 ? `${Math.round(a / 3600)} h` : `${Math.round(a / 86400)} d`;
  return s >= 0 ? `${text} ago` : `in ${text}`;
}

export const ms = (x) => (x == null ? dash : `${Math.round(x)} ms`);
export const secs = (x) => (x == null ? dash : `${x.toFixed(1)} s`);
export const pct = (x) => (x == null ? dash : `${(x * 100).toFixed(0)}%`);
export const num = (x) => (x == null ? dash : String(x));
export const jobLink = (id) => h('a', { href: `#/jobs/${encodeURIComponent(id)}` }, id);
