"""Ingest: upstream dialects, normalization to the record schema, validation with reasons."""
