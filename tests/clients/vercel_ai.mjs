// The Vercel AI SDK against llmtap (tests/clients_vercel_ai.rs): multi-step tool loops (stopWhen) with
// generateText and streamText on OpenAI Responses, OpenAI Chat Completions and Anthropic Messages. Prints one JSON
// object with each run's text, step count and usage. Base URLs and keys come from the environment.
import { generateText, streamText, stepCountIs, tool } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createAnthropic } from "@ai-sdk/anthropic";
import { z } from "zod";

const openai = createOpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: process.env.OPENAI_API_KEY });
const anthropic = createAnthropic({ baseURL: process.env.ANTHROPIC_BASE_URL, apiKey: process.env.ANTHROPIC_API_KEY });

const tools = {
  weather: tool({
    description: "The weather in a city",
    inputSchema: z.object({ city: z.string() }),
    execute: async ({ city }) => `Sunny in ${city}`,
  }),
};

function summary(text, steps, usage) {
  return {
    text,
    steps: steps.length,
    tool_calls: steps.flatMap((s) => s.toolCalls.map((c) => c.toolName)),
    input_tokens: usage.inputTokens,
    output_tokens: usage.outputTokens,
  };
}

async function generate(model, prompt) {
  const r = await generateText({ model, tools, stopWhen: stepCountIs(5), prompt, maxRetries: 0 });
  return summary(r.text, r.steps, r.totalUsage);
}

async function stream(model, prompt) {
  const r = streamText({ model, tools, stopWhen: stepCountIs(5), prompt, maxRetries: 0 });
  for await (const _ of r.textStream) {
    // drain
  }
  return summary(await r.text, await r.steps, await r.totalUsage);
}

const out = {
  responses_generate: await generate(openai("gpt-4o-mini"), "Responses generate: weather in Paris?"),
  chat_stream: await stream(openai.chat("gpt-4o-mini"), "Chat stream: weather in Paris? [[steps:2]]"),
  anthropic_stream: await stream(anthropic("claude-sonnet-4-5"), "Anthropic stream: weather in Paris?"),
  anthropic_generate: await generate(anthropic("claude-sonnet-4-5"), "Anthropic generate: weather in Paris?"),
};
console.log(JSON.stringify(out));
