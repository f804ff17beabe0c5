// Models and queues: capacity, levels, a chart of the recent past, and the workers.
import { api } from '../api.js';
import { h, table, syncRows, poller, ago, secs, num, dash } from '../dom.js';

const SVG = 'http://www.w3.org/2000/svg';

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

// Waiting and running over the history samples, both on one scale starting at zero.
function chart(model) {
  const samples = model.history;
  const W = 300, H = 80;
  if (samples.length < 2) { // an empty frame keeps the layout from jumping when samples arrive
    return h('figure', {}, svg('svg', { viewBox: `0 0 ${W} ${H}`, class: 'chart', role: 'img', 'aria-label': 'No history yet' }),
      h('figcaption', { class: 'muted' }, 'No history yet.'));
  }
  const t0 = samples[0].at, span = samples.at(-1).at - t0 || 1;
  const top = Math.max(1, ...samples.map((s) => Math.max(s.waiting, s.running)));
  const line = (key) => samples.map((s) => `${(((s.at - t0) / span) * W).toFixed(1)},${(H - (s[key] / top) * (H - 4)).toFixed(1)}`).join(' ');
  const last = samples.at(-1);
  // Stretched to the box's width; the strokes keep their width (non-scaling-stroke in the CSS).
  const pic = svg('svg', { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: 'none', class: 'chart', role: 'img',
    'aria-label': `Waiting and running over the last ${Math.round(span / 60)} min; now ${last.waiting} waiting, ${last.running} running; peak ${top}` });
  pic.append(
    svg('polyline', { points: line('waiting'), class: 'waiting' }),
    svg('polyline', { points: line('running'), class: 'running' }),
  );
  return h('figure', {}, pic, h('figcaption', {},
    h('span', { class: 'legend waiting' }, 'waiting'), ' ', h('span', { class: 'legend running' }, 'running'),
    ` · last ${Math.round(span / 60)} min · top of the chart: ${top}`));
}

// A worker's engine layout as llmq-status writes it (tp=2, tp=2 pp=2, tp=8 pp=2 nodes=2): the tensor
// size always, so a one-device worker reads tp=1; pipeline and hosts only past 1.
function layout(p) {
  return [`tp=${p.tensor}`, p.pipeline > 1 && `pp=${p.pipeline}`, p.nodes > 1 && `nodes=${p.nodes}`].filter(Boolean).join(' ');
}

function modelSection() {
  const [levels, body] = table('Levels', ['Level', 'Waiting', 'Running', 'Oldest waiting', 'Finished / min']);
  const section = h('section', { class: 'model' }, h('h2'), h('p', { class: 'summary' }), h('div', { class: 'chart-box' }), levels);
  section.levels = body;
  return section;
}

function fillModel(section, m) {
  section.querySelector('h2').textContent = m.kind === 'generate' ? m.name : `${m.name} (${m.kind})`;
  section.querySelector('.summary').textContent = [
    `${m.ready_workers} ready, ${m.loading_workers} loading workers`,
    `slots ${m.slots_in_use} / ${m.slots} in use`,
    `${m.waiting} waiting, ${m.running} running`,
    `${m.dead_letters} dead letters`,
    `adapters: ${m.adapters.length ? m.adapters.join(', ') : 'none'}`,
  ].join(' · ');
  section.querySelector('.chart-box').replaceChildren(chart(m));
  syncRows(section.levels, m.levels, (l) => l.level, (l) => h('tr', {},
    h('td', {}, l.level), h('td', {}, l.waiting), h('td', {}, l.running),
    h('td', {}, secs(l.oldest_age_s)), h('td', {}, l.finished_per_min == null ? dash : l.finished_per_min.toFixed(1))));
}

export function mount(main, ctx) {
  const models = h('div', { class: 'models' });
  const [workers, workerRows] = table('Workers', ['Worker', 'Model', 'Kind', 'Status', 'Running / slots', 'Host', 'PID', 'Device', 'Layout', 'Heartbeat', 'Adapters']);
  main.append(h('h1', {}, 'Models and queues'), models, h('h2', {}, 'Workers'), workers);
  const sections = new Map();

  poller(ctx, 2000, async () => {
    const d = await api('/v1/deployment', { signal: ctx.signal });
    for (const m of d.models) {
      if (!sections.has(m.name)) {
        sections.set(m.name, modelSection());
        models.append(sections.get(m.name));
      }
      fillModel(sections.get(m.name), m);
    }
    for (const [name, section] of sections) {
      if (!d.models.some((m) => m.name === name)) { section.remove(); sections.delete(name); }
    }
    if (!d.models.length && !models.querySelector('.empty')) models.append(h('p', { class: 'empty muted' }, 'No models deployed.'));
    if (d.models.length) models.querySelector('.empty')?.remove();
    syncRows(workerRows, d.workers, (w) => w.id, (w) => h('tr', {},
      h('td', {}, w.id), h('td', {}, w.model), h('td', {}, w.kind), h('td', {}, h('span', { class: `tag ${w.status}` }, w.status)),
      h('td', {}, `${w.running} / ${w.slots}`), h('td', {}, w.host), h('td', {}, num(w.pid)), h('td', {}, w.device),
      h('td', {}, layout(w.parallel)), h('td', {}, ago(Date.now() - w.last_heartbeat_age_s * 1000)), h('td', {}, w.adapters.join(', ') || dash)));
  });
}
