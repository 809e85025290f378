"""Publish: Parquet shards, report, dataset card, manifest and the Hub release."""
