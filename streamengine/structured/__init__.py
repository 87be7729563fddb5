"""Structured outputs and tools: specs, the grammar compiler (queue, cache), masks, tool-call parsing and prompts."""
