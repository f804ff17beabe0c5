// Playground: send one request in a chosen dialect and show the request and response bytes as
// they are, plus the answer text pulled out of them.
import { api, authHeaders, SseParser } from '../api.js';
import { h } from '../dom.js';

const DIALECTS = [
  ['openai_chat', 'OpenAI chat'], ['openai_responses', 'OpenAI Responses'], ['anthropic_messages', 'Anthropic Messages'],
  ['lmi', 'AWS LMI'], ['tgi', 'Hugging Face TGI'], ['triton', 'Triton generate'],
];
const WITH_TOOLS = new Set(['openai_chat', 'openai_responses', 'anthropic_messages']);
const WEATHER = {
  name: 'get_weather',
  description: 'Get the current weather in a city',
  schema: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
};

// Method, path, extra headers and body of one request, in the shape each dialect expects.
function build(dialect, { model, prompt, maxTokens, stream, tools }) {
  const user = [{ role: 'user', content: prompt }];
  switch (dialect) {
    case 'openai_chat': return ['/v1/chat/completions', {}, { model, messages: user, max_tokens: maxTokens, stream,
      ...(tools && { tools: [{ type: 'function', function: { name: WEATHER.name, description: WEATHER.description, parameters: WEATHER.schema } }] }) }];
    case 'openai_responses': return ['/v1/responses', {}, { model, input: prompt, max_output_tokens: maxTokens, stream,
      ...(tools && { tools: [{ type: 'function', name: WEATHER.name, description: WEATHER.description, parameters: WEATHER.schema }] }) }];
    case 'anthropic_messages': return ['/v1/messages', { 'anthropic-version': '2023-06-01' }, { model, max_tokens: maxTokens, messages: user, stream,
      ...(tools && { tools: [{ name: WEATHER.name, description: WEATHER.description, input_schema: WEATHER.schema }] }) }];
    case 'lmi': return ['/invocations', {}, { inputs: prompt, parameters: { max_new_tokens: maxTokens }, stream }];
    case 'tgi': return [stream ? '/generate_stream' : '/generate', {}, { inputs: prompt, parameters: { max_new_tokens: maxTokens } }];
    // generate_stream sends tokens one by one only with "stream": true (else one event at the end).
    case 'triton': return [`/v2/models/${encodeURIComponent(model)}/${stream ? 'generate_stream' : 'generate'}`, {},
      { text_input: prompt, parameters: { max_tokens: maxTokens }, ...(stream && { stream: true }) }];
    default: throw new Error(`unknown dialect ${dialect}`);
  }
}

// fetch() does not tell the HTTP version; a same-origin request goes the way the page itself came.
const PROTOCOLS = { 'http/1.1': 'HTTP/1.1', h2: 'HTTP/2', h3: 'HTTP/3' };
const protocol = () => PROTOCOLS[performance.getEntriesByType('navigation')[0]?.nextHopProtocol] || 'HTTP/1.1';

const errorText = (o) => (o.error ? `\n[error: ${typeof o.error === 'string' ? o.error : o.error.message || JSON.stringify(o.error)}]\n` : '');

// The text one parsed JSON piece (a stream event, a JSON line or a whole body) adds to the answer.
function textOf(dialect, o) {
  if (Array.isArray(o)) return o.map((x) => textOf(dialect, x)).join('');
  if (!o || typeof o !== 'object') return '';
  switch (dialect) {
    case 'openai_chat': { const c = o.choices?.[0]; return c ? (c.delta?.content ?? c.message?.content ?? '') : errorText(o); }
    case 'openai_responses':
      if (o.type === 'response.output_text.delta') return o.delta;
      if (o.object === 'response') return o.output.flatMap((item) => item.content || []).filter((c) => c.type === 'output_text').map((c) => c.text).join('');
      return o.type === 'error' || o.error ? errorText({ error: o.error || o }) : '';
    case 'anthropic_messages':
      if (o.type === 'content_block_delta') return o.delta?.type === 'text_delta' ? o.delta.text : '';
      if (o.type === 'message') return o.content.filter((c) => c.type === 'text').map((c) => c.text).join('');
      return o.type === 'error' ? errorText(o) : '';
    default: // LMI, TGI, Triton: a streamed token's text, else the whole text
      if (o.token) return o.token.special || o.token.special_token ? '' : o.token.text ?? '';
      return o.text_output ?? o.generated_text ?? o.text ?? errorText(o);
  }
}

