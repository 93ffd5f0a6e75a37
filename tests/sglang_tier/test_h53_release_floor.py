"""H53: the installed SGLang's own release string, as its ``get_server_info`` reports it
(``sglang.version.__version__``), against `versions`: read as the release it is, and not refused by
the release floor (`versions.OLDEST`, `SGLangFeatures.refuse_release`) that refuses anything older
than the ``sglang>=0.5.12`` fsdp_sync supports. Runs in both the 0.5.23 and the 0.5.12 runs."""

from __future__ import annotations

import os

import pytest
from sglang.version import __version__

from fsdp_sync.engines.sglang import versions

pytestmark = [pytest.mark.sglang]


def test_the_installed_release_is_read_and_not_refused():
    want = os.environ.get("FSDP_SYNC_SGLANG_VERSION")
    assert want, "run under make test-sglang (FSDP_SYNC_SGLANG_VERSION names the release)"
    assert versions.reported({"version": __version__}) == __version__
    assert versions.parse(__version__) == versions.parse(want)
    f = versions.features(__version__)
    assert f.refuse_release() is None and versions.parse(__version__) >= versions.OLDEST
    assert want in versions.CHECKED
    older = versions.features("0.4.10")
    assert "SGLang 0.4.10 is older than the releases fsdp_sync supports (>=0.5.12" in older.refuse_release()
