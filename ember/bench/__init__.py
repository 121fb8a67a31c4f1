"""`ember bench`: a load generator for any OpenAI-compatible server, and the offline engine benchmark."""

# The endpoints `ember bench --api` drives. Here, not in client.py, so that the CLI parser needs no aiohttp.
API_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
