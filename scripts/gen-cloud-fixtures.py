#!/usr/bin/env python3
"""Write tests/fixtures/cloud: wire-format fixtures for the cloud routes (Bedrock runtime, Bedrock Mantle,
Vertex AI, Azure OpenAI), built from the providers' documentation (tests/fixtures/cloud/SOURCES.md says which
page each comes from).

Unlike the rest of tests/fixtures these are not recordings: the bodies follow the documented examples (ids,
texts and token counts as in the docs where the docs give them), and the binary AWS event-stream bodies are
encoded here, with CRC-32 checksums from zlib (the checksum the format specifies), independently of the Rust
decoder they test. Standard library only. Run from the repository root: `python3 scripts/gen-cloud-fixtures.py`.
"""

import base64
import json
import os
import struct
import zlib

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "cloud")


def es_message(headers, payload: bytes) -> bytes:
    """One AWS event-stream message: prelude (total, headers length, CRC), string headers, payload, CRC."""
    h = b""
    for name, value in headers:
        n, v = name.encode(), value.encode()
        h += struct.pack(">B", len(n)) + n + b"\x07" + struct.pack(">H", len(v)) + v
    total = 12 + len(h) + len(payload) + 4
    prelude = struct.pack(">II", total, len(h))
    prelude += struct.pack(">I", zlib.crc32(prelude))
    msg = prelude + h + payload
    return msg + struct.pack(">I", zlib.crc32(msg))


def es_event(event_type: str, payload: dict) -> bytes:
    return es_message(
        [(":event-type", event_type), (":content-type", "application/json"), (":message-type", "event")],
        json.dumps(payload, separators=(",", ":")).encode(),
    )


def es_chunk(anthropic_event: dict) -> bytes:
    """InvokeModelWithResponseStream: a `chunk` event whose PayloadPart holds the model's event as base64."""
    inner = json.dumps(anthropic_event, separators=(",", ":")).encode()
    return es_event("chunk", {"bytes": base64.b64encode(inner).decode(), "p": "abcdefghijklmnopqrstuvwxyzABCDEFGH"})


def es_exception(kind: str, message: str) -> bytes:
    return es_message(
        [(":exception-type", kind), (":content-type", "application/json"), (":message-type", "exception")],
        json.dumps({"message": message}).encode(),
    )


def write(name, url, request, *, status=200, response=None, eventstream=None, sse=None, headers=None, what=""):
    d = os.path.join(ROOT, name)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    with open(os.path.join(d, "request.json"), "w") as f:
        json.dump(request, f, indent=2)
        f.write("\n")
    content_type = "application/json"
    if response is not None:
        with open(os.path.join(d, "response.json"), "w") as f:
            json.dump(response, f, indent=2)
            f.write("\n")
    if eventstream is not None:
        content_type = "application/vnd.amazon.eventstream"
        with open(os.path.join(d, "response.eventstream"), "wb") as f:
            f.write(b"".join(eventstream))
    if sse is not None:
        content_type = "text/event-stream"
        with open(os.path.join(d, "response.sse"), "w") as f:
            f.write(sse)
    meta = {
        "url": url,
        "method": "POST",
        "status": {"code": status},
        "response_headers": {"content-type": [content_type], **(headers or {})},
        "what": what,
    }
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")


def sse(events):
    return "".join(f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n" for name, data in events)


def sse_data(chunks, done=True):
    out = "".join(f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks)
    return out + ("data: [DONE]\n\n" if done else "")


BEDROCK = "https://bedrock-runtime.us-east-1.amazonaws.com"
SONNET_BEDROCK = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a given location",
    "input_schema": {
        "type": "object",
        "properties": {"location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"}},
        "required": ["location"],
    },
}


