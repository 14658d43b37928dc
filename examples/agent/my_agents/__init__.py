"""Agents written against the OpenAI API, trained by tpurl (see examples/agent/README.md)."""
