"""Blackwell pipeline."""
