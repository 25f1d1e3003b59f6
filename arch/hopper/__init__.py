"""Hopper pipeline."""
