// Talking to the llmq server: the key, JSON calls, and SSE read from a fetch stream
// (EventSource cannot send an Authorization header).

const KEY = 'llmq.key';

export const getKey = () => sessionStorage.getItem(KEY) || '';

export function setKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export function authHeaders(extra = {}) {
  const key = getKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

// Named here because HTTP/2 responses carry no reason phrase.
const REASONS = { 400: 'bad request', 401: 'unauthorized', 403: 'forbidden', 404: 'not found', 409: 'conflict',
  429: 'too many requests', 500: 'server error', 502: 'bad gateway', 503: 'unavailable' };

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }

  toString() {
    return `${this.status} ${REASONS[this.status] || 'error'}: ${this.message}`;
  }
}

// The server's error body is {"error": {"message", "code", ...}}; fall back to the raw text.
export async function errorOf(res) {
  const text = await res.text();
  let err = null;
  try { err = JSON.parse(text).error; } catch { /* not JSON */ }
  const message = (err && (err.message || err)) || text || res.statusText;
  return new ApiError(res.status, String(message), err && err.code);
}

export async function api(path, { method = 'GET', signal } = {}) {
  const res = await fetch(path, { method, headers: authHeaders(), signal });
  if (!res.ok) throw await errorOf(res);
  return res.status === 204 ? null : res.json();
}

// An SSE parser fed with text as it arrives; push() returns the events completed so far.
// A lone "\r" at the end of a chunk is kept back: it may be the first half of "\r\n".
export class SseParser {
  constructor() { this.buf = ''; this.reset(); }
  reset() { this.data = []; this.event = ''; this.id = null; }
  push(text) {
    this.buf += text;
    const lines = this.buf.split(/\r\n|\r(?!$)|\n/);
    this.buf = lines.pop();
    const out = [];
    for (const line of lines) {
      if (line === '') {
        if (this.data.length) out.push({ id: this.id, event: this.event, data: this.data.join('\n') });
        this.reset();
        continue;
      }
      if (line.startsWith(':')) continue; // a comment, e.g. ": keep-alive"
      const colon = line.indexOf(':');
      const field = colon < 0 ? line : line.slice(0, colon);
      const value = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
      if (field === 'data') this.data.push(value);
      else if (field === 'event') this.event = value;
      else if (field === 'id') this.id = value;
    }
    return out;
  }
}

export async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SseParser();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      yield* parser.push(value);
    }
  } finally {
    reader.cancel().catch(() => {}); // the caller stopped early: close the connection
  }
}

const sleep = (ms, signal) => new Promise((resolve) => {
  const t = setTimeout(resolve, ms);
  signal.addEventListener('abort', () => { clearTimeout(t); resolve(); }, { once: true });
});

// Follows a job's event log. A dropped connection resumes with Last-Event-ID, and seqs already
// seen are skipped, so onEvent sees each seq exactly once, in order. onEvent returns true on the
// terminal event. Refusals (4xx) stop; network trouble and 5xx retry after a pause.
export async function followEvents(path, { signal, onEvent, onTrouble }) {
  let last = 0;
  while (!signal.aborted) {
    try {
      const headers = authHeaders(last ? { 'Last-Event-ID': String(last) } : {});
      const res = await fetch(path, { headers, signal });
      if (!res.ok) {
        const err = await errorOf(res);
        if (res.status < 500) throw Object.assign(err, { fatal: true });
        throw err;
      }
      for await (const ev of sseEvents(res.body)) {
        const data = JSON.parse(ev.data);
        const seq = Number(ev.id ?? data.seq);
        if (seq <= last) continue;
        last = seq;
        if (onEvent(data, seq)) return;
      }
      onTrouble(new Error('event stream closed early; reconnecting'));
    } catch (err) {
      if (signal.aborted) return;
      onTrouble(err);
      if (err.fatal) return;
    }
    await sleep(1000, signal);
  }
}
