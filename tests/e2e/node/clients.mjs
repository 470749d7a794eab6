// The OpenAI Node SDK through memproxy: chat completions and the Responses API, twelve turns
// each, streaming included. Run by tests/e2e/test_clients.py with BASE_URL (memproxy's /v1),
// MOCK_URL (the mock's /v1) and CONVERSATION set; exits non-zero on the first failed check.
import assert from "node:assert/strict";
import OpenAI from "openai";

const { BASE_URL, MOCK_URL, CONVERSATION } = process.env;
const FACT = "the locker code is 4417";
const TURNS = 12;
const turnText = (i) => (i === 3 ? FACT : i === TURNS ? "what was the locker code again?" : `turn ${i}: small talk about item ${i}`);

async function lastRequest(path) {
  const response = await fetch(MOCK_URL.replace(/\/v1$/, "") + "/_mock/requests");
  const list = (await response.json()).filter((r) => r.path.endsWith(path));
  assert.ok(list.length > 0, `no request to ${path}`);
  return list[list.length - 1];
}

// Chat completions, the whole history re-sent each turn.
const chatId = `${CONVERSATION}-chat`;
const chat = new OpenAI({ baseURL: BASE_URL, apiKey: "sk-node", maxRetries: 0, defaultHeaders: { "X-Memory-Conversation-Id": chatId } });
const history = [];
let turns;
for (let i = 1; i <= TURNS; i++) {
  history.push({ role: "user", content: turnText(i) });
  const { data, response } = await chat.chat.completions.create({ model: "gpt-4o-mini", messages: history }).withResponse();
  history.push({ role: "assistant", content: data.choices[0].message.content });
  turns = response.headers.get("x-memory-turns");
}
assert.equal(turns, String(2 * TURNS));
assert.ok(JSON.stringify((await lastRequest("/v1/chat/completions")).body.messages).includes(FACT));
let streamed = "";
for await (const chunk of await chat.chat.completions.create({ model: "gpt-4o-mini", messages: [{ role: "user", content: "stream" }], stream: true })) {
  streamed += chunk.choices[0]?.delta?.content ?? "";
}
assert.equal(streamed, "reply to: stream");

// Responses, chained with previous_response_id after the first turn.
const responsesId = `${CONVERSATION}-responses`;
const client = new OpenAI({ baseURL: BASE_URL, apiKey: "sk-node", maxRetries: 0 });
let previous;
for (let i = 1; i <= TURNS; i++) {
  const headers = previous ? {} : { "X-Memory-Conversation-Id": responsesId };
  const { data, response } = await client.responses
    .create({ model: "gpt-4.1", input: turnText(i), previous_response_id: previous }, { headers })
    .withResponse();
  assert.equal(response.headers.get("x-memory-conversation-id"), responsesId);
  turns = response.headers.get("x-memory-turns");
  previous = data.id;
}
assert.equal(turns, String(2 * TURNS));
assert.ok(JSON.stringify((await lastRequest("/v1/responses")).body.input).includes(FACT));
const stream = await client.responses.create({ model: "gpt-4.1", input: "stream it", previous_response_id: previous, stream: true });
let text = "";
let completed;
for await (const event of stream) {
  if (event.type === "response.output_text.delta") text += event.delta;
  if (event.type === "response.completed") completed = event.response;
}
assert.equal(text, "reply to: stream it");
assert.equal(completed.output_text ?? completed.output[0].content[0].text, "reply to: stream it");
console.log("node clients: ok");
