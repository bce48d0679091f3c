"""The OpenAI Agents SDK against llmtap (tests/clients_agents_sdk.rs): a triage agent with one function tool and
one handoff, on the Responses model and on the Chat Completions model, streamed and not. Prints one JSON object
with what each run ended with. Configured only through OPENAI_BASE_URL and OPENAI_API_KEY."""

import asyncio
import json
import os

from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

# Traces would go to api.openai.com; the test has no internet and wants only the model calls.
set_tracing_disabled(True)


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


def agents(model):
    specialist = Agent(
        name="Specialist",
        instructions="You are the weather specialist. Answer briefly.",
        model=model,
    )
    triage = Agent(
        name="Triage",
        instructions="Answer weather questions with get_weather; hand other questions to the specialist.",
        tools=[get_weather],
        handoffs=[specialist],
        model=model,
    )
    return triage


async def run(agent, prompt, streamed):
    if streamed:
        result = Runner.run_streamed(agent, prompt)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, prompt)
    return {"final_output": result.final_output, "last_agent": result.last_agent.name}


async def main():
    client = AsyncOpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
    responses = agents(OpenAIResponsesModel(model="gpt-4o-mini", openai_client=client))
    chat = agents(OpenAIChatCompletionsModel(model="gpt-4o-mini", openai_client=client))
    out = {
        "responses_tool": await run(responses, "Responses run: what is the weather in Paris?", False),
        "responses_handoff": await run(
            responses, "Responses run: [[tool:transfer_to_specialist]] ask the specialist.", True
        ),
        "chat_tool": await run(chat, "Chat run: what is the weather in Paris?", True),
        "chat_handoff": await run(chat, "Chat run: [[tool:transfer_to_specialist]] ask the specialist.", False),
    }
    print(json.dumps(out))


asyncio.run(main())
