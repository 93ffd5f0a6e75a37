"""Integrations with training frameworks. Each submodule imports its framework; this package
imports none of them (``fsdp_sync.integrations.verl`` is loaded by verl through its
``verl.plugins`` entry point)."""
