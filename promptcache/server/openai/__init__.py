"""The OpenAI-compatible API (routes, request models, logprobs, batches); no imports, so each module loads alone."""