export function mount(main, ctx) {
  let model = null;
  const dialect = h('select', { id: 'pg-dialect', 'data-testid': 'pg-dialect' }, DIALECTS.map(([v, label]) => h('option', { value: v }, label)));
  const prompt = h('textarea', { id: 'pg-prompt', 'data-testid': 'pg-prompt', rows: 4 }, 'Say hello in three words.');
  const maxTokens = h('input', { id: 'pg-max', type: 'number', min: 1, value: 32, 'data-testid': 'pg-max-tokens' });
  const stream = h('input', { id: 'pg-stream', type: 'checkbox', checked: true, 'data-testid': 'pg-stream' });
  const tools = h('input', { id: 'pg-tools', type: 'checkbox', 'data-testid': 'pg-tools' });
  const send = h('button', { type: 'submit', 'data-testid': 'pg-send', disabled: true }, 'Send');
  const modelNote = h('p', { class: 'muted' }, 'Loading the model…');
  const pane = (name, testid) => h('section', { class: 'pane' }, h('h2', {}, name), h('pre', { 'data-testid': testid }));
  const panes = h('div', { class: 'panes' }, pane('Request', 'pg-request'), pane('Response', 'pg-response'), pane('Answer', 'pg-answer'));
  const [requestPane, responsePane, answerPane] = panes.querySelectorAll('pre');
  const done = h('p', { class: 'done', 'data-testid': 'pg-done', hidden: true });
  const label = (input, text) => h('label', { for: input.id }, text);
  const form = h('form', { class: 'playground' },
    h('p', {}, label(dialect, 'Dialect'), ' ', dialect),
    h('p', { class: 'wide' }, label(prompt, 'Prompt'), prompt),
    h('p', {}, label(maxTokens, 'Max tokens'), ' ', maxTokens),
    h('p', {}, stream, ' ', label(stream, 'Stream'), ' ', tools, ' ', label(tools, 'Tools (get_weather)')),
    h('p', {}, send));
  main.append(h('h1', {}, 'Playground'), modelNote, form, done, panes);

  const syncTools = () => {
    tools.disabled = !WITH_TOOLS.has(dialect.value);
    if (tools.disabled) tools.checked = false;
  };
  dialect.addEventListener('change', syncTools);
  syncTools();

  api('/v1/deployment', { signal: ctx.signal }).then((d) => {
    model = d.models[0]?.name ?? null;
    modelNote.textContent = model ? `Model: ${model}` : 'No model is deployed.';
    send.disabled = !model;
  }, (err) => { if (!ctx.signal.aborted) { modelNote.textContent = 'No model known.'; ctx.showError(err); } });

  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    const d = dialect.value;
    const [path, extra, body] = build(d, { model, prompt: prompt.value, maxTokens: Number(maxTokens.value) || 32, stream: stream.checked, tools: tools.checked });
    const text = JSON.stringify(body, null, 2); // built once: shown and sent as the very same string
    const headers = authHeaders({ 'Content-Type': 'application/json', ...extra });
    const shown = Object.entries(headers).map(([k, v]) => `${k}: ${k === 'Authorization' ? 'Bearer ••••' : v}`);
    requestPane.textContent = `POST ${path} ${protocol()}\n${shown.join('\n')}\n\n${text}`;
    responsePane.textContent = '';
    answerPane.textContent = '';
    done.hidden = true;
    done.textContent = '';
    send.disabled = true;
    ctx.say('Sending…');
    let raw = '';
    try {
      const res = await fetch(path, { method: 'POST', headers, body: text, signal: ctx.signal });
      responsePane.textContent = `${protocol()} ${res.status} ${res.statusText}\n${[...res.headers].map(([k, v]) => `${k}: ${v}`).join('\n')}\n\n`;
      const type = res.headers.get('content-type') || '';
      const sse = type.includes('event-stream') ? new SseParser() : null;
      const lines = /jsonl|ndjson|json-seq/.test(type);
      let partial = '';
      const take = (piece) => {
        if (!piece.trim() || piece.trim() === '[DONE]') return;
        try { answerPane.append(textOf(d, JSON.parse(piece))); } catch { /* not JSON: only in the Response pane */ }
      };
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { value, done: end } = await reader.read();
        if (end) break;
        raw += value;
        responsePane.append(value);
        if (sse) sse.push(value).forEach((ev) => take(ev.data));
        else if (lines) {
          const parts = (partial + value).split('\n');
          partial = parts.pop();
          parts.forEach(take);
        }
      }
      if (lines) take(partial);
      if (!sse && !lines) take(raw); // a whole JSON body
      if (!answerPane.textContent) answerPane.textContent = res.ok ? '(no text: see the response, e.g. a tool call)' : '(error: see the response)';
      ctx.say(`Response ${res.status} complete.`);
    } catch (err) {
      if (ctx.signal.aborted) return;
      responsePane.append(`\n[request failed: ${err.message}]`);
      ctx.say('Request failed.');
    } finally {
      send.disabled = !model;
    }
    done.textContent = 'done';
    done.hidden = false;
  });
}
