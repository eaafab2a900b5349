"""blockspec: an OpenAI-compatible LLM server with DFlash block speculative decoding."""
