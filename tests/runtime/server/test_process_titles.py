"""The children carry titles a person can tell apart in ps and top (SGLang's sglang::scheduler form)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


def test_the_children_are_titled(tiny_server):
    info = tiny_server.info()
    for key, title in (("scheduler_pid", "tandem::scheduler"), ("detokenizer_pid", "tandem::detokenizer")):
        cmdline = Path(f"/proc/{info[key]}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        assert cmdline == title, (key, cmdline)
