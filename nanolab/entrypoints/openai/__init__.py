"""The OpenAI-compatible server: the wire format (`protocol`) and the aiohttp app (`api_server`)."""
