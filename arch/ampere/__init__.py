"""Ampere pipeline."""
