// Tenants: fair share against what each one actually got, queues, quotas and today's usage.
import { api } from '../api.js';
import { h, table, syncRows, poller, pct, dash } from '../dom.js';

// Two thin bars, fair share above, actual share below; the percentages are in the cell's text.
function bars(fair, used) {
  const bar = (cls, x) => {
    const b = h('span', { class: `bar ${cls}` });
    b.style.width = `${Math.min(100, (x ?? 0) * 100).toFixed(1)}%`; // CSSOM, not a style attribute: CSP-safe
    return b;
  };
  return h('span', { class: 'bars', 'aria-hidden': 'true' }, bar('fair', fair), bar('used', used));
}

const limit = (n, max) => (max == null ? `${n}` : `${n} / ${max}`);

function row(t) {
  const l = t.limits;
  const d = t.today;
  return h('tr', {},
    h('td', {}, t.tenant), h('td', {}, t.model), h('td', {}, t.weight),
    h('td', { class: 'share' }, `fair ${pct(t.fair_share)} · used ${pct(t.share_last_minute)}`, bars(t.fair_share, t.share_last_minute)),
    h('td', {}, t.running), h('td', {}, t.waiting),
    h('td', {}, h('ul', { class: 'plain' },
      h('li', {}, l.tokens_per_minute == null ? `${t.tokens_last_minute} tokens / min (no limit)`
        : `${t.tokens_last_minute} / ${l.tokens_per_minute} tokens / min`),
      h('li', {}, `running ${limit(t.running, l.max_running)}`),
      h('li', {}, `queued ${limit(t.waiting, l.max_queued)}`))),
    h('td', {}, h('ul', { class: 'plain' },
      h('li', {}, `${d.requests} requests`),
      h('li', {}, `${d.prompt_tokens} prompt + ${d.generated_tokens} generated tokens`),
      h('li', {}, `${d.engine_seconds.toFixed(1)} s engine`),
      h('li', {}, d.preemptions ? `${d.preemptions} preemptions (${d.preempted_seconds.toFixed(1)} s)` : 'no preemptions'))));
}

export function mount(main, ctx) {
  const [t, body] = table('Tenants', ['Tenant', 'Model', 'Weight', 'Fair share vs last minute', 'Running', 'Waiting', 'Quota use', 'Today']);
  const empty = h('p', { class: 'muted', hidden: true }, `No tenants ${dash} nothing has run yet.`);
  main.append(h('h1', {}, 'Tenants'), t, empty);
  poller(ctx, 2000, async () => {
    const { data } = await api('/v1/tenants', { signal: ctx.signal });
    syncRows(body, data, (x) => `${x.tenant}\n${x.model}`, row);
    empty.hidden = data.length > 0;
  });
}
