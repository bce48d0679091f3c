"""The OpenAI Python SDK's WebSocket clients through llmtap, configured only by OPENAI_BASE_URL: Responses
WebSocket mode (`client.responses.connect()`, a `previous_response_id` chain on one lane) and Realtime
(`client.realtime.connect()`, two responses in one session). Prints one JSON object with what each returned.
"""
import json

import openai


def responses_websocket():
    client = openai.OpenAI()
    out = {"ids": [], "texts": []}
    with client.responses.connect() as conn:
        previous = None
        for text in ["sdk first question", "sdk second question"]:
            params = {"model": "gpt-test", "input": [{"role": "user", "content": text}], "stream_id": "sdk"}
            if previous:
                params["previous_response_id"] = previous
            conn.response.create(**params)
            deltas = ""
            for event in conn:
                if event.type == "response.output_text.delta":
                    deltas += event.delta
                if event.type == "response.completed":
                    previous = event.response.id
                    break
            out["ids"].append(previous)
            out["texts"].append(deltas)
    return out


def realtime():
    client = openai.OpenAI()
    out = {"texts": [], "usage": []}
    with client.realtime.connect(model="gpt-realtime") as conn:
        for text in ["sdk realtime first", "sdk realtime second"]:
            conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
            )
            conn.response.create()
            for event in conn:
                if event.type == "response.done":
                    out["usage"].append(event.response.usage.input_tokens)
                    out["texts"].append(event.response.output[0].content[0].text)
                    break
    return out


print(json.dumps({"responses_websocket": responses_websocket(), "realtime": realtime()}))
