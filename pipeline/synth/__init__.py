"""Synthesis: the LLM backend, the agent loop, task files, environments and the synthesis job."""
