"""Official provider SDKs as llmtap clients. Configured only through the environment, as a user would:
OPENAI_BASE_URL / ANTHROPIC_BASE_URL point at llmtap. Prints one JSON object with what each call returned.

The replaying test upstream is told which recording to serve via a default header (x-replay-fixture);
llmtap forwards it like any other client header.
"""
import json
import sys

import anthropic
import openai


def fixture_headers(name):
    return {"x-replay-fixture": name}


def openai_chat_nonstream():
    c = openai.OpenAI(default_headers=fixture_headers("openai_chat/openllmetry__chat_basic_gzip"))
    r = c.chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "Tell me a joke about opentelemetry"}])
    return {"content": r.choices[0].message.content, "id": r.id, "total_tokens": r.usage.total_tokens}


def openai_chat_stream():
    c = openai.OpenAI(default_headers=fixture_headers("openai_chat/openllmetry__tool_call_stream"))
    stream = c.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "What's the weather like in San Francisco?"}],
        tools=[{"type": "function", "function": {"name": "get_current_weather", "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}],
        stream=True,
    )
    args, name, chunks = "", None, 0
    for chunk in stream:
        chunks += 1
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    name = tc.function.name
                if tc.function and tc.function.arguments:
                    args += tc.function.arguments
    return {"tool": name, "arguments": json.loads(args), "chunks": chunks}


def openai_responses_stream():
    c = openai.OpenAI(default_headers=fixture_headers("openai_responses/simonw-llm__basic_streaming"))
    text = ""
    with c.responses.stream(model="gpt-4o-mini", input="Say hello") as s:
        for event in s:
            if event.type == "response.output_text.delta":
                text += event.delta
        final = s.get_final_response()
    return {"text": text, "final_text": final.output_text, "id": final.id}


def anthropic_nonstream():
    c = anthropic.Anthropic(default_headers=fixture_headers("anthropic_messages/pydantic-ai__parallel_tool_use/00"))
    m = c.messages.create(model="claude-sonnet-4-5", max_tokens=1024, messages=[{"role": "user", "content": "Use the tools"}])
    return {"tools": [b.name for b in m.content if b.type == "tool_use"], "stop_reason": m.stop_reason, "id": m.id}


def anthropic_stream():
    c = anthropic.Anthropic(default_headers=fixture_headers("anthropic_messages/pydantic-ai__thinking_stream"))
    with c.messages.stream(
        model="claude-sonnet-4-20250514",
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "How do I cross the street?"}],
    ) as s:
        final = s.get_final_message()
    text = "".join(b.text for b in final.content if b.type == "text")
    thinking = "".join(b.thinking for b in final.content if b.type == "thinking")
    return {"text": text, "thinking": thinking, "output_tokens": final.usage.output_tokens, "id": final.id}


CASES = {f.__name__: f for f in [openai_chat_nonstream, openai_chat_stream, openai_responses_stream, anthropic_nonstream, anthropic_stream]}

if __name__ == "__main__":
    out = {}
    for name in sys.argv[1:] or CASES:
        out[name] = CASES[name]()
    print(json.dumps(out))
