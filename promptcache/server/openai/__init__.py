"""The OpenAI-compatible API: routes (`routes.py`), request models (`wire.py`), response shapes, logprobs and
batched completions. Kept free of imports so the modules load on their own.
"""
