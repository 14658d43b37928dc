"""An OpenAI-compatible HTTP endpoint in front of the rollout engine (`tpurl serve`).

`tpurl.serve.app` builds the FastAPI application over a `tpurl.generate.Service`; `text` turns
sampled ids into the text a response shows (stop strings, streaming); `tool_calls` parses the
model's tool-call format into OpenAI's structure; `protocol` checks a request and maps it to the
engine's sampling config. FastAPI and uvicorn are the optional extra `tpurl[serve]`.
"""