def anthropic_tool_stream(msg_id, model, usage_start, usage_end):
    """The documented Anthropic stream of a text block then a tool_use block (Anthropic streaming docs)."""
    return [
        {"type": "message_start", "message": {"id": msg_id, "type": "message", "role": "assistant", "model": model,
                                               "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": usage_start}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Okay, let's check"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " the weather for San Francisco, CA:"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6", "name": "get_weather", "input": {}}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"location\":"}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": " \"San Francisco, CA\"}"}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": usage_end},
    ]


def bedrock():
    # InvokeModel, Anthropic Messages body (bedrock-2023-05-31), answered with a tool call.
    req = {
        "anthropic_version": "bedrock-2023-05-31",
        "max_tokens": 1024,
        "system": [{"type": "text", "text": "You are a weather assistant.", "cache_control": {"type": "ephemeral"}}],
        "tools": [WEATHER_TOOL],
        "messages": [{"role": "user", "content": "What is the weather like in San Francisco?"}],
    }
    write("bedrock/invoke_tool_use", f"{BEDROCK}/model/{SONNET_BEDROCK}/invoke", req, response={
        "id": "msg_bdrk_01Aq9w938a90dw8q",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5-20250929",
        "content": [
            {"type": "text", "text": "I'll check the current weather in San Francisco for you."},
            {"type": "tool_use", "id": "toolu_bdrk_01A09q90qw90lq917835lq9", "name": "get_weather",
             "input": {"location": "San Francisco, CA"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 384, "cache_creation_input_tokens": 1024, "cache_read_input_tokens": 0,
                  "output_tokens": 72},
    }, headers={"x-amzn-bedrock-input-token-count": ["1408"], "x-amzn-bedrock-output-token-count": ["72"]},
        what="InvokeModel with the Anthropic body (no model member; anthropic_version bedrock-2023-05-31); tool_use answer with a prompt-cache write")

    # InvokeModelWithResponseStream: the same Anthropic events, each base64 in a `chunk` PayloadPart; the last
    # carries amazon-bedrock-invocationMetrics.
    events = anthropic_tool_stream(
        "msg_bdrk_014p7gG3wDgGV9EUtLvnow3U", "claude-sonnet-4-5-20250929",
        {"input_tokens": 472, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 1024, "output_tokens": 2},
        {"output_tokens": 89},
    )
    events.append({"type": "message_stop", "amazon-bedrock-invocationMetrics": {
        "inputTokenCount": 1496, "outputTokenCount": 89, "invocationLatency": 1791, "firstByteLatency": 512}})
    req_stream = dict(req)
    req_stream["messages"] = [{"role": "user", "content": "What is the weather like in San Francisco?"}]
    write("bedrock/invoke_stream_tool_use", f"{BEDROCK}/model/{SONNET_BEDROCK.replace(':', '%3A')}/invoke-with-response-stream",
          req_stream, eventstream=[es_chunk(e) for e in events],
          headers={"x-amzn-bedrock-content-type": ["application/json"]},
          what="InvokeModelWithResponseStream: AWS event-stream `chunk` events, each {\"bytes\": base64 Anthropic event}; model id percent-encoded in the path as the SDKs send it; cache read; invocation metrics on message_stop")

    # Converse with a tool (the AWS user guide's "top song" tool-use example), then the tool result round.
    tool_config = {"tools": [{"toolSpec": {
        "name": "top_song",
        "description": "Get the most popular song played on a radio station.",
        "inputSchema": {"json": {"type": "object", "properties": {"sign": {
            "type": "string",
            "description": "The call sign for the radio station for which you want the most popular song. Example calls signs are WZPZ and WKRP."}},
            "required": ["sign"]}}}}]}
    user = {"role": "user", "content": [{"text": "What is the most popular song on WZPZ?"}]}
    assistant = {"role": "assistant", "content": [
        {"text": "I'll look up the most popular song on WZPZ."},
        {"toolUse": {"toolUseId": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q", "name": "top_song", "input": {"sign": "WZPZ"}}}]}
    write("bedrock/converse_tool_use", f"{BEDROCK}/model/{SONNET_BEDROCK}/converse", {
        "messages": [user],
        "system": [{"text": "You are a radio assistant."}, {"cachePoint": {"type": "default"}}],
        "inferenceConfig": {"maxTokens": 512, "temperature": 0.5},
        "toolConfig": tool_config,
    }, response={
        "output": {"message": assistant},
        "stopReason": "tool_use",
        "usage": {"inputTokens": 375, "outputTokens": 61, "totalTokens": 1436, "cacheReadInputTokens": 0,
                  "cacheWriteInputTokens": 1000},
        "metrics": {"latencyMs": 1531},
    }, what="Converse: system blocks with a cachePoint, toolConfig.tools[].toolSpec, a toolUse answer; usage with cacheWriteInputTokens (totalTokens = input + output + cache)")

    result = {"role": "user", "content": [{"toolResult": {"toolUseId": "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q",
                                                           "content": [{"json": {"song": "Elemental Hotel", "artist": "8 Storey Hike"}}],
                                                           "status": "success"}}]}
    stream = [
        es_event("messageStart", {"p": "abcdefghijklmnopqrstuvwxyzABCD", "role": "assistant"}),
        es_event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"reasoningContent": {"text": "The tool returned the song."}}, "p": "abcdefgh"}),
        es_event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"reasoningContent": {"signature": "ErcBCkgIBxABGAIiQJ5k"}}, "p": "abcd"}),
        es_event("contentBlockStop", {"contentBlockIndex": 0, "p": "abcdefghijkl"}),
        es_event("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"text": "The most popular song on WZPZ is "}, "p": "abcdefghijklmnop"}),
        es_event("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"text": "Elemental Hotel by 8 Storey Hike."}, "p": "abcdef"}),
        es_event("contentBlockStop", {"contentBlockIndex": 1, "p": "abcdefghijklmnopqrstu"}),
        es_event("contentBlockStart", {"contentBlockIndex": 2, "start": {"toolUse": {"toolUseId": "tooluse_Xq8BfQ7mT1mAb9F0c2D3eA", "name": "top_song"}}, "p": "abcdefghijk"}),
        es_event("contentBlockDelta", {"contentBlockIndex": 2, "delta": {"toolUse": {"input": "{\"sign\": "}}, "p": "abcdefghijklmnopq"}),
        es_event("contentBlockDelta", {"contentBlockIndex": 2, "delta": {"toolUse": {"input": "\"WKRP\"}"}}, "p": "abcdefghij"}),
        es_event("contentBlockStop", {"contentBlockIndex": 2, "p": "abcdefghijklmnopqrstuvwxyzABCDE"}),
        es_event("messageStop", {"p": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOP", "stopReason": "tool_use"}),
        es_event("metadata", {"metrics": {"latencyMs": 1897}, "p": "abcdefghijklmnopqrstuvwxyzA",
                              "usage": {"inputTokens": 442, "outputTokens": 83, "totalTokens": 1525,
                                        "cacheReadInputTokens": 1000, "cacheWriteInputTokens": 0}}),
    ]
    write("bedrock/converse_stream_tool_round", f"{BEDROCK}/model/{SONNET_BEDROCK}/converse-stream", {
        "messages": [user, assistant, result, {"role": "user", "content": [{"text": "And on WKRP?"}]}],
        "system": [{"text": "You are a radio assistant."}, {"cachePoint": {"type": "default"}}],
        "inferenceConfig": {"maxTokens": 512},
        "additionalModelRequestFields": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        "toolConfig": tool_config,
    }, eventstream=stream,
        what="ConverseStream: reasoningContent text and signature deltas, text deltas, a toolUse block (contentBlockStart + input fragments), messageStop, metadata usage with a cache read; a toolResult with json content in the request")

    write("bedrock/converse_stream_throttled", f"{BEDROCK}/model/{SONNET_BEDROCK}/converse-stream", {
        "messages": [user], "inferenceConfig": {"maxTokens": 512},
    }, eventstream=[
        es_event("messageStart", {"p": "abcdefghijklmnopqrstuvwxyzABCD", "role": "assistant"}),
        es_event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "The most popular"}, "p": "abcdef"}),
        es_exception("throttlingException", "Too many tokens, please wait before trying again."),
    ], what="ConverseStream cut by a throttlingException (an event-stream `exception` message) after the first text delta")


def mantle():
    host = "https://bedrock-mantle.us-east-1.api.aws"
    write("mantle/anthropic_messages", f"{host}/anthropic/v1/messages", {
        "model": "anthropic.claude-opus-4-7",
        "max_tokens": 1024,
        "messages": [{"role": "user", "content": "Hello, Claude"}],
    }, response={
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
        "type": "message",
        "role": "assistant",
        "model": "anthropic.claude-opus-4-7",
        "content": [{"type": "text", "text": "Hello! How can I help you today?"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 12},
    }, what="Bedrock Mantle, Anthropic Messages API at /anthropic/v1/messages (the body names the Bedrock model id)")
    write("mantle/openai_responses", f"{host}/openai/v1/responses", {
        "model": "openai.gpt-oss-120b-1:0",
        "instructions": "You are a concise assistant.",
        "input": "Tell me a three sentence bedtime story about a unicorn.",
    }, response={
        "id": "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b",
        "object": "response",
        "created_at": 1741476542,
        "status": "completed",
        "model": "openai.gpt-oss-120b-1:0",
        "output": [{"type": "message", "id": "msg_67ccd2bf17f0819081ff3bb2cf6508e60bb6a6b452d3795b",
                    "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "annotations": [],
                                 "text": "In a peaceful grove beneath a silver moon, a unicorn named Lumina discovered a hidden pool that reflected the stars. As she dipped her horn into the water, the pool began to shimmer, revealing a pathway to a magical realm of endless night skies. Filled with wonder, Lumina whispered a wish for all who dream to find their own hidden magic, and as she glanced back, her hoofprints sparkled like stardust."}]}],
        "previous_response_id": None,
        "usage": {"input_tokens": 36, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": 87, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 123},
    }, what="Bedrock Mantle, OpenAI Responses API at /openai/v1/responses (the body names the Bedrock model id)")


def vertex():
    base = "https://us-east5-aiplatform.googleapis.com/v1/projects/my-project/locations/us-east5/publishers"
    write("vertex/anthropic_raw_predict", f"{base}/anthropic/models/claude-sonnet-4-5@20250929:rawPredict", {
        "anthropic_version": "vertex-2023-10-16",
        "messages": [{"role": "user", "content": "Hey Claude!"}],
        "max_tokens": 100,
    }, response={
        "id": "msg_vrtx_01Kh5bA8jxrLWZi3n1xYsZ7Q",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5-20250929",
        "content": [{"type": "text", "text": "Hello! How can I assist you today?"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 12},
    }, what="Claude on Vertex AI, rawPredict: the model only in the path (publisher model claude-sonnet-4-5@20250929), anthropic_version vertex-2023-10-16")
    events = anthropic_tool_stream(
        "msg_vrtx_01PwCXa6wQ5hGU9h9C6kA1Zn", "claude-sonnet-4-5-20250929",
        {"input_tokens": 402, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 1},
        {"output_tokens": 89},
    )
    events.append({"type": "message_stop"})
    write("vertex/anthropic_stream_raw_predict", f"{base}/anthropic/models/claude-sonnet-4-5@20250929:streamRawPredict", {
        "anthropic_version": "vertex-2023-10-16",
        "messages": [{"role": "user", "content": "What is the weather like in San Francisco?"}],
        "tools": [WEATHER_TOOL],
        "max_tokens": 1024,
        "stream": True,
    }, sse=sse([(e["type"], e) for e in events]),
        what="Claude on Vertex AI, streamRawPredict: Anthropic SSE (text then a tool_use block with input_json_delta fragments)")
    write("vertex/gemini_generate_content", f"{base}/google/models/gemini-2.5-flash:generateContent", {
        "contents": [{"role": "user", "parts": [{"text": "Why is the sky blue?"}]}],
        "generationConfig": {"temperature": 0.2, "maxOutputTokens": 256},
    }, response={
        "candidates": [{"content": {"role": "model", "parts": [{"text": "The sky appears blue because of Rayleigh scattering: air molecules scatter short blue wavelengths of sunlight far more than long red ones."}]},
                        "finishReason": "STOP", "avgLogprobs": -0.21}],
        "usageMetadata": {"promptTokenCount": 6, "candidatesTokenCount": 28, "totalTokenCount": 58,
                          "thoughtsTokenCount": 24, "trafficType": "ON_DEMAND",
                          "promptTokensDetails": [{"modality": "TEXT", "tokenCount": 6}],
                          "candidatesTokensDetails": [{"modality": "TEXT", "tokenCount": 28}]},
        "modelVersion": "gemini-2.5-flash",
        "createTime": "2025-06-24T19:27:52.129431Z",
        "responseId": "mPxaaLDJCOvn-O4Pu9-pqQc",
    }, what="Gemini on Vertex AI, generateContent under /v1/projects/{p}/locations/{l}/publishers/google/models/{m}; Vertex's usageMetadata (trafficType, thoughts)")


def azure():
    host = "https://my-resource.openai.azure.com"
    write("azure/deployment_chat", f"{host}/openai/deployments/my-gpt-4o/chat/completions?api-version=2024-10-21", {
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "Does Azure OpenAI support customer managed keys?"}],
        "max_tokens": 800,
    }, response={
        "id": "chatcmpl-A1b2C3d4E5f6G7h8I9j0",
        "object": "chat.completion",
        "created": 1729000000,
        "model": "gpt-4o-2024-11-20",
        "system_fingerprint": "fp_04751d0b65",
        "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": {
            "hate": {"filtered": False, "severity": "safe"}, "self_harm": {"filtered": False, "severity": "safe"},
            "sexual": {"filtered": False, "severity": "safe"}, "violence": {"filtered": False, "severity": "safe"}}}],
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": "Yes, customer managed keys are supported by Azure OpenAI.", "refusal": None},
                     "content_filter_results": {"hate": {"filtered": False, "severity": "safe"},
                                                "self_harm": {"filtered": False, "severity": "safe"},
                                                "sexual": {"filtered": False, "severity": "safe"},
                                                "violence": {"filtered": False, "severity": "safe"}}}],
        "usage": {"prompt_tokens": 29, "completion_tokens": 13, "total_tokens": 42,
                  "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                  "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                                "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}},
    }, what="Azure OpenAI deployment chat completions (api-version query; no model in the body: the deployment names it); content filter results")
    write("azure/deployment_chat_stream", f"{host}/openai/deployments/my-gpt-4o/chat/completions?api-version=2024-10-21", {
        "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }, sse=sse_data([
        {"choices": [], "created": 0, "id": "", "model": "", "object": "", "prompt_filter_results": [
            {"prompt_index": 0, "content_filter_results": {"hate": {"filtered": False, "severity": "safe"}}}]},
        {"choices": [{"delta": {"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": "call_Vn1uJ2Xq3C8bK1Q0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
            "finish_reason": None, "index": 0, "logprobs": None}],
         "created": 1729000001, "id": "chatcmpl-B2c3D4e5F6g7", "model": "gpt-4o-2024-11-20", "object": "chat.completion.chunk",
         "system_fingerprint": "fp_04751d0b65"},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]}, "finish_reason": None, "index": 0}],
         "created": 1729000001, "id": "chatcmpl-B2c3D4e5F6g7", "model": "gpt-4o-2024-11-20", "object": "chat.completion.chunk"},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": " \"Paris\"}"}}]}, "finish_reason": None, "index": 0}],
         "created": 1729000001, "id": "chatcmpl-B2c3D4e5F6g7", "model": "gpt-4o-2024-11-20", "object": "chat.completion.chunk"},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls", "index": 0}],
         "created": 1729000001, "id": "chatcmpl-B2c3D4e5F6g7", "model": "gpt-4o-2024-11-20", "object": "chat.completion.chunk"},
        {"choices": [], "created": 1729000001, "id": "chatcmpl-B2c3D4e5F6g7", "model": "gpt-4o-2024-11-20",
         "object": "chat.completion.chunk",
         "usage": {"prompt_tokens": 52, "completion_tokens": 17, "total_tokens": 69,
                   "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}}},
    ]), what="Azure OpenAI deployment, streamed: the first chunk holds only prompt_filter_results (no choices, empty model); a tool call in fragments; stream_options usage chunk")
    write("azure/v1_responses_cache_write", f"{host}/openai/v1/responses", {
        "model": "my-gpt-5-6",
        "instructions": "You are a support assistant for Contoso. Answer from the policy below.\n" + "Policy text. " * 200,
        "input": "This is a test.",
        "prompt_cache_key": "contoso-support",
    }, response={
        "id": "resp_68b7c5f4c3a48190a5e6f2b2f0a0b1c2",
        "object": "response",
        "created_at": 1756874228,
        "status": "completed",
        "model": "gpt-5.6-terra",
        "output": [{"id": "msg_68b7c5f5", "type": "message", "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "annotations": [], "text": "Great! How can I help you today?"}]}],
        "usage": {"input_tokens": 1438, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 1408},
                  "output_tokens": 10, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 1448},
    }, what="Azure OpenAI v1 API (/openai/v1/responses, the body's model is the deployment name); a GPT-5.6 model's prompt-cache write in usage.input_tokens_details.cache_write_tokens (part of input_tokens)")


if __name__ == "__main__":
    bedrock()
    mantle()
    vertex()
    azure()
