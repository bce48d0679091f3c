"""The official OpenAI and Anthropic SDKs with their base URLs untouched (the providers' own hosts), reaching
llmtap only through HTTPS_PROXY and trusting its CA through SSL_CERT_FILE, as `llmtap run` sets them. Prints one
JSON object with what each call returned (the scripted upstream answers in place of the providers)."""
import json
import os

import anthropic
import openai

for var in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL"):
    assert var not in os.environ, f"{var} must stay unset: the forward mode keeps the base URL"

out = {}
oa = openai.OpenAI(max_retries=0)
assert str(oa.base_url).startswith("https://api.openai.com/"), oa.base_url
r = oa.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Say hi"}])
out["openai_chat"] = {"content": r.choices[0].message.content, "total_tokens": r.usage.total_tokens}
text = ""
with oa.responses.stream(model="gpt-4o-mini", input="Say hello") as s:
    for event in s:
        if event.type == "response.output_text.delta":
            text += event.delta
    final = s.get_final_response()
out["openai_responses_stream"] = {"text": text, "final_text": final.output_text}

an = anthropic.Anthropic(max_retries=0)
assert str(an.base_url).startswith("https://api.anthropic.com"), an.base_url
m = an.messages.create(model="claude-sonnet-4-5", max_tokens=256, messages=[{"role": "user", "content": "Say hi"}])
out["anthropic"] = {"text": "".join(b.text for b in m.content if b.type == "text"), "output_tokens": m.usage.output_tokens}
with an.messages.stream(model="claude-sonnet-4-5", max_tokens=256, messages=[{"role": "user", "content": "Say hi again"}]) as s:
    streamed = "".join(s.text_stream)
out["anthropic_stream"] = {"text": streamed}
print(json.dumps(out))
