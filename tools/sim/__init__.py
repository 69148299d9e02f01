"""Trace-driven scaling simulator for CIERA's compressed parameter all-gather (see README.md)."""
