// The official JavaScript SDKs as an app calls them against afmd: OpenAI's `openai`
// (Chat Completions, Completions, Embeddings, Models, Responses, Conversations and the
// SDK's helpers: chat.completions.stream/parse/runTools, responses.stream/parse),
// Anthropic's `@anthropic-ai/sdk` (messages, messages.stream, tools, count_tokens, models,
// messages.parse) and `ollama` (chat, generate, embed, list, show, ps, version, pull,
// abort). Each step's result, or the error the SDK threw, goes into one JSON object printed
// on the last line; tests/server/test_js_sdks.py asserts on it (and on the server's log).
// The SDKs' helpers check what they accumulate (a stream's items, indexes and ids against
// the final object), so a step that returns at all has passed those checks.
// Usage: node js_sdks.mjs BASE_URL
import Anthropic from "@anthropic-ai/sdk";
import { zodOutputFormat } from "@anthropic-ai/sdk/helpers/zod";
import { Ollama } from "ollama";
import OpenAI from "openai";
import { zodResponseFormat } from "openai/helpers/zod";
import { z } from "zod";

const [base] = process.argv.slice(2);
const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: "dummy", maxRetries: 0 });
const anthropic = new Anthropic({ baseURL: base, apiKey: "dummy", maxRetries: 0 });
const ollama = new Ollama({ host: base });

const MODEL = "demo";
const EMBEDDER = "demo-embedding";
const PROMPT = "Name three colours.";
const messages = [{ role: "user", content: PROMPT }];
// Bounded, so that a random-weight model's call ends (it never closes a free string).
const CITY = {
  type: "object",
  properties: { city: { type: "string", maxLength: 8 } },
  required: ["city"],
  additionalProperties: false,
};
const DIGIT = {
  type: "object",
  properties: { n: { type: "integer", minimum: 0, maximum: 9 } },
  required: ["n"],
  additionalProperties: false,
};
const weather = { type: "function", function: { name: "weather", parameters: CITY } };

const out = { openai: {}, anthropic: {}, ollama: {} };

/** Runs one step; a throw is kept as what the SDK made of the answer. */
async function step(group, name, fn) {
  try {
    out[group][name] = await fn();
  } catch (e) {
    out[group][name] = {
      error: {
        class: e?.constructor?.name ?? typeof e,
        name: e?.name ?? null,
        message: String(e?.message ?? e),
        status: e?.status ?? e?.status_code ?? null,
        type: e?.type ?? null,
        body: e?.error ?? null,
        requestID: e?.requestID ?? e?.request_id ?? null,
      },
    };
  }
}

/** Every event of an SDK stream, in order. */
async function drain(stream) {
  const events = [];
  for await (const event of stream) events.push(event);
  return events;
}

