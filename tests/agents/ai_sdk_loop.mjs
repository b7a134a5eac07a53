// A two-step tool loop with the AI SDK's default OpenAI provider (`openai(model)`: the
// Responses API, responses stored), as an app built on it runs against afmd: step 1 must
// call the tool, step 2 answers with its result (sent back as item references to what
// afmd stored, and the call's output). Prints one JSON line: the steps' finish reasons.
// Usage: node ai_sdk_loop.mjs BASE_URL MODEL
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, jsonSchema, stepCountIs, tool } from "ai";

const [baseURL, modelId] = process.argv.slice(2);
const openai = createOpenAI({ baseURL, apiKey: "dummy" });
const calls = [];
const result = await generateText({
  model: openai(modelId),
  prompt: "Add 2 and 3 with the tool.",
  maxOutputTokens: 64,
  tools: {
    add: tool({
      description: "Add two small integers.",
      inputSchema: jsonSchema({
        type: "object",
        additionalProperties: false,
        required: ["a", "b"],
        properties: {
          a: { type: "integer", minimum: 0, maximum: 9 },
          b: { type: "integer", minimum: 0, maximum: 9 },
        },
      }),
      execute: async ({ a, b }) => {
        calls.push([a, b]);
        return String(a + b);
      },
    }),
  },
  providerOptions: { openai: { parallelToolCalls: false } },
  stopWhen: stepCountIs(2),
  prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? "required" : "none" }),
});
console.log(JSON.stringify({
  steps: result.steps.map((step) => step.finishReason),
  calls,
  text: result.text,
}));
