// Recent jobs with filters; the filters live in this module so they survive leaving the page.
import { api } from '../api.js';
import { h, table, syncRows, poller, onRowAction, ago, ms, num, secs, dash, jobLink } from '../dom.js';

const STATUSES = ['queued', 'running', 'done', 'failed', 'cancelled'];
const DIALECTS = ['openai_chat', 'openai_responses', 'anthropic_messages', 'lmi', 'tgi', 'triton', 'jobs',
  'openai_completions', 'happy_vllm', 'lmtp'];
const filters = { model: '', tenant: '', status: '', dialect: '' };

function select(name, label, values) {
  return h('label', {}, label, ' ', h('select', { name, 'data-testid': `filter-${name}` },
    h('option', { value: '' }, 'any'), values.map((v) => h('option', { value: v }, v))));
}

export function mount(main, ctx) {
  const mine = (j) => ctx.access && (ctx.access.role === 'operator' || j.tenant === ctx.access.tenant);
  const cancellable = (j) => (j.status === 'queued' || j.status === 'running') && mine(j);
  const form = h('form', { class: 'filters', role: 'search', 'aria-label': 'Filter jobs' },
    select('model', 'Model', []),
    h('label', {}, 'Tenant ', h('input', { name: 'tenant', type: 'text', 'data-testid': 'filter-tenant' })),
    select('status', 'Status', STATUSES),
    select('dialect', 'Dialect', DIALECTS));
  const [t, body] = table('Recent jobs', ['Job', 'Status', 'Dialect', 'Tenant', 'Queued', 'Position / ETA',
    'Queue time', 'TTFT', 'Tokens (prompt / generated)', 'Attempts', 'Preemptions', 'Workers', 'Actions'], { 'data-testid': 'jobs-table' });
  main.append(h('h1', {}, 'Recent jobs'), form, t);

  const row = (j) => h('tr', { 'data-testid': 'job-row', 'data-job': j.id },
    h('td', {}, jobLink(j.id)),
    h('td', { title: j.error ? `${j.error.code}: ${j.error.message}` : null }, h('span', { class: `tag ${j.status}` }, j.status)),
    h('td', {}, j.dialect), h('td', {}, j.tenant), h('td', {}, ago(j.queued_at)),
    // A waiting job's place in its model's queue and its estimated start (dashes once it runs).
    h('td', { 'data-testid': 'job-standing' }, j.queue_position == null ? dash : `${j.queue_position} / ${secs(j.eta_s)}`),
    h('td', {}, ms(j.queue_ms)), h('td', {}, ms(j.ttft_ms)),
    h('td', {}, `${num(j.prompt_tokens)} / ${num(j.generated_tokens)}`),
    h('td', {}, j.attempts), h('td', {}, j.preemptions), h('td', {}, j.workers.join(', ') || dash),
    h('td', {}, cancellable(j) && h('button', { type: 'button', 'data-action': 'cancel', 'data-testid': 'cancel' }, 'Cancel')));

  const list = poller(ctx, 2000, async () => {
    const q = new URLSearchParams({ limit: '50' });
    for (const [k, v] of Object.entries(filters)) if (v) q.set(k, v);
    const { data } = await api(`/v1/jobs?${q}`, { signal: ctx.signal });
    syncRows(body, data, (j) => j.id, row);
  });

  // The model list only fills the select; a failure here shows up through the job list anyway.
  api('/v1/deployment', { signal: ctx.signal }).then((d) => {
    form.elements.model.append(...d.models.map((m) => h('option', { value: m.name }, m.name)));
    form.elements.model.value = filters.model;
  }).catch(() => {});
  for (const k of Object.keys(filters)) form.elements[k].value = filters[k];
  form.addEventListener('input', (e) => {
    filters[e.target.name] = e.target.value.trim();
    list.kick();
  });
  form.addEventListener('submit', (e) => e.preventDefault());

  onRowAction(body, 'button[data-action="cancel"]', list, async (button, id) => {
    try {
      await api(`/v1/jobs/${encodeURIComponent(id)}`, { method: 'DELETE' });
      ctx.say(`Cancelled job ${id}.`);
    } catch (err) {
      ctx.showError(err);
    }
  });
}
