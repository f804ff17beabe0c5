// One job: its record (re-read while it is live), its runs, and its event log followed live.
import { api, followEvents } from '../api.js';
import { h, table, syncRows, poller, ago, ms, num, secs, dash } from '../dom.js';

const since = (r, at) => (r[at] == null ? dash : ms(r[at] - r.queued_at));

// [label, test id or null, value of the record]
const FIELDS = [
  ['Status', 'job-status', (r) => r.status],
  ['Model', null, (r) => r.model],
  ['Dialect', null, (r) => r.dialect],
  ['Tenant', null, (r) => r.tenant],
  ['Priority', null, (r) => num(r.priority)],
  ['Queued', null, (r) => ago(r.queued_at)],
  // While it waits: the jobs of its model estimated to start before it, and when it should start.
  ['Queue position', 'job-position', (r) => num(r.queue_position)],
  ['Starts in (ETA)', 'job-eta', (r) => secs(r.eta_s)],
  // The first start: a takeover or a preemption starts it again (the runs below list each).
  ['Started after', null, (r) => (r.runs.length ? ms(r.runs[0].started_at - r.queued_at) : since(r, 'started_at'))],
  ['First token after', null, (r) => since(r, 'first_token_at')],
  ['Finished after', null, (r) => since(r, 'finished_at')],
  ['Deadline', null, (r) => ago(r.deadline)],
  ['Attempts', null, (r) => r.attempts],
  ['Preemptions', null, (r) => `${r.preemptions} (${ms(r.preempted_ms)} preempted)`],
  ['Tokens (prompt / generated)', null, (r) => `${num(r.prompt_tokens)} / ${num(r.generated_tokens)}`],
  ['Trace id', null, (r) => r.trace_id ?? dash],
  ['Error', null, (r) => (r.error ? `${r.error.code}: ${r.error.message}` : dash)],
];

const pretty = (x) => JSON.stringify(x, null, 2);
const MAX_LINES = 5000; // event lines kept on the page
const deltaText = (event) => (event.deltas || []).map((d) => d.text || '').join('');

export function mount(main, ctx) {
  const [id] = ctx.params;
  const path = `/v1/jobs/${encodeURIComponent(id)}`;
  const values = FIELDS.map(([, testid]) => h('dd', { 'data-testid': testid }));
  const [runs, runRows] = table('Runs', ['Attempt', 'Worker', 'Started'], { 'data-testid': 'job-runs' });
  const prompt = h('pre');
  const request = h('pre');
  const result = h('pre');
  const output = h('pre', { class: 'output', 'data-testid': 'job-output' });
  const events = h('ol', { class: 'events', 'data-testid': 'job-events' });
  const streamNote = h('p', { class: 'muted', 'data-testid': 'job-stream' }, 'Connecting…');
  main.append(
    h('h1', {}, 'Job ', h('code', {}, id)),
    h('dl', { class: 'record' }, FIELDS.map(([label], i) => [h('dt', {}, label), values[i]])),
    h('h2', {}, 'Runs'), runs,
    h('details', {}, h('summary', {}, 'Prompt'), prompt),
    h('details', {}, h('summary', {}, 'Whole request'), request),
    h('details', {}, h('summary', {}, 'Result'), result),
    h('h2', {}, 'Output'), output,
    h('h2', {}, 'Events'), streamNote, events);

  // Only touch text that changed, so an open <details> or a selection stays put.
  const setText = (node, text) => { if (node.textContent !== text) node.textContent = text; };
  const record = poller(ctx, 2000, async () => {
    const r = await api(`${path}/record`, { signal: ctx.signal });
    FIELDS.forEach(([, , value], i) => setText(values[i], String(value(r))));
    syncRows(runRows, r.runs, (run) => `${run.attempt}\n${run.worker}`, (run) => h('tr', { 'data-testid': 'job-run' },
      h('td', {}, run.attempt), h('td', {}, run.worker), h('td', {}, ago(run.started_at))));
    const req = r.request || {};
    setText(prompt, pretty({ prompt: req.prompt, messages: req.messages, prompt_token_ids: req.prompt_token_ids }));
    setText(request, pretty(req));
    setText(result, r.result ? pretty(r.result) : '(none yet)');
    return r.status === 'queued' || r.status === 'running';
  });

  // Assembled per choice index, each in a text node of its own that only grows: one choice is the
  // usual case and then prints plainly. A long job streams thousands of events, so the page takes
  // them in batches (one DOM update per 100 ms), never rebuilding what it shows.
  const choices = new Map();
  const choice = (index) => {
    if (!choices.has(index)) {
      const label = h('span', { class: 'muted' });
      const text = document.createTextNode('');
      choices.set(index, { label, text });
      output.append(label, text);
      if (choices.size > 1) for (const [i, c] of choices) c.label.textContent = `${i ? '\n' : ''}--- choice ${i} ---\n`;
    }
    return choices.get(index);
  };
  let pending = document.createDocumentFragment();
  let flushing = null;
  const flush = () => {
    clearTimeout(flushing);
    flushing = null;
    events.append(pending);
    pending = document.createDocumentFragment();
    // The newest lines only: the whole output is above, and the log stays readable via the API.
    for (let extra = events.childElementCount - MAX_LINES; extra > 0; extra -= 1) events.firstElementChild.remove();
  };
  followEvents(`${path}/events`, {
    signal: ctx.signal,
    onEvent(event, seq) {
      for (const d of event.deltas || []) if (d.text) choice(d.index ?? 0).text.appendData(d.text);
      const text = event.type === 'error' ? `${event.code}: ${event.message}` : deltaText(event);
      pending.append(h('li', { 'data-testid': 'job-event', 'data-seq': seq },
        h('span', { class: 'seq' }, seq), ' ', h('span', { class: `tag ${event.type}` }, event.type), ' ', text));
      const end = event.type === 'done' || event.type === 'error';
      if (end) {
        flush();
        setText(streamNote, `Stream ended (${event.type}).`);
        record.kick(); // the record's final state, without waiting for the next tick
      } else if (!flushing) {
        flushing = setTimeout(flush, 100);
        setText(streamNote, 'Following live…');
      }
      return end;
    },
    onTrouble(err) {
      setText(streamNote, `Stream interrupted: ${err.status ? err : err.message}${err.fatal ? '' : ' (reconnecting)'}`);
    },
  });
}
