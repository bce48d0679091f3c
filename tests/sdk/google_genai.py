"""google-genai against llmtap (tests/clients_google_genai.rs): automatic function calling with a Python function
tool, with generate_content and generate_content_stream. Prints one JSON object with each run's final text.
Configured only through the base URL and key in the environment."""

import json
import os

from google import genai
from google.genai import types


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


client = genai.Client(
    api_key=os.environ["GEMINI_API_KEY"],
    http_options=types.HttpOptions(base_url=os.environ["GEMINI_BASE_URL"]),
)
config = types.GenerateContentConfig(tools=[get_weather])
generated = client.models.generate_content(
    model="gemini-2.5-flash", contents="Gemini generate: weather in Paris?", config=config
)
streamed = "".join(
    chunk.text or ""
    for chunk in client.models.generate_content_stream(
        model="gemini-2.5-flash", contents="Gemini stream: weather in Paris?", config=config
    )
)
print(json.dumps({"generate": generated.text, "stream": streamed}))
