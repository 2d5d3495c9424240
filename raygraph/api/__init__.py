"""The HTTP front door: an OpenAI-compatible FastAPI app over the coordinator, its
Prometheus metrics, and the Ray actor that serves it with uvicorn."""
