"""Authoring attention variants (torch): score and mask mods traced into graphs, their
derivatives and kernel view, block masks, documented examples."""
