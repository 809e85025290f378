"""Model calls: the OpenAI-compatible client (client.py), reasoning splits (reasoning.py), and the
skeleton every model-calling job shares (job.py): synthesis, salvage, select-steps."""
