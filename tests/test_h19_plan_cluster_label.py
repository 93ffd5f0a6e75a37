"""`fsdp-sync plan`'s cluster line says when its figures are a preset's (audit H19): the h100-node
and h200-node figures are nominal spec-sheet ones, never measured, and a plan printed on them
said so only in ``--help`` and the JSON's ``source``; the printed line read like a measurement."""

from __future__ import annotations

import dataclasses

from fsdp_sync.cli.plan import cluster_line
from fsdp_sync.plan import CLUSTERS


def test_a_presets_line_says_it_is_a_preset_and_a_changed_one_does_not():
    for name, c in CLUSTERS.items():
        line = cluster_line(c)
        assert line.startswith(f"{name}: ") and line.endswith("; a preset: nominal spec-sheet figures, not measured"), line
        # the same name with other figures (a file edited from a preset, a measured GPU host): not a preset
        other = dataclasses.replace(c, d2d_gbps=c.d2d_gbps / 2)
        assert "preset" not in cluster_line(other), name
