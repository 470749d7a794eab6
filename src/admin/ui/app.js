// The memproxy console's core: the admin token, the admin API client, the router, and the
// helpers that build elements. Every string that comes from the store is set as text
// (textContent or an attribute), never parsed as HTML.
'use strict';

const Console = (() => {
  const TOKEN_KEY = 'memproxy.admin_token';
  const API = '/admin/v1/';
  const SVG_NS = 'http://www.w3.org/2000/svg';

  /// An error of the admin API: its status and its message.
  class ApiError extends Error {
    constructor(status, message, code) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  const token = {
    get: () => sessionStorage.getItem(TOKEN_KEY),
    set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
    forget: () => sessionStorage.removeItem(TOKEN_KEY),
  };

  /// Builds an element: `attrs` are attributes (`class`, `data-*`, `href`...), or `on*`
  /// handlers; children are nodes or strings (set as text).
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }

  /// An SVG element with its attributes.
  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }

  function setAttrs(node, attrs) {
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name.startsWith('on') && typeof value === 'function') {
        node.addEventListener(name.slice(2), value);
      } else {
        node.setAttribute(name, value === true ? '' : String(value));
      }
    }
  }

  function append(node, children) {
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }

  /// Calls the admin API. `body` is sent as JSON (or as given when a string); a 401 forgets
  /// the token and shows the token form.
  async function api(method, path, body, headers) {
    const current = token.get();
    if (!current) {
      showLogin('');
      throw new ApiError(401, 'no admin token', 'invalid_admin_token');
    }
    const init = {
      method,
      headers: Object.assign({ Authorization: 'Bearer ' + current }, headers || {}),
      credentials: 'omit',
      cache: 'no-store',
      redirect: 'error',
    };
    if (body !== undefined) {
      init.headers['Content-Type'] = 'application/json';
      init.body = typeof body === 'string' ? body : JSON.stringify(body);
    }
    const response = await fetch(API + path, init);
    const text = await response.text();
    let value = null;
    try {
      value = text ? JSON.parse(text) : null;
    } catch (_) {
      value = null;
    }
    if (response.status === 401) {
      token.forget();
      showLogin('The admin token was refused (401). Enter it again.');
      throw new ApiError(401, 'the admin token was refused', 'invalid_admin_token');
    }
    if (!response.ok) {
      const error = (value && value.error) || {};
      const apiError = new ApiError(response.status, error.message || response.statusText, error.code);
      if (response.status === 503) showBanner('The store is unavailable: ' + apiError.message, true);
      throw apiError;
    }
    return value;
  }

  /// The path of a conversation's admin route.
  function conversationPath(tenant, agent, id) {
    return 'conversations/' + [tenant, agent, id].map(encodeURIComponent).join('/');
  }

  /// A query string of the pairs whose value is set.
  function query(pairs) {
    const parts = Object.entries(pairs)
      .filter(([, v]) => v !== undefined && v !== null && v !== '')
      .map(([k, v]) => encodeURIComponent(k) + '=' + encodeURIComponent(v));
    return parts.length ? '?' + parts.join('&') : '';
  }

  /// The route in the location's hash: `#/page/a/b?x=1` → {page, args, params}.
  function currentRoute() {
    const hash = location.hash.replace(/^#\/?/, '');
    const [path, search] = hash.split('?');
    const segments = (path || 'conversations').split('/').map(decodeURIComponent);
    return {
      page: segments[0] || 'conversations',
      args: segments.slice(1),
      params: new URLSearchParams(search || ''),
    };
  }

  /// A link to a console route.
  function href(page, args, params) {
    const path = [page].concat((args || []).map(encodeURIComponent)).join('/');
    return '#/' + path + query(params || {});
  }

  const pages = {};
  let rendering = 0;

  /// Renders the page the hash names, after the status check; without a token, the token
  /// form only.
  async function render() {
    const main = document.getElementById('main');
    if (!token.get()) {
      main.replaceChildren();
      showLogin('');
      return;
    }
    hideLogin();
    const route = currentRoute();
    for (const link of document.querySelectorAll('#nav a')) {
      link.classList.toggle('active', link.dataset.page === route.page
        || (route.page === 'conversation' && link.dataset.page === 'conversations')
        || (route.page === 'receipt' && link.dataset.page === 'conversations'));
    }
    const ticket = ++rendering;
    const view = el('div', { id: 'view', 'data-page': route.page });
    main.replaceChildren(view);
    try {
      await refreshStatus();
      const page = pages[route.page];
      if (!page) throw new ApiError(404, 'no console page ' + route.page);
      await page(view, route);
      if (ticket === rendering) view.setAttribute('data-ready', 'true');
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) {
        main.replaceChildren();
        return;
      }
      view.append(errorBox(err));
      view.setAttribute('data-ready', 'error');
    }
  }

  /// Reads `/admin/v1/status`: the engine's badge, and a banner when memory is degraded or
  /// the store unavailable.
  async function refreshStatus() {
    const status = await api('GET', 'status');
    const badge = document.getElementById('store-badge');
    badge.textContent = 'store: ' + status.storage + (status.store.available ? '' : ' (unavailable)');
    badge.classList.toggle('bad', !status.store.available);
    badge.hidden = false;
    document.getElementById('forget-token').hidden = false;
    if (!status.store.available) {
      showBanner('The store is unavailable: ' + (status.store.reason || 'no reason given')
        + '. Chat requests are forwarded without memory; what the console shows may be missing.', true);
    } else if (status.memory === 'degraded') {
      showBanner('Memory is degraded: memproxy is at its memory high-water mark (server.memory_budget), '
        + 'so new chat requests are forwarded without memory until it is under it again.', false);
    } else {
      hideBanner();
    }
    Console.status = status;
    return status;
  }

  function showBanner(text, bad) {
    const banner = document.getElementById('banner');
    banner.textContent = text;
    banner.classList.toggle('bad', !!bad);
    banner.hidden = false;
  }

  function hideBanner() {
    document.getElementById('banner').hidden = true;
  }

  function showLogin(message) {
    document.getElementById('main').replaceChildren();
    document.getElementById('login').hidden = false;
    document.getElementById('login-error').textContent = message || '';
    document.getElementById('store-badge').hidden = true;
    document.getElementById('forget-token').hidden = true;
    hideBanner();
  }

  function hideLogin() {
    document.getElementById('login').hidden = true;
  }

  function errorBox(err) {
    const status = err instanceof ApiError ? ' (' + err.status + ')' : '';
    return el('div', { class: 'card error', role: 'alert', 'data-error': err.status || 'client' },
      (err.message || String(err)) + status);
  }

  /// Asks to confirm a delete in the page's dialog; with `typed`, the text the operator must
  /// type first. Resolves true when confirmed.
  function confirmDelete(title, text, typed) {
    const dialog = document.getElementById('confirm');
    const input = document.getElementById('confirm-typed');
    const label = document.getElementById('confirm-typed-label');
    const ok = document.getElementById('confirm-ok');
    document.getElementById('confirm-title').textContent = title;
    document.getElementById('confirm-text').textContent = text;
    input.value = '';
    input.hidden = label.hidden = !typed;
    label.textContent = typed ? 'Type ' + typed + ' to confirm' : '';
    ok.disabled = !!typed;
    input.oninput = () => { ok.disabled = input.value !== typed; };
    return new Promise((resolve) => {
      const done = (answer) => {
        ok.onclick = null;
        document.getElementById('confirm-cancel').onclick = null;
        dialog.onclose = null;
        if (dialog.open) dialog.close();
        resolve(answer);
      };
      ok.onclick = () => done(true);
      document.getElementById('confirm-cancel').onclick = () => done(false);
      dialog.onclose = () => done(false);
      dialog.showModal();
      (typed ? input : ok).focus();
    });
  }

  /// A number with thousands separators.
  function num(n) {
    return n === null || n === undefined ? '–' : Number(n).toLocaleString('en-US');
  }

  function time(ms) {
    return ms ? new Date(ms).toISOString().replace('T', ' ').replace(/\.\d+Z$/, ' UTC') : '–';
  }

  /// A message's content as text: a string, the text of its parts, or its JSON.
  function contentText(message) {
    if (!message || typeof message !== 'object') return String(message);
    const content = message.content;
    if (typeof content === 'string') return content;
    if (Array.isArray(content)) {
      return content.map((part) => (part && typeof part.text === 'string') ? part.text : JSON.stringify(part)).join('\n');
    }
    if (message.tool_calls) return JSON.stringify(message.tool_calls, null, 1);
    return content === null || content === undefined ? '' : JSON.stringify(content);
  }

  /// Saves `text` as a file the browser downloads.
  function download(name, text) {
    const url = URL.createObjectURL(new Blob([text], { type: 'application/json' }));
    const link = el('a', { href: url, download: name, class: 'hidden' });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  function start() {
    document.getElementById('login-form').addEventListener('submit', (event) => {
      event.preventDefault();
      const input = document.getElementById('token-input');
      const value = input.value.trim();
      input.value = '';
      if (!value) return;
      token.set(value);
      render();
    });
    document.getElementById('forget-token').addEventListener('click', () => {
      token.forget();
      showLogin('The token was forgotten.');
    });
    window.addEventListener('hashchange', render);
    render();
  }

  return {
    ApiError, api, el, svg, pages, render, href, query, currentRoute, conversationPath,
    confirmDelete, num, time, contentText, download, errorBox, showBanner, start, status: null,
  };
})();

document.addEventListener('DOMContentLoaded', () => Console.start());