async function openaiSteps() {
  const s = (name, fn) => step("openai", name, fn);
  await s("chat", async () => {
    const { data: r, response } = await openai.chat.completions
      .create({ model: MODEL, messages, max_tokens: 8, temperature: 0 }).withResponse();
    return {
      object: r.object, text: r.choices[0].message.content, finish: r.choices[0].finish_reason,
      usage: r.usage, requestID: r._request_id, headers: [...response.headers],
    };
  });
  await s("chat_stream", async () => {
    const chunks = await drain(await openai.chat.completions.create({
      model: MODEL, messages, max_tokens: 8, temperature: 0, stream: true,
      stream_options: { include_usage: true },
    }));
    const last = chunks.at(-1);
    return {
      text: chunks.flatMap((c) => c.choices.map((ch) => ch.delta.content ?? "")).join(""),
      finish: chunks.flatMap((c) => c.choices.map((ch) => ch.finish_reason)).filter(Boolean),
      lastChoices: last.choices.length,
      usage: last.usage,
      ids: [...new Set(chunks.map((c) => c.id))].length,
    };
  });
  await s("chat_helper_stream", async () => {
    const stream = openai.chat.completions.stream({
      model: MODEL, messages, max_tokens: 8, temperature: 0, stream_options: { include_usage: true },
    });
    let deltas = "";
    stream.on("content", (delta) => { deltas += delta; });
    const final = await stream.finalChatCompletion();
    return { deltas, text: final.choices[0].message.content, usage: final.usage };
  });
  await s("chat_tools", async () => {
    const r = await openai.chat.completions.create({
      model: MODEL, messages, max_tokens: 100, tools: [weather], tool_choice: "required",
      parallel_tool_calls: false, reasoning_effort: "none",
    });
    const choice = r.choices[0];
    return { finish: choice.finish_reason, calls: choice.message.tool_calls.map((c) => ({ id: c.id, type: c.type, ...c.function })) };
  });
  await s("chat_json_schema", async () => {
    const r = await openai.chat.completions.create({
      model: MODEL, messages, max_tokens: 60, reasoning_effort: "none",
      response_format: { type: "json_schema", json_schema: { name: "digit", strict: true, schema: DIGIT } },
    });
    return { text: r.choices[0].message.content, finish: r.choices[0].finish_reason };
  });
  await s("chat_parse_zod", async () => {
    const r = await openai.chat.completions.parse({
      model: MODEL, messages, max_tokens: 60, reasoning_effort: "none",
      response_format: zodResponseFormat(z.object({ n: z.number().int().min(0).max(9) }), "digit"),
    });
    return { parsed: r.choices[0].message.parsed, text: r.choices[0].message.content };
  });
  await s("chat_logprobs", async () => {
    const r = await openai.chat.completions.create({
      model: MODEL, messages, max_tokens: 4, temperature: 0, logprobs: true, top_logprobs: 2,
    });
    const choice = r.choices[0];
    return {
      text: choice.message.content,
      tokens: choice.logprobs.content.map((t) => t.token),
      logprobs: choice.logprobs.content.map((t) => t.logprob),
      tops: choice.logprobs.content.map((t) => t.top_logprobs.length),
    };
  });
  await s("chat_run_tools", async () => {
    const called = [];
    const runner = openai.chat.completions.runTools({
      model: MODEL, messages, max_tokens: 100, reasoning_effort: "none", parallel_tool_calls: false,
      tool_choice: { type: "function", function: { name: "weather" } },
      tools: [{
        type: "function",
        function: {
          name: "weather", parameters: CITY, parse: JSON.parse,
          function: async (args) => { called.push(args); return "sunny"; },
        },
      }],
    });
    await runner.done();
    return { called, roles: runner.messages.map((m) => m.role), tool: runner.messages.at(-1) };
  });
  await s("completion", async () => {
    const r = await openai.completions.create({ model: MODEL, prompt: "def f(x):", max_tokens: 8, temperature: 0 });
    return { object: r.object, text: r.choices[0].text, usage: r.usage };
  });
  await s("completion_stream", async () => {
    const chunks = await drain(await openai.completions.create({
      model: MODEL, prompt: "def f(x):", max_tokens: 8, temperature: 0, stream: true,
    }));
    return { text: chunks.map((c) => c.choices[0]?.text ?? "").join("") };
  });
  await s("embeddings", async () => {
    const input = ["sky", "grass"];
    // The SDK asks for base64 unless told otherwise, and decodes it into floats itself.
    const decoded = await openai.embeddings.create({ model: EMBEDDER, input });
    const floats = await openai.embeddings.create({ model: EMBEDDER, input, encoding_format: "float" });
    const base64 = await openai.embeddings.create({ model: EMBEDDER, input, encoding_format: "base64" });
    return {
      decoded: decoded.data.map((d) => d.embedding),
      floats: floats.data.map((d) => d.embedding),
      base64: base64.data.map((d) => d.embedding),
      usage: decoded.usage,
    };
  });
  await s("models", async () => {
    const listed = [];
    for await (const model of openai.models.list()) listed.push(model.id);
    const one = await openai.models.retrieve(MODEL);
    return { listed, one: { id: one.id, object: one.object } };
  });
  await s("model_missing", () => openai.models.retrieve("nope"));
  await s("response", async () => {
    const r = await openai.responses.create({ model: MODEL, input: PROMPT, max_output_tokens: 16, temperature: 0 });
    return { id: r.id, status: r.status, incomplete: r.incomplete_details, text: r.output_text, usage: r.usage };
  });
  await s("response_stream", async () => {
    const events = await drain(await openai.responses.create({
      model: MODEL, input: PROMPT, max_output_tokens: 16, temperature: 0, stream: true,
    }));
    const last = events.at(-1);
    return {
      types: events.map((e) => e.type),
      sequence: events.map((e) => e.sequence_number),
      deltas: events.filter((e) => e.type === "response.output_text.delta").map((e) => e.delta).join(""),
      text: last.response.output[0].content[0].text,
      status: last.response.status,
    };
  });
  await s("response_helper_stream", async () => {
    const stream = openai.responses.stream({ model: MODEL, input: PROMPT, max_output_tokens: 16, temperature: 0 });
    let deltas = "";
    stream.on("response.output_text.delta", (e) => { deltas += e.delta; });
    const final = await stream.finalResponse();
    return { deltas, text: final.output_text, status: final.status };
  });
  await s("response_tools", async () => {
    const tool = { type: "function", name: "weather", parameters: CITY, strict: true };
    const first = await openai.responses.create({
      model: MODEL, input: "Weather in Paris?", max_output_tokens: 100, tools: [tool],
      tool_choice: "required", parallel_tool_calls: false, reasoning: { effort: "none" },
    });
    const call = first.output.find((item) => item.type === "function_call");
    // The call's output goes back on the stored response.
    const second = await openai.responses.create({
      model: MODEL, previous_response_id: first.id, max_output_tokens: 16, tools: [tool],
      input: [{ type: "function_call_output", call_id: call.call_id, output: "sunny" }],
    });
    return {
      status: first.status, types: first.output.map((item) => item.type), call,
      second: { status: second.status, previous: second.previous_response_id, firstId: first.id },
    };
  });
  await s("response_previous", async () => {
    const first = await openai.responses.create({ model: MODEL, input: "Hello.", max_output_tokens: 16 });
    const second = await openai.responses.create({
      model: MODEL, input: "And then?", previous_response_id: first.id, max_output_tokens: 16,
    });
    const items = [];
    for await (const item of openai.responses.inputItems.list(second.id)) items.push(item);
    return {
      previous: second.previous_response_id, firstId: first.id,
      firstInput: first.usage.input_tokens, secondInput: second.usage.input_tokens,
      items: items.map((item) => [item.type, item.role]),
    };
  });
  await s("response_background", async () => {
    const created = await openai.responses.create({
      model: MODEL, input: PROMPT, max_output_tokens: 16, temperature: 0, background: true,
    });
    let got = created;
    for (let i = 0; i < 200 && ["queued", "in_progress"].includes(got.status); i++) {
      await new Promise((resolve) => setTimeout(resolve, 25));
      got = await openai.responses.retrieve(created.id);
    }
    return { created: created.status, background: created.background, status: got.status, text: got.output_text, id: got.id === created.id };
  });
  await s("input_tokens", async () => {
    const counted = await openai.responses.inputTokens.count({ model: MODEL, input: PROMPT });
    return { object: counted.object, input_tokens: counted.input_tokens };
  });
  await s("conversation", async () => {
    const made = await openai.conversations.create({
      items: [{ type: "message", role: "user", content: "Hello." }], metadata: { topic: "js" },
    });
    const answer = await openai.responses.create({
      model: MODEL, conversation: made.id, input: "And then?", max_output_tokens: 16,
    });
    const items = [];
    for await (const item of openai.conversations.items.list(made.id, { order: "asc" })) items.push(item);
    const updated = await openai.conversations.update(made.id, { metadata: { topic: "sdk" } });
    const deleted = await openai.conversations.delete(made.id);
    return {
      object: made.object, metadata: made.metadata, answer: answer.status,
      items: items.map((item) => [item.type, item.role]), answerItem: answer.output.at(-1).id,
      lastItem: items.at(-1).id, updated: updated.metadata, deleted: deleted.deleted,
    };
  });
}

