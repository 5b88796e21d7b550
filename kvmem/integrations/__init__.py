"""Integrations of kvmem into other serving engines (each imports its engine lazily)."""
