"""The OpenAI-compatible HTTP server: FastAPI routes over the async engine (`quanta serve`)."""
