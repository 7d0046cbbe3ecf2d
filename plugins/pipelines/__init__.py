"""Placeholder until this plugin package is written."""
