"""Plain http:// calls reaching llmtap only through HTTP_PROXY, as `llmtap run` sets it: the official OpenAI SDK on
an intercepted host (a local model server's name, `http://llm.internal/v1`), and requests on a host off the list.
Prints one JSON object with what each call returned."""
import json
import os
import sys

import openai
import requests

intercepted, blind = sys.argv[1], sys.argv[2]
assert os.environ.get("HTTP_PROXY"), "llmtap run sets HTTP_PROXY"
assert "OPENAI_BASE_URL" not in os.environ

out = {}
oa = openai.OpenAI(base_url=f"http://{intercepted}/v1", max_retries=0)
r = oa.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Say hi"}])
out["openai_chat"] = {"content": r.choices[0].message.content, "total_tokens": r.usage.total_tokens}
text = ""
for chunk in oa.chat.completions.create(
    model="gpt-4o-mini", messages=[{"role": "user", "content": "Say hi again"}], stream=True
):
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
out["openai_stream"] = {"text": text}

resp = requests.post(
    f"http://{blind}/v1/chat/completions",
    json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "not captured"}]},
    headers={"authorization": "Bearer sk-test-PLAINSECRET-blind"},
    timeout=30,
)
out["blind"] = {"status": resp.status_code, "body": resp.text}
print(json.dumps(out))
