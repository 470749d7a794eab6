// The console's pages: conversations (list, one conversation), what the model saw (a
// receipt), a user's memories, and cost. Each is a function of the view element and the
// route; data is set as text only.
'use strict';

(() => {
  const { api, el, svg, href, query, conversationPath, num, time, contentText } = Console;
  const PARTS = ['instructions', 'summary', 'memories', 'window', 'recalled', 'new'];
  const PART_TITLES = {
    instructions: 'Instructions', summary: 'Summary', memories: 'Long-term memories',
    window: 'Recent window', recalled: 'Recalled older turns', new: 'New messages',
  };
  const MEMORY_TYPES = ['preference', 'profile', 'semantic', 'episodic', 'procedural'];

  const short = (tenant) => (tenant && tenant.length > 12 ? tenant.slice(0, 8) + '…' : tenant);
  const percent = (part, whole) => (whole ? (100 * part / whole).toFixed(1) + ' %' : '–');

  function figure(label, value, note) {
    return el('div', { class: 'figure', 'data-figure': label },
      el('div', { class: 'value' }, value), el('div', { class: 'label' }, label),
      note ? el('div', { class: 'label' }, note) : null);
  }

  function kv(pairs) {
    return el('dl', { class: 'kv' }, pairs.map(([k, v]) => [el('dt', {}, k), el('dd', {}, v)]));
  }

  function table(headers, rows, attrs) {
    return el('table', attrs || {},
      el('thead', {}, el('tr', {}, headers.map((h) => el('th', { class: /^[#≈]|tokens|count|%/i.test(h) ? 'num' : null }, h)))),
      el('tbody', {}, rows.length ? rows : el('tr', {}, el('td', { colspan: headers.length, class: 'empty' }, 'Nothing here.'))));
  }

  function select(name, options, value) {
    return el('select', { name, id: name },
      options.map(([v, label]) => el('option', { value: v, selected: v === value }, label)));
  }

  function labelled(text, input) {
    return el('label', {}, text, input);
  }

  /// The tenants and their agents (`GET /admin/v1/tenants`).
  async function tenants() {
    return (await api('GET', 'tenants')).tenants;
  }

  // ---------------------------------------------------------------- conversations

  Console.pages.conversations = async (view, route) => {
    const p = route.params;
    const filter = {
      tenant: p.get('tenant') || '', agent: p.get('agent') || '', q: p.get('q') || '',
      limit: p.get('limit') || '25',
    };
    const cursor = p.get('cursor') || '';
    const back = p.get('back') ? p.get('back').split(',') : [];
    const known = await tenants();
    const agents = new Set();
    for (const t of known) {
      if (!filter.tenant || t.tenant === filter.tenant) Object.keys(t.agents).forEach((a) => agents.add(a));
    }
    const form = el('form', { class: 'toolbar', id: 'conversation-filter' },
      labelled('Tenant', select('tenant', [['', 'all tenants']].concat(
        known.map((t) => [t.tenant, short(t.tenant) + ' (' + t.conversations + ')'])), filter.tenant)),
      labelled('Agent', select('agent', [['', 'all agents']].concat(
        [...agents].sort().map((a) => [a, a])), filter.agent)),
      labelled('Conversation id contains', el('input', { name: 'q', id: 'q', value: filter.q, placeholder: 'part of an id' })),
      labelled('Per page', select('limit', ['5', '25', '100', '1000'].map((n) => [n, n]), filter.limit)),
      el('button', { type: 'submit', id: 'search' }, 'Show'));
    form.addEventListener('submit', (event) => {
      event.preventDefault();
      const data = new FormData(form);
      location.hash = href('conversations', [], Object.fromEntries(data.entries()));
    });
    form.tenant.addEventListener('change', () => { form.agent.value = ''; form.requestSubmit(); });
    view.append(el('h1', {}, 'Conversations'), form);

    const listing = await api('GET', 'conversations' + query(Object.assign({ cursor }, filter)));
    const rows = listing.conversations.map((c) => el('tr', { 'data-conversation': c.id, 'data-tenant': c.tenant, 'data-agent': c.agent },
      el('td', { class: 'mono', title: c.tenant }, short(c.tenant)),
      el('td', {}, c.agent),
      el('td', {}, el('a', { href: href('conversation', [c.tenant, c.agent, c.id]), class: 'conversation-link' }, c.id)),
      el('td', { class: 'num' }, num(c.message_count)),
      el('td', { class: 'num' }, num(c.total_tokens)),
      el('td', { class: 'num' }, num(c.summary_count)),
      el('td', {}, time(c.last_activity_ms)),
      el('td', {}, c.ttl || '–')));
    view.append(table(['Tenant', 'Agent', 'Conversation', 'Messages', 'Tokens', 'Summaries', 'Last activity', 'TTL'], rows, { id: 'conversations' }));
    const pager = el('div', { class: 'pager' });
    if (back.length) {
      const previous = back.slice(0, -1);
      const to = back[back.length - 1];
      pager.append(el('a', { href: href('conversations', [], Object.assign({}, filter, { cursor: to === '0' ? '' : to, back: previous.join(',') })), id: 'previous-page' }, '← Previous page'));
    }
    if (listing.next_cursor) {
      pager.append(el('a', { href: href('conversations', [], Object.assign({}, filter, { cursor: listing.next_cursor, back: back.concat([cursor || '0']).join(',') })), id: 'next-page' }, 'Next page →'));
    }
    view.append(pager, el('h2', {}, 'Import a conversation'), importForm({}));
  };

  /// The form that imports an export (a file) into a conversation; `into` presets the
  /// address (the file's own address fills what is left empty).
  function importForm(into) {
    const status = el('p', { id: 'import-status', role: 'status' });
    const form = el('form', { class: 'toolbar', id: 'import-form' },
      labelled('Export file', el('input', { type: 'file', name: 'file', id: 'import-file', accept: 'application/json,.json', required: true })),
      labelled('Tenant', el('input', { name: 'tenant', value: into.tenant || '', placeholder: "the file's" })),
      labelled('Agent', el('input', { name: 'agent', value: into.agent || '', placeholder: "the file's" })),
      labelled('Conversation id', el('input', { name: 'id', value: into.id || '', placeholder: "the file's" })),
      labelled('Into another tenant', el('input', { type: 'checkbox', name: 'force' })),
      el('button', { type: 'submit' }, 'Import'));
    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      status.textContent = '';
      try {
        const text = await form.file.files[0].text();
        let export_;
        try { export_ = JSON.parse(text); } catch (_) { throw new Error('the file is not JSON'); }
        const tenant = form.tenant.value.trim() || export_.tenant;
        const agent = form.agent.value.trim() || export_.agent;
        const id = form.id.value.trim() || export_.conversation;
        if (!tenant || !agent || !id) throw new Error('the file names no conversation: fill in tenant, agent and id');
        const done = await api('POST', conversationPath(tenant, agent, id) + '/import' + (form.force.checked ? '?force_tenant=true' : ''), text);
        status.textContent = 'Imported: ' + done.added + ' messages added, ' + done.already_stored + ' already stored, '
          + done.summaries_added + ' summaries, ' + done.branches_added + ' closed branches.';
        setTimeout(() => { location.hash = href('conversation', [tenant, agent, id]); }, 600);
      } catch (err) {
        status.replaceChildren(Console.errorBox(err));
      }
    });
    return el('div', {}, form, status);
  }

  Console.pages.conversation = async (view, route) => {
    const [tenant, agent, id] = route.args;
    const path = conversationPath(tenant, agent, id);
    const [shown, stats, receipts] = await Promise.all([
      api('GET', path), api('GET', path + '/stats'), api('GET', path + '/receipts?limit=10'),
    ]);
    const actions = el('div', { class: 'toolbar' },
      el('button', { type: 'button', id: 'export', onclick: async () => {
        const text = JSON.stringify(await api('GET', path + '/export'), null, 2);
        Console.download(id + '.memproxy.json', text);
      } }, 'Export'),
      el('a', { href: href('cost', [tenant, agent, id]), id: 'cost-link' }, 'Cost chart'),
      el('button', { type: 'button', class: 'danger', id: 'delete-conversation', onclick: async () => {
        const ok = await Console.confirmDelete('Delete conversation ' + id + '?',
          'Its ' + shown.message_count + ' messages, summaries, closed branches and receipts are erased for good (export it first to keep a copy).', id);
        if (!ok) return;
        await api('DELETE', path);
        location.hash = href('conversations', [], { tenant, agent });
      } }, 'Delete…'));
    view.append(
      el('h1', {}, 'Conversation ', el('span', { class: 'mono', id: 'conversation-id' }, id)),
      kv([['Tenant', el('span', { class: 'mono' }, tenant)], ['Agent', agent], ['Created', time(shown.created_ms)],
        ['Last activity', time(shown.last_activity_ms)], ['TTL', shown.ttl || '–']]),
      el('div', { class: 'figures' },
        figure('messages', num(stats.messages.total), num(stats.messages.summarized) + ' summarized'),
        figure('tokens stored', num(stats.tokens.total)),
        figure('summaries', num(stats.summaries)),
        figure('exchanges', num(stats.ledger.exchanges)),
        figure('tokens saved', num(stats.ledger.saved_tokens), percent(stats.ledger.saved_tokens, stats.ledger.history_tokens) + ' of the history')),
      actions);

    view.append(el('h2', {}, 'What the model saw: latest receipts'));
    if (!receipts.receipts_enabled) {
      view.append(el('p', { class: 'muted' }, 'Receipts are off (receipts.enabled = false).'));
    } else {
      view.append(table(['When', 'API', 'Model', 'Prompt tokens', 'History tokens', 'Cached tokens', 'Status', ''],
        receipts.receipts.map((r) => el('tr', { 'data-receipt': r.id },
          el('td', {}, time(r.created_ms)), el('td', {}, r.api), el('td', {}, r.model || '–'),
          el('td', { class: 'num' }, num(r.prompt_tokens)), el('td', { class: 'num' }, num(r.history_tokens)),
          el('td', { class: 'num' }, num(r.cached_tokens)),
          el('td', {}, String(r.status || '–') + (r.memory_status ? ' · memory ' + r.memory_status : '')),
          el('td', {}, el('a', { href: href('receipt', [r.id], { tenant }), class: 'receipt-link' }, 'open')))),
        { id: 'receipts' }),
      el('p', { class: 'muted' }, 'Receipts are kept in memory for ' + ((Console.status && Console.status.receipts.retention_seconds) || '?') + ' s after their exchange.'));
    }

    view.append(el('h2', {}, 'Timeline'), timeline(shown.messages, shown.summaries, 'timeline'));
    if (shown.branches.length) {
      view.append(el('h2', {}, 'Closed branches'));
      for (const branch of shown.branches) {
        view.append(el('details', { class: 'card', 'data-branch': branch.number },
          el('summary', {}, 'Branch ' + branch.number + ': forked after turn ' + branch.forked_after_turn + ', closed '
            + time(branch.closed_ms) + ', ' + branch.messages.length + ' messages'),
          timeline(branch.messages, branch.summaries)));
      }
    }
    view.append(el('h2', {}, 'Import into this conversation'), importForm({ tenant, agent, id }));
  };

  /// Messages in turn order, each summary placed after the last turn it covers.
  function timeline(messages, summaries, id) {
    const records = summaries.map((s) => Object.assign({ number: s.number }, s.record || {}));
    const summarizedTo = Math.max(0, ...records.map((r) => r.to_turn || 0));
    const after = new Map();
    for (const record of records) {
      const at = messages.filter((m) => m.turn <= (record.to_turn || 0)).map((m) => m.turn).pop() || 0;
      if (!after.has(at)) after.set(at, []);
      after.get(at).push(record);
    }
    const list = el('div', { class: 'timeline', id: id || null });
    const summaryCard = (r) => el('div', { class: 'card summary-card', 'data-summary': r.number },
      el('div', { class: 'head' }, el('span', { class: 'role' }, 'Summary ' + r.number),
        el('span', {}, 'covers turns ' + r.from_turn + '–' + r.to_turn),
        el('span', {}, num(r.tokens) + ' tokens (from ' + num(r.original_tokens) + ')'),
        r.heuristic ? el('span', { class: 'tag' }, 'heuristic stand-in') : el('span', {}, r.model || ''),
        el('span', {}, time(r.created_ms))),
      el('pre', {}, r.text || ''));
    (after.get(0) || []).forEach((r) => list.append(summaryCard(r)));
    for (const m of messages) {
      list.append(el('div', { class: 'card turn ' + m.role + (m.turn <= summarizedTo ? ' summarized' : ''), 'data-turn': m.turn },
        el('div', { class: 'head' }, el('span', { class: 'role' }, m.role), el('span', {}, 'turn ' + m.turn),
          el('span', {}, num(m.tokens) + ' tokens'), el('span', {}, time(m.at_ms)),
          m.origin ? el('span', { class: 'tag' }, m.origin) : null,
          m.turn <= summarizedTo ? el('span', { class: 'tag' }, 'summarized') : null),
        el('pre', {}, contentText(m.message))));
      (after.get(m.turn) || []).forEach((r) => list.append(summaryCard(r)));
    }
    if (!messages.length) list.append(el('p', { class: 'empty' }, 'No messages.'));
    return list;
  }

  // ---------------------------------------------------------------- what the model saw

  Console.pages.receipt = async (view, route) => {
    const [id] = route.args;
    const tenant = route.params.get('tenant') || '';
    const receipt = await api('GET', 'receipts/' + encodeURIComponent(id) + query({ tenant }));
    let body = null;
    try { body = JSON.parse(receipt.forwarded.body); } catch (_) { body = null; }
    const prompt = receipt.prompt;
    const up = receipt.upstream || {};
    view.append(
      el('h1', {}, 'What the model saw'),
      kv([['Receipt', el('span', { class: 'mono', id: 'receipt-id' }, receipt.id)],
        ['Conversation', el('a', { href: href('conversation', [receipt.tenant, receipt.agent, receipt.conversation]), id: 'receipt-conversation' },
          receipt.agent + ' / ' + receipt.conversation)],
        ['When', time(receipt.created_ms)], ['API', receipt.api + ' ' + receipt.path], ['Model', receipt.model || '–'],
        ['Upstream', String(up.status || '–') + (up.latency_ms ? ' in ' + Math.round(up.latency_ms) + ' ms' : '') + (up.ended ? ', ' + up.ended : '')],
        ['Memory', (up.memory_status || '–') + (up.memory_reason ? ' (' + up.memory_reason + ')' : '')]]),
      el('div', { class: 'figures' },
        figure('prompt tokens', num(prompt.tokens)),
        figure('history tokens', num(receipt.history_tokens), 'the client\'s history without memproxy'),
        figure('stored messages', num(receipt.stored_messages)),
        up.usage ? figure('cached tokens', num(up.usage.cached_tokens), percent(up.usage.cached_tokens, up.usage.input_tokens) + ' of the input') : null));

    view.append(el('h2', {}, 'Tokens per part'), partsBar(prompt));
    const bodyMessages = receipt.api === 'chat' && body && Array.isArray(body.messages) ? body.messages : null;
    // Each body message found once: the same message twice in the body is two places.
    // Compared with their keys in one order: the receipt's parts are re-serialized JSON.
    const seen = bodyMessages ? { raws: bodyMessages.map(canonical), messages: bodyMessages, used: new Set() } : null;
    const parts = el('div', { id: 'parts' });
    for (const name of PARTS) {
      const part = prompt[name];
      if (!part) continue;
      parts.append(partCard(name, part, seen));
    }
    view.append(el('h2', {}, 'The forwarded prompt, part by part'));
    if (!bodyMessages) {
      view.append(el('p', { class: 'muted' }, 'The ' + receipt.api + ' API\'s body is written from these parts in its own form (see the body below).'));
    }
    view.append(parts);

    view.append(el('h2', {}, 'Budget'), budgetCard(receipt));

    view.append(el('h2', {}, 'Settings in effect'),
      table(['Setting', 'Value'], Object.entries(receipt.settings).map(([k, v]) => el('tr', {}, el('td', { class: 'mono' }, k), el('td', {}, String(v)))), { id: 'settings' }));

    view.append(el('h2', {}, 'Forwarded body'),
      el('p', { class: 'muted' }, num(receipt.forwarded.bytes) + ' bytes · SHA-256 ', el('span', { class: 'mono', id: 'body-sha' }, receipt.forwarded.sha256)),
      el('details', { class: 'card' }, el('summary', {}, 'The body as sent upstream'),
        el('pre', { id: 'forwarded-body' }, body ? JSON.stringify(body, null, 2) : receipt.forwarded.body)));

    view.append(el('h2', {}, 'Replay'), replayForm(receipt));
  };

  /// What `max_context_tokens` did: the verdict, and each recalled and window turn it dropped.
  function budgetCard(receipt) {
    const budget = receipt.budget;
    const dropped = budget.dropped;
    const limit = receipt.settings.max_context_tokens;
    const verdicts = {
      fits: 'the prompt fits', trimmed: 'trimmed to fit', exceeded: 'still over the budget after trimming',
    };
    const card = el('div', { class: 'card', id: 'budget', 'data-verdict': budget.verdict || 'none' },
      kv([['max_context_tokens', limit === undefined ? '–' : String(limit)],
        ['Verdict', budget.verdict ? verdicts[budget.verdict] || budget.verdict : 'no budget set'],
        ['Newest message cut', budget.truncated ? 'yes: its start was cut to fit' : 'no']]));
    if (dropped.recalled.length) {
      card.append(el('h3', {}, 'Recalled turns dropped'), table(['Turn', 'From', 'Score'],
        dropped.recalled.map((d) => el('tr', { 'data-dropped-recalled': d.turn },
          el('td', {}, 'turn ' + d.turn), el('td', { class: 'mono' }, d.conversation || 'this conversation'),
          el('td', { class: 'num' }, d.score.toFixed(3))))));
    }
    if (dropped.window_turns.length) {
      card.append(el('h3', {}, 'Window turns dropped'),
        el('p', { id: 'dropped-window' }, dropped.window_turns.map((t) => el('span', { class: 'tag', 'data-dropped-window': t }, 'turn ' + t)), ' '));
    }
    if (!dropped.recalled.length && !dropped.window_turns.length) card.append(el('p', { class: 'muted' }, 'Nothing was dropped.'));
    return card;
  }

  /// JSON with every object's keys sorted: two values equal as JSON give the same text.
  function canonical(value) {
    if (Array.isArray(value)) return '[' + value.map(canonical).join(',') + ']';
    if (value && typeof value === 'object') {
      return '{' + Object.keys(value).sort().map((k) => JSON.stringify(k) + ':' + canonical(value[k])).join(',') + '}';
    }
    return JSON.stringify(value);
  }

  /// A horizontal bar of the prompt's tokens, one segment per part.
  function partsBar(prompt) {
    const parts = PARTS.filter((n) => prompt[n] && prompt[n].tokens);
    const total = parts.reduce((sum, n) => sum + prompt[n].tokens, 0) || 1;
    const width = 900;
    const chart = svg('svg', { class: 'chart', viewBox: '0 0 ' + width + ' 46', role: 'img', 'aria-label': 'tokens per part', id: 'parts-bar' });
    let x = 0;
    for (const name of parts) {
      const w = width * prompt[name].tokens / total;
      chart.append(svg('rect', { x, y: 8, width: Math.max(w, 1), height: 30, class: 'bar-' + name },
        svg('title', {}, PART_TITLES[name] + ': ' + prompt[name].tokens + ' tokens')));
      x += w;
    }
    const legend = el('div', { class: 'legend' }, parts.map((n) => el('span', {}, el('span', { class: 'swatch ' + n }), PART_TITLES[n] + ' ' + num(prompt[n].tokens))));
    return el('div', {}, chart, legend);
  }

  /// One part of the prompt with its messages (each with its JSON and where it is in the body).
  function partCard(name, part, seen) {
    const card = el('section', { class: 'card part ' + name, 'data-part': name },
      el('div', { class: 'head' }, el('span', { class: 'title' }, PART_TITLES[name]),
        el('span', { 'data-part-tokens': part.tokens }, num(part.tokens) + ' tokens'),
        el('span', {}, part.messages.length + (part.messages.length === 1 ? ' message' : ' messages'))));
    if (name === 'summary' && part.covers) {
      card.append(el('p', { class: 'muted' }, 'Summary ' + part.number + ' covers turns ' + part.covers.from_turn + '–' + part.covers.to_turn
        + (part.heuristic ? ' (heuristic stand-in)' : '')));
    }
    if (name === 'memories' && part.items) {
      card.append(table(['Memory', 'Score', 'Decay'], part.items.map((m) => el('tr', { 'data-memory': m.id },
        el('td', { class: 'mono' }, String(m.id)), el('td', { class: 'num' }, m.score.toFixed(3)), el('td', { class: 'num' }, m.decay.toFixed(3))))));
    }
    if (name === 'recalled') {
      const rows = (part.turns || []).map((t) => el('tr', { 'data-recalled-turn': t.turn },
        el('td', {}, 'turn ' + t.turn), el('td', {}, 'this conversation'), el('td', { class: 'num' }, t.score.toFixed(3)),
        el('td', {}, (part.excerpted || []).includes(t.turn) ? 'excerpt' : 'whole')))
        .concat((part.elsewhere || []).map((t) => el('tr', {},
          el('td', {}, 'turn ' + t.turn), el('td', { class: 'mono' }, t.conversation), el('td', { class: 'num' }, t.score.toFixed(3)), el('td', {}, ''))));
      card.append(table(['Turn', 'From', 'Score', 'Cut'], rows));
    }
    part.messages.forEach((message) => {
      const key = canonical(message);
      const at = seen ? seen.raws.findIndex((r, i) => r === key && !seen.used.has(i)) : -1;
      if (at >= 0) seen.used.add(at);
      // Found in the body: shown as the body has it (its own key order).
      const raw = JSON.stringify(at >= 0 ? seen.messages[at] : message);
      card.append(el('div', { class: 'message', 'data-message': '' },
        el('div', { class: 'head' }, el('span', { class: 'role' }, message.role || ''),
          seen ? el('span', { class: 'match ' + (at >= 0 ? 'ok' : 'no'), 'data-body-index': at },
            at >= 0 ? 'body message #' + (at + 1) : 'not in the body') : null),
        el('pre', {}, contentText(message)),
        el('details', {}, el('summary', {}, 'JSON'), el('pre', { class: 'raw', 'data-raw': '' }, raw))));
    });
    return card;
  }

  function replayForm(receipt) {
    const result = el('div', { id: 'replay-result' });
    const form = el('form', { class: 'toolbar', id: 'replay-form' },
      labelled('Client credential (only when memproxy holds no upstream key)',
        el('input', { name: 'credential', type: 'password', autocomplete: 'off', placeholder: 'Bearer sk-…' })),
      el('button', { type: 'submit', id: 'replay' }, 'Replay this body upstream'));
    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      result.replaceChildren(el('p', { class: 'muted' }, 'Sending…'));
      const headers = form.credential.value ? { 'X-Memory-Upstream-Authorization': form.credential.value } : {};
      try {
        const response = await fetch('/admin/v1/receipts/' + encodeURIComponent(receipt.id) + '/replay', {
          method: 'POST', credentials: 'omit', cache: 'no-store',
          headers: Object.assign({ Authorization: 'Bearer ' + sessionStorage.getItem('memproxy.admin_token') }, headers),
        });
        const text = await response.text();
        if (response.status === 401) { Console.render(); return; }
        result.replaceChildren(el('p', {}, 'Upstream answered ' + response.status + ' (nothing stored).'),
          el('pre', { class: 'card', id: 'replay-answer' }, text));
      } catch (err) {
        result.replaceChildren(Console.errorBox(err));
      }
    });
    return el('div', {}, el('p', { class: 'muted' }, 'Sends the same bytes to the same API again and shows the answer; nothing is stored.'), form, result);
  }

  // ---------------------------------------------------------------- a user's memories

  Console.pages.memories = async (view, route) => {
    const p = route.params;
    const tenant = p.get('tenant') || '';
    const user = p.get('user') || '';
    const q = p.get('q') || '';
    const known = await tenants();
    const form = el('form', { class: 'toolbar', id: 'memory-filter' },
      labelled('Tenant', select('tenant', [['', 'choose a tenant']].concat(known.map((t) => [t.tenant, short(t.tenant)])), tenant)),
      labelled('User id', el('input', { name: 'user', id: 'user', value: user, required: true })),
      labelled('Search', el('input', { name: 'q', id: 'memory-q', value: q, placeholder: 'ranked as a prompt would' })),
      el('button', { type: 'submit', id: 'memory-show' }, 'Show'));
    form.addEventListener('submit', (event) => {
      event.preventDefault();
      location.hash = href('memories', [], { tenant: form.tenant.value, user: form.user.value.trim(), q: form.q.value.trim() });
    });
    view.append(el('h1', {}, 'A user\'s memories'), form);
    if (!tenant || !user) {
      view.append(el('p', { class: 'muted' }, 'Choose a tenant and type a user id (the X-Memory-User-Id of their requests).'));
      return;
    }
    const base = 'users/' + encodeURIComponent(tenant) + '/' + encodeURIComponent(user);
    let listed;
    try {
      listed = await api('GET', base + '/memories' + (q ? '?q=' + encodeURIComponent(q).replace(/%20/g, '+') : ''));
    } catch (err) {
      if (err.status !== 404) throw err;
      view.append(el('p', { class: 'empty', id: 'no-memories' }, 'No memories of user ' + user + ' in this tenant.'));
      listed = { memories: [] };
    }
    const memories = listed.memories.map((m) => (m.memory ? Object.assign({ score: m.score, decay: m.decay }, m.memory) : m));
    const list = el('div', { id: 'memories' });
    memories.forEach((m) => list.append(memoryCard(base, m)));
    if (listed.memories.length || !q) {
      view.append(el('h2', {}, (q ? 'Found for “' + q + '”: ' : '') + memories.length + ' memories'), list);
    }
    view.append(el('h2', {}, 'Add a memory'), memoryForm(null, async (fields) => {
      await api('POST', base + '/memories', fields);
      Console.render();
    }));
    view.append(el('h2', {}, 'Delete the user'),
      el('p', { class: 'muted' }, 'Erases every conversation of the user, their archive and memories.'),
      el('button', { type: 'button', class: 'danger', id: 'delete-user', onclick: async () => {
        const ok = await Console.confirmDelete('Delete user ' + user + '?', 'Every conversation of the user, their archive and their memories are erased for good.', user);
        if (!ok) return;
        const done = await api('DELETE', base);
        view.replaceChildren(el('h1', {}, 'A user\'s memories'), el('p', { id: 'user-deleted' }, 'User ' + user + ' deleted (' + done.deleted_conversations + ' conversations).'));
      } }, 'Delete user…'));
  };

  function memoryCard(base, m) {
    const card = el('div', { class: 'card', 'data-memory-id': m.id });
    // Unlike `el`, the DOM's own replaceChildren would write a null as the text "null".
    const show = () => {
      card.replaceChildren(...[
        el('div', { class: 'head' },
          el('span', { class: 'tag' }, m.type), el('span', { class: 'tag' }, m.scope),
          el('span', {}, 'importance ' + m.importance.toFixed(2)), el('span', {}, 'confidence ' + m.confidence.toFixed(2)),
          m.decay !== undefined ? el('span', {}, 'decay ' + m.decay.toFixed(3)) : null,
          m.score !== undefined ? el('span', {}, 'score ' + m.score.toFixed(3)) : null,
          el('span', {}, 'v' + m.version), el('span', {}, m.source), el('span', {}, 'updated ' + time(m.updated_ms)),
          el('span', { class: 'mono muted' }, '#' + m.id)),
        el('p', { class: 'memory-text' }, m.text),
        m.tags && m.tags.length ? el('p', { class: 'muted' }, 'tags: ' + m.tags.join(', ')) : null,
        m.history && m.history.length ? el('details', { class: 'history' }, el('summary', {}, m.history.length + ' earlier versions'),
          el('ol', {}, m.history.map((h) => el('li', {}, 'v' + h.version + ' (' + h.source + ', ' + time(h.updated_ms) + '): ', el('span', {}, h.text))))) : null,
        m.conversation ? el('p', { class: 'muted' }, 'learned from ' + m.conversation + (m.source_turns.length ? ', turns ' + m.source_turns.join(', ') : '')) : null,
        el('div', { class: 'toolbar' },
          el('button', { type: 'button', class: 'quiet edit-memory', onclick: edit }, 'Edit'),
          el('button', { type: 'button', class: 'danger delete-memory', onclick: remove }, 'Delete…')),
      ].filter(Boolean));
    };
    const edit = () => {
      card.replaceChildren(memoryForm(m, async (fields) => {
        Object.assign(m, await api('PATCH', base + '/memories/' + m.id, fields));
        show();
      }, show));
    };
    const remove = async () => {
      if (!await Console.confirmDelete('Delete memory #' + m.id + '?', m.text)) return;
      await api('DELETE', base + '/memories/' + m.id);
      card.remove();
    };
    show();
    return card;
  }

  /// The form of a new memory, or of a correction of `m`.
  function memoryForm(m, save, cancel) {
    const status = el('p', { role: 'status' });
    const form = el('form', { class: 'memory-form' },
      el('label', {}, 'Text', el('textarea', { name: 'text', required: true }, m ? m.text : '')),
      el('div', { class: 'toolbar' },
        labelled('Type', select('type', MEMORY_TYPES.map((t) => [t, t]), m ? m.type : 'preference')),
        labelled('Importance', el('input', { name: 'importance', type: 'number', min: 0, max: 1, step: 0.05, value: m ? m.importance : 0.7 })),
        el('button', { type: 'submit', class: 'save-memory' }, m ? 'Save correction' : 'Add memory'),
        cancel ? el('button', { type: 'button', class: 'quiet', onclick: cancel }, 'Cancel') : null));
    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      try {
        await save({ text: form.text.value, type: form.type.value, importance: Number(form.importance.value) });
      } catch (err) {
        status.replaceChildren(Console.errorBox(err));
      }
    });
    return el('div', { class: 'card' }, form, status);
  }

  // ---------------------------------------------------------------- cost

  Console.pages.cost = async (view, route) => {
    if (route.args.length === 3) return conversationCost(view, route.args);
    const known = await tenants();
    const tenant = route.params.get('tenant') || (known[0] && known[0].tenant) || '';
    const form = el('form', { class: 'toolbar', id: 'cost-filter' },
      labelled('Tenant', select('tenant', known.map((t) => [t.tenant, short(t.tenant) + ' (' + t.conversations + ')']), tenant)));
    form.tenant.addEventListener('change', () => { location.hash = href('cost', [], { tenant: form.tenant.value }); });
    view.append(el('h1', {}, 'Cost'), form);
    if (!tenant) {
      view.append(el('p', { class: 'empty' }, 'No conversations are stored yet.'));
      return;
    }
    const stats = await api('GET', 'tenants/' + encodeURIComponent(tenant) + '/stats');
    view.append(el('p', { class: 'muted' }, num(stats.conversations) + ' conversations of tenant ', el('span', { class: 'mono' }, tenant)),
      ledgerFigures(stats.ledger));
    const agents = Object.entries(stats.agents);
    view.append(el('h2', {}, 'Per agent'), agentBars(agents),
      table(['Agent', 'Exchanges', 'History tokens', 'Forwarded tokens', 'Saved tokens', 'Cached tokens', 'Background tokens'],
        agents.map(([agent, l]) => el('tr', { 'data-agent': agent }, el('td', {}, agent), el('td', { class: 'num' }, num(l.exchanges)),
          el('td', { class: 'num' }, num(l.history_tokens)), el('td', { class: 'num' }, num(l.forwarded_tokens)),
          el('td', { class: 'num' }, num(l.saved_tokens)), el('td', { class: 'num' }, num(l.cached_tokens)),
          el('td', { class: 'num' }, num(l.background_tokens)))), { id: 'agents' }));
  };

  function ledgerFigures(l) {
    const net = l.history_tokens - l.forwarded_tokens - l.background_tokens;
    return el('div', { class: 'figures', id: 'ledger' },
      figure('exchanges', num(l.exchanges)),
      figure('history tokens', num(l.history_tokens), 'what the clients\' histories would have sent'),
      figure('forwarded tokens', num(l.forwarded_tokens)),
      figure('cached tokens', num(l.cached_tokens), percent(l.cached_tokens, l.forwarded_tokens) + ' of forwarded'),
      figure('background tokens', num(l.background_tokens), 'summaries and extraction'),
      figure('saved tokens', num(l.saved_tokens), percent(l.saved_tokens, l.history_tokens) + ' of the history; net of background ' + num(net)));
  }

  /// Bars per agent: history, forwarded and cached tokens side by side.
  function agentBars(agents) {
    const max = Math.max(1, ...agents.map(([, l]) => l.history_tokens), ...agents.map(([, l]) => l.forwarded_tokens));
    const rowHeight = 34;
    const width = 900;
    const left = 140;
    const chart = svg('svg', { class: 'chart', viewBox: '0 0 ' + width + ' ' + (agents.length * rowHeight + 16), id: 'agent-chart', role: 'img', 'aria-label': 'tokens per agent' });
    agents.forEach(([agent, l], i) => {
      const y = 8 + i * rowHeight;
      const scale = (n) => Math.max(1, (width - left - 20) * n / max);
      chart.append(svg('text', { x: 6, y: y + 18 }, agent),
        svg('rect', { x: left, y, width: scale(l.history_tokens), height: 9, class: 'bar-history' }, svg('title', {}, 'history ' + l.history_tokens)),
        svg('rect', { x: left, y: y + 10, width: scale(l.forwarded_tokens), height: 9, class: 'bar-forwarded' }, svg('title', {}, 'forwarded ' + l.forwarded_tokens)),
        svg('rect', { x: left, y: y + 20, width: scale(l.cached_tokens), height: 9, class: 'bar-cached' }, svg('title', {}, 'cached ' + l.cached_tokens)));
    });
    return el('div', {}, chart, legend());
  }

  function legend() {
    return el('div', { class: 'legend' },
      el('span', {}, el('span', { class: 'swatch history' }), 'the client\'s history'),
      el('span', {}, el('span', { class: 'swatch forwarded' }), 'forwarded prompt'),
      el('span', {}, el('span', { class: 'swatch cached' }), 'cached by the provider'));
  }

  async function conversationCost(view, [tenant, agent, id]) {
    const stats = await api('GET', conversationPath(tenant, agent, id) + '/stats');
    view.append(el('h1', {}, 'Cost of ', el('a', { href: href('conversation', [tenant, agent, id]) }, id)),
      ledgerFigures(stats.ledger),
      el('h2', {}, 'Prompt tokens per exchange'), exchangeChart(stats.exchanges),
      table(['Turn', 'When', 'History tokens', 'Forwarded tokens', 'Cached tokens', 'Cached %'],
        stats.exchanges.map((e) => el('tr', { 'data-exchange-turn': e.turn }, el('td', {}, String(e.turn)), el('td', {}, time(e.at_ms)),
          el('td', { class: 'num' }, num(e.history_tokens)), el('td', { class: 'num' }, num(e.forwarded_tokens)),
          el('td', { class: 'num' }, num(e.cached_tokens)), el('td', { class: 'num' }, percent(e.cached_tokens, e.forwarded_tokens)))),
        { id: 'exchanges' }),
      el('p', { class: 'muted' }, 'The newest 100 exchanges are kept with the conversation; the totals above cover all of them.'));
  }

  /// Lines of the history and forwarded tokens per exchange, the cached share as an area.
  function exchangeChart(points) {
    const width = 900, height = 300, left = 60, right = 16, top = 14, bottom = 34;
    const chart = svg('svg', { class: 'chart', viewBox: '0 0 ' + width + ' ' + height, id: 'exchange-chart', role: 'img', 'aria-label': 'prompt tokens per exchange' });
    if (!points.length) {
      chart.append(svg('text', { x: width / 2 - 60, y: height / 2 }, 'No exchange stored yet.'));
      return chart;
    }
    const max = Math.max(1, ...points.map((p) => Math.max(p.history_tokens, p.forwarded_tokens)));
    const x = (i) => left + (points.length === 1 ? (width - left - right) / 2 : i * (width - left - right) / (points.length - 1));
    const y = (n) => top + (height - top - bottom) * (1 - n / max);
    for (let k = 0; k <= 4; k++) {
      const value = Math.round(max * k / 4);
      chart.append(svg('line', { x1: left, x2: width - right, y1: y(value), y2: y(value), class: 'grid' }),
        svg('text', { x: 4, y: y(value) + 4 }, num(value)));
    }
    const line = (field) => points.map((p, i) => (i ? 'L' : 'M') + x(i).toFixed(1) + ' ' + y(p[field]).toFixed(1)).join(' ');
    const area = line('cached_tokens') + ' L' + x(points.length - 1).toFixed(1) + ' ' + y(0) + ' L' + x(0).toFixed(1) + ' ' + y(0) + ' Z';
    chart.append(svg('path', { d: area, class: 'area-cached' }),
      svg('path', { d: line('history_tokens'), class: 'line-history', 'data-series': 'history' }),
      svg('path', { d: line('forwarded_tokens'), class: 'line-forwarded', 'data-series': 'forwarded' }));
    points.forEach((p, i) => {
      chart.append(svg('circle', { cx: x(i), cy: y(p.forwarded_tokens), r: 3, class: 'bar-forwarded', 'data-point': p.turn },
        svg('title', {}, 'turn ' + p.turn + ': forwarded ' + p.forwarded_tokens + ', history ' + p.history_tokens + ', cached ' + p.cached_tokens)));
      if (points.length <= 30 || i % Math.ceil(points.length / 30) === 0) {
        chart.append(svg('text', { x: x(i) - 6, y: height - 12 }, String(p.turn)));
      }
    });
    return el('div', {}, chart, legend());
  }
})();
