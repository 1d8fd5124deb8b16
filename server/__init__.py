"""HTTP layer: FastAPI app, OpenAI schemas, SSE, errors, metrics, settings, CLI."""
