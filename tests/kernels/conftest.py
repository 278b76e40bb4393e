"""Every kernel launch in these tests is followed by a check that the split-K counters
(kernels/_tiles.py) are back at zero: a launch that leaves one counted in would make the
next launch skip writing that tile, so it fails the test that made it, at that launch."""

import pytest
import torch

from qlab.kernels import _tiles, configs


def assert_counters_at_zero(what: str) -> None:
    for device, counters in _tiles._COUNTERS.items():
        dirty = torch.nonzero(counters).flatten().tolist()
        assert not dirty, f"split-K counters {dirty[:8]} on {device} are not zero after {what}"


@pytest.fixture(autouse=True)
def split_k_counters_back_at_zero(monkeypatch):
    launch = configs.Launch.__call__

    def launch_and_check(self: configs.Launch) -> None:
        launch(self)
        assert_counters_at_zero(f"a launch of {self.describe()}")

    monkeypatch.setattr(configs.Launch, "__call__", launch_and_check)
    yield
    assert_counters_at_zero("the test")


@pytest.fixture
def counters_at_zero():
    """The check itself, for a test to call where it wants (after an aborted launch)."""
    return assert_counters_at_zero
