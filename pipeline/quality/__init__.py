"""Quality: decontamination, deduplication, negatives and the derived datasets."""