async function anthropicSteps() {
  const s = (name, fn) => step("anthropic", name, fn);
  const tool = { name: "weather", description: "The weather in a city.", input_schema: CITY };
  await s("message", async () => {
    const m = await anthropic.messages.create({ model: MODEL, max_tokens: 8, messages, temperature: 0 });
    return { type: m.type, text: m.content.map((b) => b.text ?? "").join(""), stop: m.stop_reason, usage: m.usage, requestID: m._request_id };
  });
  await s("stream", async () => {
    const events = await drain(await anthropic.messages.create({ model: MODEL, max_tokens: 8, messages, temperature: 0, stream: true }));
    return { types: events.map((e) => e.type) };
  });
  await s("helper_stream", async () => {
    const stream = anthropic.messages.stream({ model: MODEL, max_tokens: 8, messages, temperature: 0 });
    let deltas = "";
    stream.on("text", (delta) => { deltas += delta; });
    const final = await stream.finalMessage();
    return { deltas, text: final.content.map((b) => b.text ?? "").join(""), stop: final.stop_reason, usage: final.usage };
  });
  await s("tools", async () => {
    const m = await anthropic.messages.create({
      model: MODEL, max_tokens: 100, messages, tools: [tool],
      tool_choice: { type: "any", disable_parallel_tool_use: true }, thinking: { type: "disabled" },
    });
    const uses = m.content.filter((b) => b.type === "tool_use");
    const answered = await anthropic.messages.create({
      model: MODEL, max_tokens: 8, tools: [tool],
      messages: [...messages, { role: "assistant", content: m.content },
        { role: "user", content: uses.map((u) => ({ type: "tool_result", tool_use_id: u.id, content: "sunny" })) }],
    });
    return { stop: m.stop_reason, uses, answered: answered.type };
  });
  await s("tools_stream", async () => {
    const stream = anthropic.messages.stream({
      model: MODEL, max_tokens: 100, messages, tools: [tool],
      tool_choice: { type: "tool", name: "weather", disable_parallel_tool_use: true }, thinking: { type: "disabled" },
    });
    let snapshot = null;
    stream.on("inputJson", (_delta, jsonSnapshot) => { snapshot = jsonSnapshot; });
    const final = await stream.finalMessage();
    return { snapshot, input: final.content.find((b) => b.type === "tool_use")?.input, stop: final.stop_reason };
  });
  await s("count_tokens", async () => (await anthropic.messages.countTokens({ model: MODEL, messages })).input_tokens);
  await s("parse_zod", async () => {
    // An enum survives the SDK's schema transform (bounds move into descriptions).
    const m = await anthropic.messages.parse({
      model: MODEL, max_tokens: 60, messages, thinking: { type: "disabled" },
      output_config: { format: zodOutputFormat(z.object({ colour: z.enum(["red", "green", "blue"]) })) },
    });
    return m.parsed_output;
  });
  await s("models", async () => {
    const listed = [];
    for await (const model of anthropic.models.list()) listed.push({ id: model.id, type: model.type, display_name: model.display_name });
    const one = await anthropic.models.retrieve(MODEL);
    return { listed, one: { id: one.id, type: one.type } };
  });
  await s("model_missing", () => anthropic.models.retrieve("nope"));
  await s("abort", async () => {
    // Greedy, so that the answer is known to run past the third delta.
    const stream = anthropic.messages.stream({ model: MODEL, max_tokens: 4000, messages, temperature: 0 });
    let seen = 0;
    stream.on("text", () => { if (++seen === 3) stream.abort(); });
    await stream.finalMessage();
    return { seen };
  });
}

