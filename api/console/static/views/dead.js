// Dead letters: jobs that ran out of attempts. Requeue and Discard are offered to everyone; the
// server decides (a tenant key gets 403) and its answer is shown as is.
import { api } from '../api.js';
import { h, table, syncRows, poller, onRowAction, ago, dash, jobLink } from '../dom.js';

export function mount(main, ctx) {
  const [t, body] = table('Dead letters', ['Job', 'Model', 'Tenant', 'Dialect', 'Attempts', 'When', 'Error', 'Actions']);
  const message = h('div', { class: 'message', role: 'alert', 'data-testid': 'dead-message' });
  const empty = h('p', { class: 'muted', hidden: true }, 'No dead letters.');
  main.append(h('h1', {}, 'Dead letters'), message, t, empty);

  const row = (d) => h('tr', { 'data-testid': 'dead-row', 'data-job': d.job_id },
    h('td', {}, jobLink(d.job_id)), h('td', {}, d.model), h('td', {}, d.tenant), h('td', {}, d.dialect),
    h('td', {}, d.attempts), h('td', {}, ago(d.at)),
    h('td', {}, d.error ? [h('code', {}, d.error.code), ' ', d.error.message] : dash),
    h('td', { class: 'actions' }, d.requeued_as ? ['requeued as ', jobLink(d.requeued_as)] : [
      h('button', { type: 'button', 'data-action': 'requeue', 'data-testid': 'requeue' }, 'Requeue'),
      h('button', { type: 'button', 'data-action': 'discard', 'data-testid': 'discard' }, 'Discard')]));

  const list = poller(ctx, 5000, async () => {
    const { data } = await api('/v1/dead_letters', { signal: ctx.signal });
    syncRows(body, data, (d) => d.job_id, row);
    empty.hidden = data.length > 0;
  });

  onRowAction(body, 'button[data-action]', list, async (button, id) => {
    const requeue = button.dataset.action === 'requeue';
    const path = `/v1/dead_letters/${encodeURIComponent(id)}${requeue ? '/requeue' : ''}`;
    message.className = 'message';
    try {
      const answer = await api(path, { method: requeue ? 'POST' : 'DELETE', signal: ctx.signal });
      message.replaceChildren(...(requeue ? [`${id} requeued as `, jobLink(answer.requeued_as)] : [`${id} discarded.`]));
    } catch (err) {
      if (ctx.signal.aborted) return;
      message.className = 'message error';
      message.replaceChildren(`${requeue ? 'Requeue' : 'Discard'} of ${id} refused: ${err.status ? err : err.message}`);
    }
  });
}
