"""Measuring what a conversion costs: calibration corpora, importance matrices, quality scores."""
