// The shell: key, role, theme, banner and the hash router. Each page module exports
// mount(main, ctx); ctx.signal aborts when the user leaves the page, which stops its timers
// and closes its requests.
import { api, getKey, setKey } from './api.js';
import * as overview from './views/overview.js';
import * as tenants from './views/tenants.js';
import * as jobs from './views/jobs.js';
import * as job from './views/job.js';
import * as dead from './views/dead.js';
import * as playground from './views/playground.js';

const routes = [
  [/^\/overview$/, overview, 'Overview'],
  [/^\/tenants$/, tenants, 'Tenants'],
  [/^\/jobs$/, jobs, 'Recent jobs'],
  [/^\/jobs\/(.+)$/, job, 'Job'],
  [/^\/dead$/, dead, 'Dead letters'],
  [/^\/playground$/, playground, 'Playground'],
];

const $ = (id) => document.getElementById(id);
const main = $('main');
const banner = $('banner');
let access = null;
let page = null; // the AbortController of the mounted page

function showError(err) {
  const hint = err.status === 401 ? ' — enter an API key above and press Save.' : '';
  banner.textContent = `${err.status ? `Error ${err}` : err.message}${hint}`;
  banner.hidden = false;
}

function clearError() {
  banner.hidden = true;
  banner.textContent = '';
}

function say(message) {
  $('status').textContent = message;
}

async function loadAccess() {
  try {
    access = await api('/v1/access');
    // A key's tenant is a 32-digit hash: its start names it well enough in the header.
    const tenant = access.tenant.length > 16 ? `${access.tenant.slice(0, 12)}…` : access.tenant;
    $('role').textContent = !access.keys ? 'open (no keys configured)'
      : access.role === 'operator' ? 'operator' : `tenant ${tenant}`;
    $('role').title = access.role === 'operator' ? '' : `tenant ${access.tenant}`;
  } catch (err) {
    access = null;
    $('role').textContent = 'unknown';
    showError(err);
  }
}

function route() {
  const path = location.hash.slice(1) || '/overview';
  page?.abort();
  page = new AbortController();
  clearError();
  main.replaceChildren();
  for (const a of document.querySelectorAll('nav a')) {
    const here = path === a.hash.slice(1) || path.startsWith(`${a.hash.slice(1)}/`);
    if (here) a.setAttribute('aria-current', 'page'); else a.removeAttribute('aria-current');
  }
  const found = routes.find(([re]) => re.test(path));
  if (!found) {
    main.append(Object.assign(document.createElement('h1'), { textContent: 'Page not found' }));
    return;
  }
  const [re, view, title] = found;
  const params = path.match(re).slice(1).map(decodeURIComponent);
  document.title = `${title} · llmq console`;
  view.mount(main, { signal: page.signal, params, access, showError, clearError, say });
}

// Theme: follow the system until the user picks one; the CSS does the system part.
const dark = matchMedia('(prefers-color-scheme: dark)');
const themeButton = $('theme');
function applyTheme() {
  const chosen = localStorage.getItem('llmq.theme');
  if (chosen) document.documentElement.dataset.theme = chosen;
  else delete document.documentElement.dataset.theme;
  themeButton.setAttribute('aria-pressed', String((chosen || (dark.matches ? 'dark' : 'light')) === 'dark'));
}
themeButton.addEventListener('click', () => {
  const isDark = themeButton.getAttribute('aria-pressed') === 'true';
  localStorage.setItem('llmq.theme', isDark ? 'light' : 'dark');
  applyTheme();
});
dark.addEventListener('change', applyTheme);
applyTheme();

$('key').value = getKey();
$('key-form').addEventListener('submit', async (event) => {
  event.preventDefault();
  setKey($('key').value.trim());
  say(getKey() ? 'Key saved for this tab.' : 'Key cleared.');
  clearError();
  await loadAccess();
  route(); // the role may have changed what the page shows
});

// The skip link's "#main" would otherwise be taken for a route.
$('skip').addEventListener('click', (event) => {
  event.preventDefault();
  main.focus();
});

window.addEventListener('hashchange', () => {
  say('');
  route();
  main.focus();
});
await loadAccess();
route();
