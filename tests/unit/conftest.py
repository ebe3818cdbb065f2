"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def tied(request: pytest.FixtureRequest) -> bool:
    """Whether the test's model ties `lm_head` to `embed_tokens` (as Qwen3-0.6B/1.7B/4B do): every test that
    copies a model (snapshot, checkpoint, publish) runs on both (STYLE 12)."""
    return request.param
