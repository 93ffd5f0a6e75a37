"""``fsdp-sync faults --fleet`` runs with the fleet's own timeouts (`run_fleet_matrix`'s defaults)
unless --call-timeout / --recv-timeout are given: it ran with the matrix's call timeout (8 s then;
docs/data/faults-fleet.json says call_s 8.0) though check_faults_args said the defaults become the
fleet's own and docs/fleet.md said 6 s."""

from __future__ import annotations

import inspect

import pytest

from fsdp_sync.cli.app import parse_args
from fsdp_sync.cli.faults_fleet import run_fleet_matrix


def test_fleet_takes_its_own_timeouts_unless_given():
    """``--fleet`` ran with the matrix's call timeout (8 s) though its help said the defaults
    become the fleet's own (6 s)."""
    own = inspect.signature(run_fleet_matrix).parameters
    args = parse_args(["faults", "--fleet"])
    assert (args.call_timeout, args.recv_timeout) == (own["call_s"].default, own["recv_s"].default) == (6.0, 6.0)
    args = parse_args(["faults", "--fleet", "--call-timeout", "8"])
    assert (args.call_timeout, args.recv_timeout) == (8.0, 6.0)
    args = parse_args(["faults"])      # the matrix keeps its own
    assert args.call_timeout < args.pg_timeout
    with pytest.raises(SystemExit):
        parse_args(["faults", "--fleet", "--slack", "1"])
