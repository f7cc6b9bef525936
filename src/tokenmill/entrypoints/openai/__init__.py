"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncLLM``.

``OpenAIServer`` (launcher.py) runs it; ``build_app`` (server.py) is the app;
``serving_chat`` / ``serving_completion`` answer the two generation routes.
"""
