// One `query()` of the Claude Agent SDK (TypeScript), for tests/e2e/test_agents.py.
//
//   node agent_sdk.mjs '{"prompt": "...", "continue": false, "title": null, "allowedTools": ["Bash"]}'
//
// The SDK runs its bundled Claude Code (the native @anthropic-ai/claude-agent-sdk-<platform>
// package) in the current directory, with this process's environment: ANTHROPIC_BASE_URL,
// ANTHROPIC_API_KEY, ANTHROPIC_CUSTOM_HEADERS (the conversation header) and HOME come from the
// test. `continue: true` continues the newest session of the directory (`--continue`);
// `title` set skips the SDK's automatic title generation. Prints one JSON line: the result
// message's subtype, text and session id; exits 1 when the query did not succeed.
import { query } from "@anthropic-ai/claude-agent-sdk";

const args = JSON.parse(process.argv[2] ?? "{}");
const options = {
  cwd: process.cwd(),
  env: { ...process.env },
  allowedTools: args.allowedTools ?? [],
  settingSources: [],
};
if (args.continue) options.continue = true;
if (args.title) options.title = args.title;

let result = null;
try {
  for await (const message of query({ prompt: args.prompt, options })) {
    if (message.type === "result") result = message;
  }
} catch (error) {
  console.log(JSON.stringify({ subtype: "exception", error: String(error), result: result?.result ?? null }));
  process.exit(1);
}
console.log(JSON.stringify({
  subtype: result?.subtype ?? "none",
  result: result?.result ?? null,
  errors: result?.errors ?? null,
  session_id: result?.session_id ?? null,
}));
process.exit(result?.subtype === "success" && !result?.is_error ? 0 : 1);
