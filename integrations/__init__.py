"""Handlers."""