async function ollamaSteps() {
  const s = (name, fn) => step("ollama", name, fn);
  const options = { temperature: 0, num_predict: 8 };
  await s("version", () => ollama.version());
  await s("list", async () => (await ollama.list()).models.map((m) => m.name));
  await s("show", async () => {
    const shown = await ollama.show({ model: MODEL });
    return { capabilities: shown.capabilities, context: shown.model_info["qwen2.context_length"], family: shown.details.family };
  });
  await s("chat", async () => {
    const r = await ollama.chat({ model: MODEL, messages, options });
    return { text: r.message.content, done: r.done, reason: r.done_reason, eval: r.eval_count };
  });
  await s("chat_stream", async () => {
    const parts = await drain(await ollama.chat({ model: `${MODEL}:latest`, messages, options, stream: true }));
    return { text: parts.map((p) => p.message.content).join(""), done: parts.map((p) => p.done) };
  });
  await s("generate", async () => {
    const r = await ollama.generate({ model: MODEL, prompt: "def f(x):", raw: true, options });
    return { text: r.response, done: r.done };
  });
  await s("embed", async () => (await ollama.embed({ model: EMBEDDER, input: ["sky", "grass"] })).embeddings);
  await s("ps", async () => (await ollama.ps()).models.map((m) => m.name));
  await s("chat_missing", () => ollama.chat({ model: "nope", messages }));
  // What Ollama's docs pull: a name in Ollama's library, which afmd cannot pull.
  await s("pull_missing", () => ollama.pull({ model: "llama3.2" }));
  await s("pull_missing_stream", async () => (await drain(await ollama.pull({ model: "llama3.2", stream: true }))).map((p) => p.status));
  await s("abort", async () => {
    const stream = await ollama.chat({ model: MODEL, messages, options: { temperature: 0, num_predict: 4000 }, stream: true });
    let seen = 0;
    for await (const _part of stream) if (++seen === 3) stream.abort();
    return { seen };
  });
}

await openaiSteps();
await anthropicSteps();
await ollamaSteps();
console.log(JSON.stringify(out));
